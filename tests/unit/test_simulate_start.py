"""A simulator run whose site process FLARE could not reach is stopped at once and started again, and a forked run's
ports come from below the kernel's ephemeral range (medflare.jobs.simulate).

FLARE's simulator picks a site's port with ``get_open_ports`` (bind port 0, close) and the site's new process binds it
seconds later; an outgoing connection of another process can take it meanwhile. The site then dies with "Address
already in use", the simulator logs "Failed to create connection to the child process" and waits for ever: a CI run
of the suite lost 600 s and five tests to it (2026-11-29)."""

import json
import socket
import sys
import textwrap

import psutil
import pytest

from medflare.jobs import simulate

#: a stand-in for `nvflare simulator`: its first start (no "started" file in the workspace yet) logs FLARE's line and
#: then hangs as the simulator does; a later start checks that it has a fresh workspace with its local files and exits 0
FAKE_SIMULATOR = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    ws = Path(sys.argv[1])
    if (ws / "started").exists():
        print("stale workspace", flush=True)
        sys.exit(3)
    (ws / "started").write_text(str(os.getpid()))
    if len(list(ws.parent.glob("attempt-*"))) == 0:
        (ws.parent / "attempt-1").write_text(str(os.getpid()))
        print("ERROR - run_client_thread error: RuntimeError: " + sys.argv[2] + " in SimulatorClientRunner", flush=True)
        time.sleep(600)
    print((ws / "local" / "site.json").read_text(), flush=True)
""")


def _fake(tmp_path, timeout=120):
    ws = tmp_path / "ws"
    cmd = [sys.executable, "-c", FAKE_SIMULATOR, str(ws), simulate.SITE_NOT_REACHED_LOG]
    return ws, lambda: simulate._run_process(cmd, {"PATH": "/usr/bin:/bin"}, timeout)


def test_a_run_whose_site_was_not_reached_is_stopped_and_started_again_in_a_fresh_workspace(tmp_path):
    ws, launch = _fake(tmp_path)
    outcome, returncode, stdout, _ = simulate._with_restart(launch, ws, {"site.json": {"privacy": 1}})
    # a watcher that missed FLARE's line would have waited the 120 s out (TIMED_OUT); a restart in the stopped run's
    # workspace would have exited 3
    assert (outcome, returncode) == (simulate.EXITED, 0), stdout
    assert json.loads(stdout) == {"privacy": 1}  # the local files are written again
    first = int((tmp_path / "attempt-1").read_text())
    assert not psutil.pid_exists(first) or psutil.Process(first).status() == psutil.STATUS_ZOMBIE  # the hung one is gone


def test_a_second_unreached_start_is_reported_not_retried_for_ever(tmp_path, monkeypatch):
    starts = []

    def launch():
        starts.append(1)
        return simulate.SITE_NOT_REACHED, None, "", "Address already in use"

    assert simulate._with_restart(launch, tmp_path / "ws", None)[0] == simulate.SITE_NOT_REACHED
    assert len(starts) == simulate.SITE_START_ATTEMPTS == 2


def test_a_run_that_ends_or_times_out_is_not_restarted(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('done'); sys.exit(4)"]
    assert simulate._with_restart(lambda: simulate._run_process(cmd, {}, 60), tmp_path / "ws", None)[:3] == (
        simulate.EXITED, 4, "done\n")
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    outcome, returncode, _, _ = simulate._with_restart(lambda: simulate._run_process(sleeper, {}, 1), tmp_path / "ws2",
                                                       None)
    assert (outcome, returncode) == (simulate.TIMED_OUT, None)


def test_free_ports_are_distinct_bindable_and_in_the_range():
    low, high = simulate._below_ephemeral_range()
    if high - low < 1000:
        pytest.skip("this kernel does not report its ephemeral port range")
    ports = simulate.free_ports(5, low, high)
    assert len(set(ports)) == 5 and all(low <= p < high for p in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("localhost", port))  # what a site's process does with it


def test_the_range_below_the_ephemeral_one(tmp_path):
    (tmp_path / "range").write_text("32768\t60999\n")
    assert simulate._below_ephemeral_range(str(tmp_path / "range")) == (16384, 32768)
    assert simulate._below_ephemeral_range(str(tmp_path / "missing")) == (0, 0)


def test_the_forked_simulator_takes_its_ports_from_below_the_ephemeral_range(monkeypatch):
    from nvflare.fuel.utils import network_utils
    from nvflare.private.fed.app.deployer import simulator_deployer
    from nvflare.private.fed.app.simulator import simulator_runner

    low, high = simulate._below_ephemeral_range()
    if high - low < 1000:
        pytest.skip("this kernel does not report its ephemeral port range")
    modules = (network_utils, simulator_runner, simulator_deployer)
    for module in modules:
        monkeypatch.setattr(module, "get_open_ports", module.get_open_ports)  # restored after the test
    simulate.ports_below_the_ephemeral_range()
    for module in modules:
        assert all(low <= p < high for p in module.get_open_ports(3))
