"""The FedSM job in the FLARE simulator: the selector identifies sites, the super model is at least as good as
the global model, the persisted super model reloads and `medflare evaluate` scores it; PercentilePrivacy on.

FLARE can exit 0 after a client crashed, so every check is on artifacts (super model files, TensorBoard).
"""

import json

import pytest

from medflare.cli import main as medflare_main
from medflare.testing.jobconfig import customize_job
from medflare.testing.simrun import run_simulator
from medflare.fedsm.supermodel import BEST_SUPER_MODEL_FILE, SUPER_MODEL_FILE, load_super_model

pytestmark = pytest.mark.slow

CLIENTS = ["site-1", "site-2", "site-3"]
ROUNDS = 3


def _run(repo, tmp_path, name, rounds=ROUNDS, executor_args=None, **kwargs):
    folder = customize_job(
        repo / "jobs" / "fedsm", tmp_path / name, preset="seg_synthetic_tiny",
        workflow_args={"num_rounds": rounds}, executor_args={"overlay_every": 10, **(executor_args or {})}, **kwargs,
    )
    run = run_simulator(folder, tmp_path / f"ws_{name}", len(CLIENTS), clients=CLIENTS, timeout=600)
    assert run.returncode == 0, run.log[-4000:]
    assert "EXECUTION_EXCEPTION" not in run.log, run.log[-4000:]
    assert (run.app_server / SUPER_MODEL_FILE).is_file(), run.log[-4000:]
    return run


def _evaluate(model_file, sites, gamma, out):
    args = ["evaluate", "--model", str(model_file), "--sites", ",".join(sites), "--gamma", str(gamma), "--out", str(out)]
    assert medflare_main(args) == 0
    return json.loads(out.read_text())["evaluations"][0]


RECORDER = {"id": "recorder", "path": "medflare.testing.widgets.EventRecorder", "args": {}}


def test_fedsm_selector_learns_and_super_model_beats_global(repo, tmp_path):
    run = _run(repo, tmp_path, "fedsm", server_components=[RECORDER])
    # FLARE's round events, with the round in the FL context, as FLARE's FedAvg fires them
    events = [json.loads(line) for line in (run.server_dir / "events.jsonl").read_text().splitlines()]
    for name in ("_round_started", "_before_aggregation", "_after_aggregation"):
        rounds = [e["round"] for e in events if e["event"].endswith(name)]
        assert rounds == list(range(ROUNDS)), (name, rounds)
    assert all(e["has_result"] for e in events if e["event"].endswith("_after_aggregation"))
    scalars = run.scalars()
    assert sorted(scalars) == CLIENTS
    for site, series in scalars.items():
        acc = dict(series["val/selector_acc"])
        # round 0 uses the uncalibrated head; from round 1 on the server's calibrated one
        assert acc[ROUNDS - 1] > 0.6, f"{site}: selector accuracy {acc}"
        assert {"val/global_dice", "val/person_dice", "val/super_dice"} <= set(series)
    # test splits of the tiny preset hold a handful of cases: judge the mean over sites
    test_acc = [dict(scalars[s]["final/test_selector_acc"])[ROUNDS] for s in CLIENTS]
    assert sum(test_acc) / len(test_acc) > 0.6, test_acc
    assert (run.app_server / BEST_SUPER_MODEL_FILE).is_file()

    sm = load_super_model(run.app_server / SUPER_MODEL_FILE)  # reloads with torch.load(weights_only=True)
    assert sm.sites == CLIENTS and len(sm.person_models) == len(CLIENTS) and sm.info["round"] == ROUNDS
    # gamma 1 routes every case to the global model: the global model's test Dice, scored the same way
    glob = _evaluate(run.app_server / SUPER_MODEL_FILE, CLIENTS, 1.0, tmp_path / "g.json")
    sup = _evaluate(run.app_server / SUPER_MODEL_FILE, CLIENTS, 0.9, tmp_path / "s.json")
    assert all(glob["sites"][s]["report"]["GM"] == 1.0 for s in CLIENTS)
    own = [sup["sites"][s]["report"][s] for s in CLIENTS]
    assert sum(own) / len(own) > 0.6, f"selection of the site's own model: {own}"
    assert sup["client_average"]["dice"] >= glob["client_average"]["dice"] - 0.01, (sup["client_average"], glob["client_average"])


def test_fedsm_with_percentile_privacy_and_noised_statistics(repo, tmp_path):
    flt = {"path": "nvflare.app_common.filters.percentile_privacy.PercentilePrivacy", "args": {"percentile": 10, "gamma": 0.01}}
    # and the sites' own noise on the feature statistics (stats_noise), the selector's protection
    run = _run(repo, tmp_path, "fedsm_privacy", rounds=2, executor_args={"stats_noise": 0.01},
               task_result_filters=[{"tasks": ["train"], "filters": [flt]}])
    # the controller logs each result's filter history; the filter logs the cut-off it applied to the diffs
    assert run.log.count("result filters ['PercentilePrivacy']") >= 2 * len(CLIENTS), run.log[-4000:]
    assert "Max abs delta_w" in run.log
    sm = load_super_model(run.app_server / SUPER_MODEL_FILE)
    assert sm.info["round"] == 2 and sm.sites == CLIENTS
    # the feature statistics travel in the meta, which the filter leaves alone: the selector is still calibrated
    acc = [dict(series["final/selector_acc"])[2] for series in run.scalars().values()]
    assert sum(acc) / len(acc) > 0.6, acc
