"""The best file holds the model of the best round (issue 32): runs whose best round is known.

The sites' validation scores follow a script (medflare.testing.scripted.ScriptedScores), and each site keeps the
weights it received in each round (KeepReceived): the best file must hold, tensor for tensor, the model the sites
received in the round the script made best. FedAvg's script makes the final model the best: before issue 32 it was
never scored, and the best file held the round before's model. SCAFFOLD's makes an early round the best: the
selector pairs a round's scores with the model the sites scored, not with the one aggregated from their updates.
"""

import json
from functools import partial

import pytest
import torch

from medflare.jobs.customize import customize_job
from medflare.jobs.simulate import run_simulator

from . import simulation

pytestmark = pytest.mark.slow

ROUNDS = 3
CLIENTS = ["site-1", "site-3"]


def _run(repo, tmp_path, job, scores):
    """``job`` with the sites' validation scores following ``scores`` ({round: Dice}); (the SimRun, the folder of the
    models the sites received)."""
    kept = tmp_path / "received"
    folder = customize_job(
        repo / "jobs" / job, tmp_path / job, preset="seg_synthetic_tiny",
        workflow_args={"num_rounds": ROUNDS, "num_clients": len(CLIENTS)},
        task_data_filters=[{"tasks": ["train", "validate"],
                            "filters": [{"path": "medflare.testing.scripted.KeepReceived", "args": {"folder": str(kept)}}]}],
    )
    client = folder / "app" / "config" / "config_fed_client.json"
    config = json.loads(client.read_text())
    for entry in config["task_result_filters"]:  # the script first, then the job's own manifest check
        entry["filters"].insert(0, {"path": "medflare.testing.scripted.ScriptedScores", "args": {"scores": scores}})
    client.write_text(json.dumps(config, indent=2))
    run = run_simulator(folder, tmp_path / f"ws_{job}", len(CLIENTS), clients=CLIENTS, timeout=600)
    assert run.returncode == 0, run.log[-4000:]
    assert "EXECUTION_EXCEPTION" not in run.log, run.log[-4000:]
    return run, kept


def _weights(path):
    saved = torch.load(path, map_location="cpu", weights_only=False)
    return {k: torch.as_tensor(v) for k, v in saved["model"].items()}


def _same(saved, received):
    assert sorted(saved) == sorted(received)
    return all(torch.equal(saved[k].float(), received[k].float()) for k in saved)


def _received(kept, task, rnd):
    models = [torch.load(kept / f"{site}_{task}_{rnd}.pt") for site in CLIENTS]
    assert all(_same(models[0], m) for m in models[1:])  # every site received the same model
    return models[0]


#: both runs, started in the background (tests/e2e/__init__.py): FedAvg's script makes the final model the best,
#: SCAFFOLD's round 1
RUNS = {"fedavg_run": partial(_run, job="fedavg", scores={"1": 0.2, "2": 0.5, str(ROUNDS): 0.9}),
        "scaffold_run": partial(_run, job="scaffold", scores={"1": 0.9, "2": 0.3, str(ROUNDS): 0.5})}
fedavg_run, scaffold_run = simulation("fedavg_run"), simulation("scaffold_run")


def test_fedavg_best_file_is_the_final_model_when_the_final_model_scores_best(fedavg_run):
    run, kept = fedavg_run
    best, last = _weights(run.app_server / "best_FL_global_model.pt"), _weights(run.app_server / "FL_global_model.pt")
    assert _same(best, last), "best_FL_global_model.pt is not the final model, which scored best"
    assert not _same(best, _received(kept, "train", ROUNDS - 1))
    assert _same(last, _received(kept, "validate", ROUNDS))  # the final model, scored in the round that trains nothing
    for site, series in run.site_scalars().items():  # the final model's real scores reach the sites' TensorBoard too
        assert sorted(dict(series["val_global/dice"])) == list(range(ROUNDS + 1)), site


def test_scaffold_best_file_is_the_model_the_sites_scored_in_the_best_round(scaffold_run):
    run, kept = scaffold_run
    best = _weights(run.app_server / "best_FL_global_model.pt")
    assert _same(best, _received(kept, "train", 1)), "best_FL_global_model.pt is not the model scored in round 1"
    assert not _same(best, _received(kept, "train", 2))  # the aggregate of round 1's updates: not what was scored
