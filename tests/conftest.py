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
    """Tests marked ``last`` run after every other test of the session (the session-wide egress audit reads the
    simulator runs the other tests made)."""
    items.sort(key=lambda item: item.get_closest_marker("last") is not None)
