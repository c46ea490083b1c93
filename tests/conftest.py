"""Test-wide settings: synthetic data is cached in one temporary folder per test session, never in ~; the end-to-end
tests' simulator runs start in the background at the session's first test, and the tests run POC first, then unit,
then end-to-end, so that the runs go on while the POC federations mostly wait (heart-beat timeouts, job start-ups)
and are done, or nearly, when the end-to-end tests read them."""

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: the folders in the order their tests run (any other folder after them, the tests marked ``last`` at the very end)
ORDER = ("poc", "unit", "e2e")
#: simulator runs at once (1: one after the other)
PARALLEL_ENV = "MEDFLARE_TEST_PARALLEL_RUNS"


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


def _folder(item) -> str:
    path = Path(str(item.path)).resolve()
    return path.relative_to(REPO / "tests").parts[0] if path.is_relative_to(REPO / "tests") else ""


def pytest_collection_modifyitems(config, items):
    """POC tests first, then unit, then end-to-end (:data:`ORDER`; each folder's tests in their own order), and the
    tests marked ``last`` after every other test of the session (the session-wide egress audit reads the simulator
    runs the other tests made)."""
    rank = {folder: i for i, folder in enumerate(ORDER)}
    items.sort(key=lambda item: (item.get_closest_marker("last") is not None, rank.get(_folder(item), len(ORDER))))


def _parallel_runs() -> int:
    return int(os.environ.get(PARALLEL_ENV, "2"))


@pytest.fixture(scope="session")
def simulations(request, medflare_cache, tmp_path_factory):
    """The session's simulator runs (:class:`e2e.Simulations`, ``$MEDFLARE_TEST_PARALLEL_RUNS`` at once, default 2).

    Each run, and each of its sites' processes, is a fork of one process that imported FLARE, torch, MONAI and the
    jobs' components once (:func:`medflare.jobs.simulate.start_fork_server`), and FLARE's end-of-run wait for late
    events is cut from 2 s to 0.5 s (its ``end_run_readiness_timeout``; the sites send their events before their last
    results). tests/e2e/test_hostile_sites.py on the idle 2-core machine: 141 s without, 51 s with."""
    from e2e import Simulations

    from medflare.common.compute import CORES_ENV, available_cores, process_share
    from medflare.jobs import simulate

    simulate.start_fork_server(REPO / "jobs")
    simulate.RUN_ENV["NVFLARE_END_RUN_READINESS_TIMEOUT"] = "0.5"
    # FLARE's 3 s "let pending activities finish" at each process's end and a site's closing 2 s sleep: 0.5 s and none
    # (a tiny 1-round run, idle machine, capped at 0.2 s: 13.4 s -> 10.7 s; every test checks the artifacts a run left)
    simulate.RUN_ENV[simulate.SHUTDOWN_GRACE_ENV] = "0.5"
    # the runs that go on at once share the machine's cores: without this each run's server takes every core, and two
    # FedIOD servers on 2 cores ran their distillation 3x slower (tests/e2e/test_fediod.py alone: 335 s, with it 265 s)
    simulate.RUN_ENV[CORES_ENV] = str(process_share(available_cores(), _parallel_runs()).threads)
    sims = Simulations(request.session, tmp_path_factory, _parallel_runs())
    yield sims
    sims.close()
    for key in ("NVFLARE_END_RUN_READINESS_TIMEOUT", CORES_ENV, simulate.SHUTDOWN_GRACE_ENV):
        simulate.RUN_ENV.pop(key, None)


@pytest.fixture(scope="session", autouse=True)
def simulations_ahead(request):
    """When end-to-end tests are selected: their simulator runs start now, at the session's first test (the POC and
    unit tests run meanwhile), and every end-to-end test has the fork server."""
    if any(_folder(item) == "e2e" for item in request.session.items):
        request.getfixturevalue("simulations").start()
        request.getfixturevalue("compute_beside_the_runs")


@pytest.fixture(scope="session")
def compute_beside_the_runs():
    """This process computes too (the unit tests, the end-to-end tests' scoring, the ``medflare`` commands it starts)
    while the background runs use the cores: it takes one share of them, as one more process beside
    ``$MEDFLARE_TEST_PARALLEL_RUNS`` runs (the rule of :mod:`medflare.common.compute`), instead of torch's default of
    a thread per core. On the 2-core machine with another job computing beside it, three of the unit tests took
    385 s and 123 s of CPU with 2 threads, 105 s and 28 s with 1: the two threads spin waiting for each other."""
    import torch

    from medflare.common.compute import CORES_ENV, available_cores, process_share

    threads = process_share(available_cores(), _parallel_runs() + 1).threads
    before = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CORES_ENV, str(threads))  # what apply_threads in this process, and the commands it starts, count
        torch.set_num_threads(threads)
        yield threads
        torch.set_num_threads(before)


def pytest_terminal_summary(terminalreporter):
    """The machine the suite ran on, in the summary: a suite time means little without the cores and the load beside
    it (issue 29 reports its time with both)."""
    from medflare.common.compute import available_cores

    one, five, fifteen = os.getloadavg()
    terminalreporter.write_line(f"machine: {available_cores()} cores available; load average at the end "
                                f"{one:.1f} / {five:.1f} / {fifteen:.1f} (1 / 5 / 15 min)")
