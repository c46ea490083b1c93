"""End-to-end tests in the FLARE simulator. Their runs start in the background at the session's first test, two at a
time, while the POC and unit tests run (:class:`Simulations`; the fixtures and the test order are in tests/conftest.py)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


class Simulations:
    """The session's simulator runs, started in the background ahead of the tests that read them, ``workers`` at a time.

    A test module lists its runs in ``RUNS``: ``{fixture name: function(repo, folder) -> what its tests read}``
    (customise the job and call :func:`medflare.jobs.simulate.run_simulator`, or run a command in its own process, and
    return the SimRun or the finished process with what else the tests need; ``folder`` is the run's own empty folder)
    and declares a fixture of each name with :func:`simulation`. :meth:`start` (called at the session's first test, or
    by the first run a test requests) queues every run that the selected tests use, in the order the tests read them,
    except that the runs a module names in ``START_FIRST`` (its long ones) go ahead of all others: ``workers`` of them
    run at a time until none is left, so a long run goes on while the short ones behind it pass through the other
    worker, and no worker waits for a test to ask. A 2-core machine idles through much of a run (FLARE starting the site
    processes, its end-of-run waits, a small site waiting for a large one), so two runs at once take less time than one
    after the other, and nothing a test reads depends on timing (every workflow waits for its sites, each site's threads
    follow the simulator's ``-t`` and the cores the runs share, data is generated from seeds with its own generators). A
    run's function runs beside the tests, so it must leave process-wide state alone (os.environ, global RNGs), and the
    environment its runs start from is the session's as it was when this object was made, whatever a test has
    monkeypatched meanwhile (:data:`medflare.jobs.simulate.BASE_ENV`); ``run_simulator(env=)`` gives a run its own
    variables.
    """

    def __init__(self, session: pytest.Session, tmp_path_factory: pytest.TempPathFactory, workers: int):
        self._session, self._tmp = session, tmp_path_factory
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="simulation")
        self._futures: dict[tuple[str, str], Future] = {}
        self._lock = threading.Lock()
        self._started = False
        self._env = dict(os.environ)

    def _modules(self) -> list:
        """The modules of the selected tests that list RUNS, in the order their tests run."""
        modules = []
        for item in self._session.items:
            module = getattr(item, "module", None)
            if module is not None and hasattr(module, "RUNS") and module not in modules:
                modules.append(module)
        return modules

    def _queue(self) -> list[tuple[object, str]]:
        """(module, run name) of every run the selected tests use: the modules' START_FIRST runs, then the others, each
        in the order the tests run."""
        runs = []
        for module in self._modules():
            used = {name for item in self._session.items if getattr(item, "module", None) is module for name in item.fixturenames}
            runs += [(module, name) for name in module.RUNS if name in used]
        return sorted(runs, key=lambda mr: mr[1] not in getattr(mr[0], "START_FIRST", ()))  # stable: the order otherwise

    def _start(self, module, name: str) -> None:
        key = (module.__name__, name)
        if key not in self._futures:
            folder = self._tmp.mktemp(f"{module.__name__.rsplit('.', 1)[-1]}_{name}")
            self._futures[key] = self._pool.submit(self._call, module.RUNS[name], folder)

    def _call(self, run, folder: Path):
        from medflare.jobs.simulate import BASE_ENV

        BASE_ENV.set(self._env)  # this worker thread's context: runs start from the session's environment
        return run(REPO, folder)

    def start(self) -> None:
        """Queue every run the selected tests use (:meth:`_queue`'s order), once; later calls do nothing."""
        with self._lock:
            self._start_all()

    def _start_all(self) -> None:
        if not self._started:
            self._started = True
            for queued in self._queue():
                self._start(*queued)

    def result(self, request: pytest.FixtureRequest):
        """What the run the fixture ``request`` stands for returned (a SimRun); raises what it raised."""
        module, key = request.module, (request.module.__name__, request.fixturename)
        with self._lock:
            self._start_all()
            self._start(module, request.fixturename)  # a run no selected test lists (a fixture used indirectly)
        return self._futures[key].result()

    def close(self) -> None:
        """Cancel the runs not started yet, wait for the others."""
        self._pool.shutdown(wait=True, cancel_futures=True)


#: a network small enough for the 16 x 16 image-file sites of :func:`image_file_sites`
TINY_UNET = {"in_channels": 1, "out_channels": 3, "channels": [4, 8], "strides": [2]}
#: the data block that reads those sites' datalists (3 classes, one channel, 16 x 16)
IMAGE_FILES = {"channels": 1, "num_classes": 3, "labels": "as_is", "image_size": [16, 16]}


def image_file_sites(folder: Path, sites: list[str]) -> Path:
    """Tiny segmentation sites as image files and datalists under ``folder / "data"`` (what ``MEDFLARE_DATA`` names)."""
    from medflare.data import make_seg_site

    for site in sites:
        make_seg_site(site, folder / "data", image_size=16, num_classes=3, scale=0.2)
    return folder / "data"


def fedavg_on_image_files(repo: Path, folder: Path, sites: list[str], overrides: dict, rounds: int, **job_args):
    """jobs/fedavg at the ``seg_images_2d`` preset with ``overrides`` on the sites of :func:`image_file_sites` (made
    first), ``job_args`` passed to :func:`medflare.jobs.customize.customize_job`; the SimRun."""
    from medflare.data.util import DATA_ENV
    from medflare.jobs.customize import customize_job
    from medflare.jobs.simulate import run_simulator

    job = customize_job(repo / "jobs" / "fedavg", folder / "job", preset="seg_images_2d", overrides=overrides,
                        workflow_args={"num_rounds": rounds, "num_clients": len(sites)}, **job_args)
    return run_simulator(job, folder / "ws", len(sites), clients=sites, timeout=300, env={DATA_ENV: str(folder / "data")})


def _result(simulations: Simulations, request: pytest.FixtureRequest):
    return simulations.result(request)


def simulation(name: str):
    """A module-scoped fixture ``name``: the run ``RUNS[name]`` of the module, from the session's :class:`Simulations`."""
    return pytest.fixture(scope="module", name=name)(_result)
