"""``medflare run fedavg -n 2`` end to end (issue 30): FLARE's SimEnv runs the recipe with the user's settings, the console
shows one line per round and where the result is, and no FLARE transport line reaches the console or the logs."""

import json
import os
import subprocess
import sys

import pytest

from medflare.common.compute import CORES_ENV
from medflare.common.summary import CURVE_TAG, ROUND_LINE
from medflare.jobs.simulate import BASE_ENV, RUN_ENV, SIMULATOR_SERVER, read_scalars

from . import simulation

pytestmark = pytest.mark.slow

ROUNDS = 2
NOISE = ("set transaction info", "has been downloaded", "Finished one task run", "deprecated", "num_clients (")


def _medflare_run(repo, folder):
    """The command as a user types it, in its own process (the session's environment and its share of the cores, not
    the fork server): (the finished process, its workspace folder)."""
    cmd = [sys.executable, "-m", "medflare.cli", "run", "fedavg", "-n", "2", "--preset", "seg_synthetic_tiny",
           "--rounds", str(ROUNDS), "--set", "train.epochs=1", "-w", str(folder)]
    env = {**(BASE_ENV.get() or os.environ), "PYTHONWARNINGS": "ignore"}
    if CORES_ENV in RUN_ENV:  # it runs beside another of the session's runs
        env[CORES_ENV] = RUN_ENV[CORES_ENV]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env), folder


RUNS = {"run_command": _medflare_run}  # started in the background (tests/e2e/__init__.py)
run_command = simulation("run_command")


def test_medflare_run_prints_a_line_per_round_and_the_result(run_command):
    proc, workspace = run_command
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    lines = proc.stdout.splitlines()
    rounds = [ROUND_LINE.search(line) for line in lines if ROUND_LINE.search(line)]
    assert [(m["round"], m["total"], m["key"], m["sites"]) for m in rounds] == [(str(r), str(ROUNDS), "dice", "2")
                                                                                for r in range(1, ROUNDS + 1)], out
    assert all(m["value"].endswith(" %") for m in rounds), out
    ws = workspace / "fedavg"
    result = ws / "server" / "simulate_job" / "app_server" / "FL_global_model.pt"
    assert f"result: {result}" in lines and f"score it: medflare evaluate --model {result} -n 2" in lines, out
    assert result.is_file()
    assert len(lines) <= ROUNDS + 5, out  # the start line, the rounds, result, command, logs: nothing of FLARE's chatter
    logs = [ws / "server" / "log.txt", ws / "site-1" / "log.txt", ws / "site-2" / "log.txt"]
    for text in (out, *(p.read_text() for p in logs)):
        assert not [n for n in NOISE if n in text], [n for n in NOISE if n in text]
    # the settings reached the job: --set in the sites' config, --rounds and -n in the workflow's
    client = json.loads((ws / "site-1" / "simulate_job" / "app_site-1" / "config" / "config_fed_client.json").read_text())
    assert client["executors"][0]["executor"]["args"]["overrides"] == {"train": {"epochs": 1}}
    # the federation-level curve in the server's TensorBoard: one point per round
    curve = read_scalars(ws / "server" / "simulate_job" / "tb_events")[SIMULATOR_SERVER][CURVE_TAG.format(key="dice")]
    assert [step for step, _ in curve] == list(range(ROUNDS))
    assert f"{100 * curve[-1][1]:.2f} %" == rounds[-1]["value"]
