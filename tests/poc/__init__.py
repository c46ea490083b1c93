"""POC tests. ``pocfed`` is provisioning/pocfed.py (a script, not a package), loaded once for all of them."""

import contextlib
import importlib.util
import os
import sys
from pathlib import Path


def _load_pocfed():
    spec = importlib.util.spec_from_file_location("pocfed", Path(__file__).resolve().parents[2] / "provisioning" / "pocfed.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["pocfed"] = module
    spec.loader.exec_module(module)
    return module


pocfed = _load_pocfed()


@contextlib.contextmanager
def poc_federation(tmp_path_factory, preset: str, n_sites: int, **kwargs):
    """A started POC federation of ``n_sites`` hospitals for one test module, data of ``preset`` written by `medflare
    data`, HOME isolated (the Session API in this process touches nothing under the user's ~); on exit stopped, and
    no process of it may be left. Attributes added: ``data``, ``jobs_dir``, ``results``. ``kwargs`` go to PocFederation."""
    from medflare.cli import main as medflare_main

    stale = pocfed.kill_stale_test_federations()  # of earlier runs killed before their teardown
    if stale:
        print(f"killed processes of stale POC federations: {stale}")
    root = tmp_path_factory.mktemp("poc")
    federation = pocfed.PocFederation(root / "fed", n_sites=n_sites, data_dir=root / "data", owner_pid=os.getpid(), **kwargs)
    old_home = os.environ.get("HOME")
    os.environ["HOME"] = str(federation.home)
    try:
        federation.prepare()
        assert medflare_main(["data", "--preset", preset, "--sites", ",".join(federation.sites), "--out", str(root / "data")]) == 0
        federation.start(timeout=180)
        federation.data = root / "data"
        federation.jobs_dir = root / "jobs"
        federation.results = root / "results"
        yield federation
    finally:
        federation.stop()
        if old_home is not None:
            os.environ["HOME"] = old_home
        leftovers = federation.pids()
        assert not leftovers, f"POC processes left running: {leftovers}"
