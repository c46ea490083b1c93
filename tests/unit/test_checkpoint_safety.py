"""A checkpoint that carries pickled code is refused with one line naming the file, and its code never runs;
nothing in the package loads a file with pickle (every ``torch.load`` passes ``weights_only=True``)."""

from __future__ import annotations

import ast
import os
import pickle
from pathlib import Path

import pytest
import torch

import medflare
from medflare import ResultFileError
from medflare.common.results import read_checkpoint

PACKAGE = Path(medflare.__file__).parent


class _RunsCode:
    """Unpickling this calls ``os.system``: creates ``marker`` if the loader ever executes pickled code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _writers(marker: Path):
    payload = {"model": {"w": torch.zeros(2)}, "extra": _RunsCode(marker)}
    return {
        "zip": lambda p: torch.save(payload, p),
        "legacy": lambda p: torch.save(payload, p, _use_new_zipfile_serialization=False),
        "raw_pickle": lambda p: p.write_bytes(pickle.dumps(payload, protocol=2)),
        "raw_pickle_v5": lambda p: p.write_bytes(pickle.dumps(payload, protocol=5)),
    }


@pytest.mark.parametrize("fmt", ["zip", "legacy", "raw_pickle", "raw_pickle_v5"])
def test_a_malicious_pickle_is_refused_in_one_line_and_never_runs(tmp_path, fmt):
    marker = tmp_path / "ran"
    path = tmp_path / f"evil_{fmt}.pt"
    _writers(marker)[fmt](path)
    with pytest.raises(ResultFileError) as info:
        read_checkpoint(path)
    message = str(info.value)
    assert not marker.exists(), "the pickled code ran"
    assert "\n" not in message and str(path) in message
    assert "refus" in message and any(w in message for w in ("GLOBAL", "system", "Unsupported operand"))  # and what
    assert "weights_only" not in message  # not torch's advice to rerun without weights-only loading


def test_a_plain_checkpoint_still_loads(tmp_path):
    torch.save({"model": {"w": torch.ones(3)}, "round": 4}, tmp_path / "ok.pt")
    data = read_checkpoint(tmp_path / "ok.pt")
    assert data["round"] == 4 and torch.equal(data["model"]["w"], torch.ones(3))


def _torch_load_calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load":
            base = node.func.value
            if isinstance(base, ast.Name) and base.id == "torch":
                yield node


def test_no_module_of_the_package_loads_with_pickle():
    """Every ``torch.load(...)`` in medflare passes ``weights_only=True``; no module imports pickle to load."""
    offenders, calls = [], 0
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for call in _torch_load_calls(tree):
            calls += 1
            kw = {k.arg: k.value for k in call.keywords}
            if not (isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True):
                offenders.append(f"{path.relative_to(PACKAGE)}:{call.lineno}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("load", "loads") \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in ("pickle", "cPickle", "dill", "joblib"):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno} ({node.func.value.id}.{node.func.attr})")
            if isinstance(node, ast.keyword) and node.arg == "allow_pickle" and not (
                    isinstance(node.value, ast.Constant) and node.value.value is False):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.value.lineno} (allow_pickle)")
    assert calls >= 3, "the scan found no torch.load at all: it is looking in the wrong place"
    assert not offenders, f"loads that may run pickled code: {offenders}"
