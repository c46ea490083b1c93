"""FedAvg, FedProx and SCAFFOLD jobs run in the FLARE simulator, learn, and leave what they promise.

FLARE can exit 0 after a client crashed, so every check is on artifacts: model files, TensorBoard
scalars and images written by the server, and the saved model scored again with `medflare evaluate`.
"""

import json

import pytest

from medflare.cli import main as medflare_main
from medflare.testing.jobconfig import customize_job
from medflare.testing.simrun import count_images, run_simulator

pytestmark = pytest.mark.slow

ROUNDS = 4
SITES = 2
# Two sites of compatible styles: FedAvg on the inverted-contrast site-2 is exactly the non-IID failure
# FedSM addresses (see benchmarks/), so it is no place to check that the baseline wiring learns.
CLIENTS = ["site-1", "site-3"]


def _run(repo, tmp_path, job, preset, rounds=ROUNDS):
    folder = customize_job(
        repo / "jobs" / job, tmp_path / job, preset=preset,
        workflow_args={"num_rounds": rounds, "num_clients": SITES},
        executor_args={"overlay_every": 2},
    )
    run = run_simulator(folder, tmp_path / "ws", SITES, clients=CLIENTS, timeout=600)
    assert run.returncode == 0, run.log[-4000:]
    assert "EXECUTION_EXCEPTION" not in run.log, run.log[-4000:]
    return run


def _evaluate(model_file, site, out):
    assert medflare_main(["evaluate", "--model", str(model_file), "--site", site, "--out", str(out)]) == 0
    return json.loads(out.read_text())["evaluations"][0]["sites"][site]["mean"]


@pytest.mark.parametrize("job", ["fedavg", "fedprox", "scaffold"])
def test_segmentation_job_learns_and_persists(repo, tmp_path, job):
    run = _run(repo, tmp_path, job, "seg_synthetic_tiny")
    last = run.app_server / "FL_global_model.pt"
    assert last.is_file() and (run.app_server / "best_FL_global_model.pt").is_file()

    scalars = run.scalars()
    assert sorted(scalars) == CLIENTS
    for site, series in scalars.items():
        dice = dict(series["val_global/dice"])
        assert sorted(dice) == list(range(ROUNDS)), f"{site}: validation rounds {sorted(dice)}"
        assert dice[ROUNDS - 1] > dice[0] + 0.15, f"{site}: Dice {dice}"
        assert len(series["train_loss"]) == ROUNDS
    assert count_images(run.server_dir / "tb_events") >= SITES  # segmentation overlays reached TensorBoard

    # The final model, scored on a site's test split by the user-facing command.
    test = _evaluate(last, "site-1", tmp_path / "eval.json")
    assert test["dice"] > 0.5, test


def test_classification_preset_runs_through_the_same_job(repo, tmp_path):
    run = _run(repo, tmp_path, "fedavg", "cls_synthetic_tiny", rounds=3)
    for site, series in run.scalars().items():
        acc = dict(series["val_global/accuracy"])
        assert acc[2] > acc[0] + 0.1 and acc[2] > 0.4, f"{site}: accuracy {acc}"
    test = _evaluate(run.app_server / "FL_global_model.pt", "site-1", tmp_path / "eval.json")
    assert test["accuracy"] > 0.4, test


def test_a_site_without_data_stops_the_job_with_a_clear_error(repo, tmp_path):
    folder = customize_job(repo / "jobs" / "fedavg", tmp_path / "job", preset="seg_datalist",
                           workflow_args={"num_rounds": 2, "num_clients": SITES})
    run = run_simulator(folder, tmp_path / "ws", SITES, clients=CLIENTS, timeout=300)
    assert "site 'site-1': data kind 'datalist' needs the site's own data; set $MEDFLARE_DATA" in run.log
    assert run.seconds < 240  # ends, does not wait for the missing site forever
    assert not (run.app_server / "best_FL_global_model.pt").exists()
