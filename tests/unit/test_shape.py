"""Every algorithm sub-package has the shape custom/medflare/README.md writes down, read from the code (no imports of
the algorithms, except the shared components the README names): the same file names for the same roles, every
other module a math module the README lists, math that imports no FLARE, each result KIND string written once (in its
``results.py``), and only ``persistor.py`` modules writing files (the README's exceptions aside)."""

from __future__ import annotations

import ast
import importlib
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "custom" / "medflare"
README = PACKAGE / "README.md"
ALGORITHMS = ("baselines", "fedsm", "fedvck", "fediod", "fedst")

#: calls that write a file: ``torch.save``, ``save_checkpoint``, ``np.save[z]``, ``json.dump``, ``Path.write_*``, ...
WRITERS = {"save", "save_checkpoint", "savez", "savez_compressed", "dump", "write_bytes", "write_text", "to_filename"}


def _table(section: str) -> list[list[str]]:
    """The rows (cells stripped, header and rule left out) of the first table under ``## {section}`` in the README."""
    text = README.read_text()
    found = re.search(rf"^## {re.escape(section)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert found, f"{README} has no section '## {section}'"
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in found.group(1).splitlines()
            if line.startswith("|")]
    return rows[2:]


def _code(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _roles() -> dict[str, str]:
    """Role name -> its file (``config`` -> ``config.py``), from the README's role table."""
    files = [_code(row[0])[0] for row in _table("Roles") if _code(row[0])]
    return {f.removesuffix(".py"): f for f in files if f.endswith(".py")}


def _per_algorithm() -> dict[str, dict[str, str]]:
    """Algorithm -> role -> the README's cell for it."""
    text = README.read_text()
    header = re.search(r"^## Roles per algorithm\n+\|(.*)\|$", text, re.M).group(1)
    algorithms = [c.strip() for c in header.split("|")][1:]
    assert tuple(algorithms) == ALGORITHMS, f"the README's per-algorithm table has columns {algorithms}"
    return {algo: {row[0]: row[i + 1] for row in _table("Roles per algorithm")} for i, algo in enumerate(algorithms)}


def _math() -> dict[str, dict[str, str]]:
    """Algorithm -> math module file -> what it computes."""
    out: dict[str, dict[str, str]] = {a: {} for a in ALGORITHMS}
    for algo, module, what in _table("Math per algorithm"):
        out[algo][_code(module)[0]] = what
    return out


def _exceptions(rule: str) -> dict[str, str]:
    """``algo/module.py`` -> its README row's reason, for the exceptions to ``rule``."""
    return {_code(row[0])[0]: row[2] for row in _table("Exceptions") if row[1] == rule}


def _modules(algo: str) -> dict[str, Path]:
    return {p.name: p for p in sorted((PACKAGE / algo).glob("*.py")) if p.name != "__init__.py"}


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_the_readme_names_every_role_once_and_every_algorithm():
    roles = _roles()
    assert set(roles) == {"config", "protocol", "executor", "controller", "persistor", "results", "recipe", "options",
                          "filters"}
    for algo, cells in _per_algorithm().items():
        assert set(cells) == set(roles), f"{algo}: the per-algorithm table's roles {sorted(cells)} differ from {sorted(roles)}"


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_role_files_are_the_readme_table(algo):
    """A role file exists exactly where the README's per-algorithm table names it; a shared one is importable."""
    roles, cells = _roles(), _per_algorithm()[algo]
    present = {f for f in _modules(algo) if f in roles.values()}
    declared = {roles[r] for r, cell in cells.items() if _code(cell) == [roles[r]] and not cell.startswith("shared:")}
    assert present == declared, (f"{algo}: role files {sorted(present)}, README table says {sorted(declared)} "
                                 "(change custom/medflare/README.md with the code)")
    for role, cell in cells.items():
        if cell.startswith("shared:"):
            module, _, name = _code(cell)[0].rpartition(".")
            assert hasattr(importlib.import_module(module), name), f"{algo}/{role}: README's shared {cell} does not exist"
            assert roles[role] not in present, f"{algo}: has its own {roles[role]} and the README says it is shared"


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_every_other_module_is_listed_math_that_imports_no_flare(algo):
    roles, math = set(_roles().values()), _math()[algo]
    modules = _modules(algo)
    assert set(modules) - roles == set(math), (f"{algo}: modules with no role {sorted(set(modules) - roles)}, README's "
                                               f"math table {sorted(math)}")
    allowed = _exceptions("math imports FLARE")
    for name in math:
        flare = {m for m in _imports(modules[name]) if m.split(".")[0] == "nvflare"}
        exempt = {m for m in _code(allowed.get(f"{algo}/{name}", ""))}
        assert flare <= exempt, f"{algo}/{name} is math and imports FLARE: {sorted(flare - exempt)}"


def _kinds() -> dict[str, str]:
    """Result kind name -> the module its entry point names (pyproject.toml, not the installed metadata)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {name: target.split(":")[0] for name, target in project["entry-points"]["medflare.result_kinds"].items()}


def _string_constants(path: Path) -> list[tuple[str, int]]:
    """(value, line) of every string constant of ``path`` that is not a docstring."""
    tree = _tree(path)
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.value, n.lineno) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_each_algorithm_kind_is_written_once_in_its_results_module():
    kinds = {k: m for k, m in _kinds().items() if m.split(".")[1] in ALGORITHMS}
    assert kinds, "pyproject.toml registers no algorithm result kind"
    found: dict[str, list[str]] = {k: [] for k in kinds}
    for path in PACKAGE.rglob("*.py"):
        for value, line in _string_constants(path):
            if value in found:
                found[value].append(f"{path.relative_to(PACKAGE)}:{line}")
    for kind, module in kinds.items():
        algo = module.split(".")[1]
        assert module == f"medflare.{algo}.results", f"kind '{kind}' is registered from {module}, not its results.py"
        assert len(found[kind]) == 1 and found[kind][0].startswith(f"{algo}/results.py:"), (
            f"kind '{kind}' must be written once, in {algo}/results.py; found at {found[kind]}")


def _writes(path: Path) -> list[str]:
    """Calls in ``path`` that write a file (:data:`WRITERS`, ``open`` with a writing mode)."""
    out = []
    for node in ast.walk(_tree(path)):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        mode = next((a.value for a in node.args[1:2] if isinstance(a, ast.Constant)), None)
        mode = next((k.value.value for k in node.keywords if k.arg == "mode" and isinstance(k.value, ast.Constant)), mode)
        if name in WRITERS or (name == "open" and isinstance(mode, str) and set(mode) & set("wax")):
            out.append(f"{name}() at line {node.lineno}")
    return out


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_only_persistors_write_files(algo):
    allowed = _exceptions("only `persistor.py` writes files")
    for name, path in _modules(algo).items():
        if name == "persistor.py" or f"{algo}/{name}" in allowed:
            continue
        assert not _writes(path), f"{algo}/{name} writes files ({_writes(path)}); only its persistor.py may"


def test_the_exceptions_name_modules_that_exist():
    for row in _table("Exceptions"):
        assert (PACKAGE / _code(row[0])[0]).is_file(), f"README exception for a missing module: {row[0]}"
