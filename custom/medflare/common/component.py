"""What every medflare FLARE component shares: its constructor arguments kept as given.

FLARE's job export (what a Recipe's ``export`` and ``SimEnv`` run) writes a component into the job
config by reading back, for each constructor parameter, the attribute of the same name. A component
that calls :func:`keep_args` in its constructor is exported with every knob, defaults included, so an
exported job folder documents itself and equals the hand-readable folders under ``jobs/``.
Rule that goes with it: a component never rebinds these attribute names to anything else (runtime
objects get other names, e.g. ``torch_device`` beside the ``device`` argument).
"""

from __future__ import annotations

import copy
from typing import Any


def keep_args(component: Any, **args: Any) -> None:
    """Store each constructor argument as ``component.<name>`` (a copy of its JSON value) and export all of them
    (a subclass calls it again for its own arguments)."""
    for name, value in args.items():
        setattr(component, name, copy.deepcopy(value))
    component._always_serialize_args = tuple(dict.fromkeys((*getattr(component, "_always_serialize_args", ()), *args)))
