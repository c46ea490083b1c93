"""Imports point down only (docs/design.md "Layers"): read every module of custom/medflare with ``ast`` and refuse an import
that climbs a layer, crosses from one algorithm into another, or reaches the test harness from runtime code.

Layers, bottom first (a module may import its own layer's package and any layer below):

    0  medflare (the errors), then medflare.checks (which imports the errors), then medflare.settings (the typed
       settings sections, which import checks; its registry names the sections' classes as strings, imported when read)
    1  medflare.data, medflare.nets, medflare.metrics
    2  medflare.presets
    3  medflare.common
    4  the algorithms: baselines, fedsm, fedvck, fediod, fedst (none imports another)
    5  medflare.recipes (every algorithm's recipe by name), medflare.evaluation (``medflare evaluate`` as a function)
    6  medflare.jobs (export, customise and simulate a recipe's job)
    7  medflare.report
    8  medflare.cli (the shell over the library functions; nothing imports it)
    -  medflare.testing: what only tests use; no runtime module imports it or names one of its classes by path

Imports inside functions count as much as those at the top. A module that finds plug-ins walks no package
(``pkgutil``): result kinds come from the ``medflare.result_kinds`` entry points.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "custom" / "medflare"
ALGORITHMS = ("baselines", "fedsm", "fedvck", "fediod", "fedst")
LAYERS = {
    "medflare": -1, "checks": 0, "settings": 0.5,
    "data": 1, "nets": 1, "metrics": 1,
    "presets": 2,
    "common": 3,
    **{name: 4 for name in ALGORITHMS},
    "recipes": 5, "evaluation": 5,
    "jobs": 6,
    "report": 7,
    "cli": 8,
}
TESTING = "testing"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _unit(module: str) -> str:
    """The layer unit of a module name: its first name under ``medflare`` (``medflare`` itself for the package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "medflare"


def _imports(module: str, path: Path) -> list[tuple[int, str]]:
    """``(line, imported medflare module)`` of every import in the file (relative ones resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "medflare"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.split(".")[0] != "medflare":
                continue
            if name == "medflare":  # ``from medflare import data`` imports the sub-package
                out += [(node.lineno, f"medflare.{a.name}") if f"medflare.{a.name}" in _modules() else (node.lineno, name)
                        for a in node.names]
            else:
                out.append((node.lineno, name))
    return out


def violations() -> list[str]:
    found = []
    for module, path in _modules().items():
        src = _unit(module)
        where = str(path.relative_to(PACKAGE.parent)) if path.is_relative_to(PACKAGE.parent) else str(path)
        if src not in LAYERS and src != TESTING:
            found.append(f"{where}: module '{module}' is in no layer (add its unit to LAYERS)")
            continue
        for line, target in _imports(module, path):
            dst = _unit(target)
            if dst == src:
                continue
            what = f"{where}:{line} imports {target}"
            if dst == TESTING:
                if src != TESTING:
                    found.append(f"{what}: runtime code must not depend on the test harness")
                continue
            if src == TESTING:
                continue
            if dst not in LAYERS:
                found.append(f"{what}: unknown unit '{dst}'")
            elif dst in ALGORITHMS and src in ALGORITHMS:
                found.append(f"{what}: one algorithm imports another")
            elif LAYERS[dst] >= LAYERS[src] and not (LAYERS[dst] == LAYERS[src] == 1):
                found.append(f"{what}: points up ({src}, layer {LAYERS[src]} -> {dst}, layer {LAYERS[dst]})")
        if src != TESTING:
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("medflare.testing."):
                    found.append(f"{where}:{node.lineno} names '{node.value}': runtime code adds a test-harness class by path")
                if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                        a.name == "pkgutil" for a in node.names) | (getattr(node, "module", None) == "pkgutil"):
                    found.append(f"{where}:{node.lineno} imports pkgutil: plug-ins register by entry point, no package walk")
    return found


def test_imports_point_down():
    assert violations() == []


@pytest.mark.parametrize("src, target, expected", [
    ("medflare.nets.convnet", "from medflare.common.training import make_loader", "points up"),
    ("medflare.fedsm.executor", "from medflare.fediod import config", "one algorithm imports another"),
    ("medflare.report.runner", "import medflare.cli", "points up"),
    ("medflare.jobs.simulate", "from medflare.testing.widgets import ModelRecorder", "test harness"),
    ("medflare.common.results", "import pkgutil", "pkgutil"),
])
def test_the_rule_catches(tmp_path, monkeypatch, src, target, expected):
    """The checker itself: a planted bad import in a copy of a module is reported."""
    modules = _modules()
    fake = tmp_path / "fake.py"
    fake.write_text(target + "\n")
    monkeypatch.setitem(globals(), "_modules", lambda: {**modules, src: fake})
    planted = [v for v in violations() if v.startswith(str(fake))]
    assert len(planted) == 1 and expected in planted[0]
