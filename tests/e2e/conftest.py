"""Simulator runs of a session with end-to-end tests: forked from one warm process, with a short end-of-run wait, two at
a time in the background (:class:`tests.e2e.Simulations`)."""

import os

import pytest

from . import REPO, Simulations

#: simulator runs at once (1: one after the other, each when its first test needs it)
PARALLEL_ENV = "MEDFLARE_TEST_PARALLEL_RUNS"


@pytest.fixture(scope="session", autouse=True)
def fast_simulator_runs(medflare_cache):
    """Each run, and each of its sites' processes, a fork of one process that imported FLARE, torch, MONAI and the
    jobs' components once (:func:`medflare.jobs.simulate.start_fork_server`), and FLARE's end-of-run wait for late
    events cut from 2 s to 0.5 s (its ``end_run_readiness_timeout``; the sites send their events before their last
    results). tests/e2e/test_hostile_sites.py on the idle 2-core machine: 141 s without, 51 s with."""
    from medflare.common.compute import CORES_ENV, available_cores
    from medflare.jobs import simulate

    simulate.start_fork_server(REPO / "jobs")
    simulate.RUN_ENV["NVFLARE_END_RUN_READINESS_TIMEOUT"] = "0.5"
    # FLARE's 3 s "let pending activities finish" at each process's end and a site's closing 2 s sleep: 0.5 s and none
    # (a tiny 1-round run, idle machine, capped at 0.2 s: 13.4 s -> 10.7 s; every test checks the artifacts a run left)
    simulate.RUN_ENV[simulate.SHUTDOWN_GRACE_ENV] = "0.5"
    # the runs that go on at once share the machine's cores: without this each run's server takes every core, and two
    # FedIOD servers on 2 cores ran their distillation 3x slower (tests/e2e/test_fediod.py alone: 335 s, with it 265 s)
    simulate.RUN_ENV[CORES_ENV] = str(max(1, available_cores() // _parallel_runs()))
    yield
    for key in ("NVFLARE_END_RUN_READINESS_TIMEOUT", CORES_ENV, simulate.SHUTDOWN_GRACE_ENV):
        simulate.RUN_ENV.pop(key, None)


def _parallel_runs() -> int:
    return int(os.environ.get(PARALLEL_ENV, "2"))


@pytest.fixture(scope="session")
def simulations(request, tmp_path_factory):
    """The session's :class:`~tests.e2e.Simulations` (``$MEDFLARE_TEST_PARALLEL_RUNS`` at once, default 2)."""
    sims = Simulations(request.session, tmp_path_factory, _parallel_runs())
    yield sims
    sims.close()
