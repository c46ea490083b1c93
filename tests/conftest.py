"""Test-wide settings: synthetic data is cached in one temporary folder per test session, never in ~."""

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def medflare_cache(tmp_path_factory):
    """Point MEDFLARE_CACHE at a session folder (inherited by simulator subprocesses) and clear MEDFLARE_DATA."""
    cache = tmp_path_factory.mktemp("medflare_cache")
    old = {k: os.environ.get(k) for k in ("MEDFLARE_CACHE", "MEDFLARE_DATA")}
    os.environ["MEDFLARE_CACHE"] = str(cache)
    os.environ.pop("MEDFLARE_DATA", None)
    yield cache
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def python_bin() -> str:
    return sys.executable


def pytest_collection_modifyitems(config, items):
    """Groups for pytest-xdist's ``--dist loadgroup`` (README's test command runs two workers: the end-to-end tests
    spend about half their time waiting on FLARE processes, so two share the CI machine's two cores): an
    end-to-end module stays on one worker so its module-scoped FLARE runs happen once, and every POC test
    shares one worker so no two real federations (and their heart-beat timeouts) overlap. Unit tests spread freely."""
    for item in items:
        parts = Path(str(item.fspath)).relative_to(REPO / "tests").parts
        if parts[0] == "poc":
            item.add_marker(pytest.mark.xdist_group("poc"))
        elif parts[0] != "unit":
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
