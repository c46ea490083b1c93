"""Jobs on hospital volumes: the FedAvg job trains 2D models on slices of each site's own NIfTI volumes (a datalist at
one site, an MSD dataset.json at the other) by changing only the preset, validates per volume in mm, and the saved
model is scored per volume by `medflare evaluate` and written back by `medflare predict` on the stored grid."""

import json

import nibabel as nib
import numpy as np
import pytest

from medflare.cli import main as medflare_main
from medflare.testing.hospital_data import write_volume_site
from medflare.jobs.customize import customize_job
from medflare.jobs.simulate import run_simulator

from . import simulation

pytestmark = pytest.mark.slow

ROUNDS = 3
CLIENTS = ["site-1", "site-2"]
NO_AUG = {"flip": 0.0, "rotate": 0.0, "intensity": 0.0, "contrast": 0.0, "prob": 0.0}
TINY = {"data": {"image_size": [16, 16], "augment": NO_AUG},
        "model": {"args": {"in_channels": 1, "out_channels": 2, "channels": [8, 16, 32], "strides": [2, 2]}},
        "train": {"epochs": 2, "batch_size": 8, "lr": 1e-2}}


def _data(tmp_path):
    """Two sites' volumes (for MEDFLARE_DATA): site-1 a datalist with its own splits, site-2 an MSD dataset.json (other
    shape); each run writes its own copy."""
    data = tmp_path / "data"
    write_volume_site(data / "one", 6, shape=(24, 20, 10), seed=1, datalist=data / "site-1.json")
    write_volume_site(data / "two", 6, shape=(20, 24, 12), seed=2, msd=True, datalist=data / "site-2.json")
    return data


TINY_3D = {"data": {"augment": NO_AUG, "patch": {"size": [16, 16, 8], "per_volume": 4, "pos_fraction": 0.5, "overlap": 0.25,
                                                "sw_batch_size": 4}},
           "model": {"args": {"in_channels": 1, "out_channels": 2, "channels": [8, 16, 32], "strides": [2, 2], "spatial_dims": 3}},
           "train": {"epochs": 2, "batch_size": 4, "lr": 1e-2}}


def _run(repo, tmp_path, job, workflow_args, preset="seg_volumes_2d", overrides=TINY):
    """(the data folder, the run)"""
    data = _data(tmp_path)
    folder = customize_job(repo / "jobs" / job, tmp_path / "job", preset=preset, overrides=overrides,
                           workflow_args={"num_rounds": ROUNDS, **workflow_args}, executor_args={"overlay_every": 2})
    run = run_simulator(folder, tmp_path / "ws", len(CLIENTS), clients=CLIENTS, timeout=300, env={"MEDFLARE_DATA": str(data)})
    assert run.returncode == 0 and "EXECUTION_EXCEPTION" not in run.log, run.log[-4000:]
    return data, run


#: every run of the module, started in the background (tests/e2e/__init__.py)
RUNS = {
    "fedavg_run": lambda repo, tmp: _run(repo, tmp, "fedavg", {"num_clients": len(CLIENTS)}),
    "fedsm_run": lambda repo, tmp: _run(repo, tmp, "fedsm", {}),
    "fedsm_3d_run": lambda repo, tmp: _run(repo, tmp, "fedsm", {}, preset="seg_volumes_3d", overrides=TINY_3D),
}
fedavg_run, fedsm_run, fedsm_3d_run = simulation("fedavg_run"), simulation("fedsm_run"), simulation("fedsm_3d_run")


def test_fedavg_on_volume_slices_learns_and_writes_back(fedavg_run, tmp_path, monkeypatch):
    data, run = fedavg_run
    monkeypatch.setenv("MEDFLARE_DATA", str(data))  # the sites' volumes, for `medflare evaluate`
    for site, series in run.site_scalars().items():
        dice = dict(series["val_global/dice"])
        assert dice[ROUNDS - 1] > dice[0] + 0.2 and dice[ROUNDS - 1] > 0.6, f"{site}: per-volume Dice {dice}"
        assert "val_global/hd95" in series and "val_global/surface_dice_2mm" in series

    model = run.app_server / "FL_global_model.pt"
    out = tmp_path / "eval.json"
    assert medflare_main(["evaluate", "--model", str(model), "--site", "site-2", "--out", str(out)]) == 0
    scored = json.loads(out.read_text())["evaluations"][0]["sites"]["site-2"]
    assert scored["num_cases"] == 1 and scored["mean"]["dice"] > 0.6, scored  # the one test volume carved from MSD's training
    pred = tmp_path / "pred"
    assert medflare_main(["predict", "--model", str(model), "--datalist", str(data / "site-2.json"), "--out", str(pred)]) == 0
    written = nib.load(pred / "case_100_pred.nii.gz")  # MSD's unlabeled test image
    source = nib.load(data / "two" / "imagesTs" / "case_100.nii.gz")
    assert written.shape == source.shape and np.allclose(written.affine, source.affine)
    assert 0 < written.get_fdata().mean() < 0.5  # a plausible foreground, not empty or everything


def test_fedsm_runs_on_volume_slices(fedsm_run):
    """The FedSM job with only the preset changed: its three models learn on slices and are scored per volume."""
    _, run = fedsm_run
    for site, series in run.site_scalars().items():
        # in training rounds a site holds only its own personalised model, so it reports "own or global" (the super
        # model when the selector routes to this site or to the global model); the full super model is scored at the end
        for name in ("val/global_dice", "val/person_dice", "val/own_or_global_dice"):
            dice = dict(series[name])
            assert dice[ROUNDS - 1] > dice[0] + 0.2 and dice[ROUNDS - 1] > 0.6, f"{site}: {name} {dice}"
        final = dict(series["final/super_dice"])  # the super model with every site's personalised model, per volume
        assert max(final.values()) > 0.6, f"{site}: final/super_dice {final}"


def test_fedsm_in_full_3d_on_patches(fedsm_3d_run):
    """The FedSM job with the 3D preset: patch-trained 3D UNets, every model and the selector scored on whole volumes
    (sliding windows for the networks, the selector's encoder stem on the whole volume), per volume."""
    _, run = fedsm_3d_run
    for site, series in run.site_scalars().items():
        for name in ("val/global_dice", "val/person_dice"):
            dice = dict(series[name])
            assert dice[ROUNDS - 1] > dice[0] + 0.2, f"{site}: {name} {dice}"
        final = dict(series["final/super_dice"])
        assert max(final.values()) > 0.6, f"{site}: final/super_dice {final}"
