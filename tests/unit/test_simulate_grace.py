"""A forked simulator run's processes wait at most $MEDFLARE_SIMULATOR_SHUTDOWN_GRACE s before FLARE's clean-up
(medflare.jobs.simulate): the cap applies to every ``mpm.run`` of the process, never raises a shorter wait, and without
the variable FLARE's own wait stands."""

import pytest
from nvflare.fuel.f3.mpm import MainProcessMonitor

from medflare import MedflareError
from medflare.jobs import simulate


def _recording(monkeypatch):
    seen = []

    def run(cls, main_func, run_dir=None, shutdown_grace_time=3, cleanup_grace_time=3, **kwargs):
        seen.append((shutdown_grace_time, cleanup_grace_time))
        return main_func(**kwargs)

    monkeypatch.setattr(MainProcessMonitor, "run", classmethod(run))  # restored after the test
    return seen


def test_the_grace_is_capped_only_when_the_variable_is_set(monkeypatch):
    seen = _recording(monkeypatch)
    monkeypatch.delenv(simulate.SHUTDOWN_GRACE_ENV, raising=False)
    simulate._cap_shutdown_grace()
    assert MainProcessMonitor.run(main_func=lambda: 7) == 7 and seen == [(3, 3)]  # FLARE's default untouched

    monkeypatch.setenv(simulate.SHUTDOWN_GRACE_ENV, "0.5")
    simulate._cap_shutdown_grace()
    assert MainProcessMonitor.run(main_func=lambda x: x, x=1) == 1
    MainProcessMonitor.run(main_func=lambda: None, shutdown_grace_time=3, cleanup_grace_time=6)  # the simulator's call
    MainProcessMonitor.run(main_func=lambda: None, shutdown_grace_time=0.1)
    assert seen[1:] == [(0.5, 3), (0.5, 6), (0.1, 3)]


@pytest.mark.parametrize("value", ["soon", "-1", "nan"])
def test_a_bad_grace_names_the_variable(monkeypatch, value):
    _recording(monkeypatch)
    monkeypatch.setenv(simulate.SHUTDOWN_GRACE_ENV, value)
    with pytest.raises(MedflareError, match=simulate.SHUTDOWN_GRACE_ENV):
        simulate._cap_shutdown_grace()
