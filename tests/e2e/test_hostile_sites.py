"""A dishonest or broken site cannot take a FedAvg federation down (issue 28), in the FLARE simulator at the tiny preset.

Four jobs, each read by several tests:

- ``liar``: site-3 sends a sign-flipped update from round 1 on and claims 1e9 steps in round 1 and 1e300 in round 2;
  ``flipped``: the same flipped update at its honest weight (the count it declared in round 0). The server's weight
  bound (:mod:`medflare.common.site_weights`) makes the two runs' global models the same: the liar moves the model
  no further than its honest weight allows, and the model stays finite. Before, 1e9 took the model over and 1e300
  made it NaN (tests/unit/test_site_weights.py holds the same control on FLARE's own aggregation helper).
- ``malformed``: from round 1 on site-3 sends a (1,) array for a bias, site-4 an extra key and site-5 leaves a key out;
  the update guard refuses each, naming the site and key, and the job finishes on site-1. Before, the wrong shape and
  the extra key ended the job (FATAL_SYSTEM_ERROR, rc 2) and the missing key was averaged silently.
- ``no_data``: ``MEDFLARE_DATA`` holds files for site-1 and site-3 only; site-4 answers each task with its start error
  and, with ``min_responses`` 3, the job ends in round 0 with one server line naming site-4 and its cause. Before,
  the server waited at "Aggregated 2/3" forever.
"""

import numpy as np
import pytest
import torch

from medflare.common.results import read_checkpoint
from medflare.data import make_seg_site
from medflare.data.util import DATA_ENV
from medflare.jobs.customize import customize_job
from medflare.jobs.simulate import run_simulator

from . import simulation

pytestmark = pytest.mark.slow

SITES = ["site-1", "site-3", "site-4"]
LIAR = "site-3"
ROUNDS = 3
POISON = "medflare.testing.poison.PoisonFilter"


def poison(**args):
    return {"path": POISON, "args": {"from_round": 1, **args}}


def run_fedavg(repo, tmp, name, sites, filters=(), rounds=ROUNDS, workflow_args=None, timeout=300, **kwargs):
    folder = customize_job(repo / "jobs" / "fedavg", tmp / name, preset=kwargs.pop("preset", "seg_synthetic_tiny"),
                           overrides=kwargs.pop("overrides", None),
                           workflow_args={"num_rounds": rounds, "num_clients": len(sites), **(workflow_args or {})},
                           executor_args={"overlay_every": 100},
                           task_result_filters=[{"tasks": ["train"], "filters": list(filters)}] if filters else None)
    return run_simulator(folder, tmp / f"ws_{name}", len(sites), clients=sites, timeout=timeout, **kwargs)


def tensors(checkpoint, prefix=""):
    """``{path: float64 array}`` of every float tensor in a saved checkpoint (nested dicts)."""
    out = {}
    for k, v in checkpoint.items():
        if isinstance(v, dict):
            out.update(tensors(v, f"{prefix}{k}."))
        elif isinstance(v, (torch.Tensor, np.ndarray)) and np.issubdtype(np.asarray(v).dtype, np.floating):
            out[f"{prefix}{k}"] = np.asarray(v, dtype=np.float64)
    return out


def final_dice(run, sites):
    """Mean over ``sites`` of the validation Dice of the global model each site received in the last round."""
    scalars = run.scalars()
    return float(np.mean([dict(scalars[s]["val_global/dice"])[ROUNDS - 1] for s in sites]))


# ---- the runs -------------------------------------------------------------------------------------------
MALFORMED = {"site-3": "wrong_shape", "site-4": "extra_key", "site-5": "missing_key"}
TINY = {"data": {"channels": 1, "num_classes": 3, "labels": "as_is", "image_size": [16, 16]},
        "model": {"args": {"in_channels": 1, "out_channels": 3, "channels": [4, 8], "strides": [2]}}}


def _malformed(repo, tmp):
    sites = ["site-1", *MALFORMED]
    filters = [poison(site=site, tamper=how) for site, how in MALFORMED.items()]
    return run_fedavg(repo, tmp, "malformed", sites, filters, rounds=2)


def _no_data(repo, tmp):
    for site in SITES[:2]:  # MEDFLARE_DATA written for two sites, the job run with three
        make_seg_site(site, tmp / "data", image_size=16, num_classes=3, scale=0.2)
    return run_fedavg(repo, tmp, "no_data", SITES, rounds=2, workflow_args={"min_responses": 3}, preset="seg_images_2d",
                      overrides=TINY, env={DATA_ENV: str(tmp / "data")}, timeout=240)


#: every run of the module, started in the background (tests/e2e/__init__.py)
RUNS = {
    "liar_run": lambda repo, tmp: run_fedavg(repo, tmp, "liar", SITES, [poison(site=LIAR, scale=-1.0, steps=1e9),
                                                                       poison(site=LIAR, from_round=2, scale=1.0, steps=1e300)]),
    "flipped_run": lambda repo, tmp: run_fedavg(repo, tmp, "flipped", SITES, [poison(site=LIAR, scale=-1.0)]),
    "malformed_run": _malformed,
    "no_data_run": _no_data,
}
liar_run, flipped_run = simulation("liar_run"), simulation("flipped_run")
malformed_run, no_data_run = simulation("malformed_run"), simulation("no_data_run")


# ---- a site lying about its weight ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def weight_runs(liar_run, flipped_run):
    return liar_run, flipped_run


def test_a_claimed_count_is_clipped_to_the_declared_one_naming_the_site(weight_runs):
    liar, flipped = weight_runs
    for run in (liar, flipped):
        assert run.returncode == 0, run.log[-4000:]
        assert (run.app_server / "FL_global_model.pt").is_file(), run.log[-4000:]
    assert f"site '{LIAR}' reported 1e+09 as its count" in liar.log, liar.log[-4000:]
    assert f"site '{LIAR}' reported 1e+300 as its count" in liar.log
    assert f"site '{LIAR}' reported" not in flipped.log  # its honest count is never clipped


def test_a_liar_moves_the_model_no_further_than_its_honest_weight_and_it_stays_finite(weight_runs):
    liar, flipped = weight_runs
    a = tensors(read_checkpoint(liar.app_server / "FL_global_model.pt"))
    b = tensors(read_checkpoint(flipped.app_server / "FL_global_model.pt"))
    assert a and sorted(a) == sorted(b)
    assert all(np.isfinite(v).all() for v in a.values())
    scale = max(float(np.abs(v).max()) for v in b.values())
    worst = max(float(np.abs(a[k] - b[k]).max()) for k in a)
    assert worst <= 1e-3 * scale, (worst, scale)  # the same model up to float summation order
    honest = [s for s in SITES if s != LIAR]
    assert final_dice(liar, honest) == pytest.approx(final_dice(flipped, honest), abs=0.02)


# ---- malformed updates --------------------------------------------------------------------------------
@pytest.mark.parametrize("site,reason", [
    ("site-3", "is (1,) float32, the server sent"),
    ("site-4", "1 keys the server did not send: ['model."),
    ("site-5", "1 keys missing: ['model."),
])
def test_a_malformed_update_is_refused_naming_site_and_key(malformed_run, site, reason):
    line = next((ln for ln in malformed_run.log.splitlines()
                 if f"update guard refused the 'train' result of site '{site}' in round 1" in ln), "")
    assert "does not fit the model the server sent" in line and reason in line, malformed_run.log[-4000:]
    assert f"site '{site}' in round 0" not in malformed_run.log  # round 0 was clean


def test_the_job_finishes_on_the_others_after_malformed_updates(malformed_run):
    assert malformed_run.returncode == 0, malformed_run.log[-4000:]
    assert "FATAL_SYSTEM_ERROR" not in malformed_run.log
    model = tensors(read_checkpoint(malformed_run.app_server / "FL_global_model.pt"))
    assert model and all(np.isfinite(v).all() for v in model.values())
    assert "Finished FedAvg" in malformed_run.log


# ---- a site without data ----------------------------------------------------------------------------
def test_a_site_without_data_ends_the_job_in_bounded_time_with_one_line_naming_it(no_data_run):
    run = no_data_run
    assert run.seconds < 120, run.log[-4000:]
    lines = [ln for ln in run.log.splitlines() if "2 of 3 sites answered, min_responses=3; missing: site-4 (" in ln]
    assert lines, run.log[-4000:]
    assert "EXECUTION_EXCEPTION: cannot start: site 'site-4'" in lines[0] and "holds no site-4" in lines[0]
