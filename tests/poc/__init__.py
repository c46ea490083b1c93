"""POC tests. ``pocfed`` is provisioning/pocfed.py (a script, not a package), loaded once for all of them."""

import importlib.util
import sys
from pathlib import Path


def _load_pocfed():
    spec = importlib.util.spec_from_file_location("pocfed", Path(__file__).resolve().parents[2] / "provisioning" / "pocfed.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["pocfed"] = module
    spec.loader.exec_module(module)
    return module


pocfed = _load_pocfed()
