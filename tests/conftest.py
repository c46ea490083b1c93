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


#: folders whose tests run in one pytest-xdist worker, in collection order (``--dist loadgroup``): the simulator tests
#: share their background runs, the fork server and the session-wide egress audit; the POC modules each start a real
#: federation, and their heart-beat and grace waits leave the CPU to the simulator worker
GROUPS = ("e2e", "poc")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``last`` run after every other test of the session (the session-wide egress audit reads the
    simulator runs the other tests made); each folder of :data:`GROUPS` is one xdist group."""
    items.sort(key=lambda item: item.get_closest_marker("last") is not None)
    for item in items:
        folder = Path(str(item.path)).relative_to(REPO / "tests").parts[0]
        if folder in GROUPS:
            item.add_marker(pytest.mark.xdist_group(folder))
