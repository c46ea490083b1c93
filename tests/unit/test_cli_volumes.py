"""`medflare predict` and `evaluate` on volumes: predictions on the stored grid with the stored affine and header,
per-volume metrics in mm equal to hand-computed distances, and `medflare data --from-folder`."""

from __future__ import annotations

import json

import nibabel as nib
import numpy as np
import pytest
import torch

from medflare.cli import main
from medflare.common.persistence import model_from_preset
from medflare.common.results import describe
from medflare.data.datalists import read_datalist
from medflare.data.writeback import predict_on_stored_grid, scored_batches, volume_entries
from medflare.metrics import evaluate
from medflare.presets import get_preset
from medflare.testing.hospital_data import ORIENTED, write_volume_site

NO_AUG = {"flip": 0.0, "rotate": 0.0, "intensity": 0.0, "contrast": 0.0, "prob": 0.0}
PRESETS = {
    "seg_volumes_2d": {"data": {"image_size": [16, 16], "augment": NO_AUG},
                       "model": {"args": {"in_channels": 1, "out_channels": 2, "channels": [4, 8], "strides": [2]}}},
    "seg_volumes_3d": {"data": {"patch": {"size": [16, 16, 8], "per_volume": 1}, "augment": NO_AUG},
                       "model": {"args": {"in_channels": 1, "out_channels": 2, "channels": [4, 8], "strides": [2], "spatial_dims": 3}}},
}


def _checkpoint(path, preset):
    model = model_from_preset(preset, PRESETS[preset], seed=0).eval()
    torch.save({"model": model.state_dict(), "train_conf": {"medflare": describe(preset, PRESETS[preset])}}, path)
    return path, model


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_predict_writes_each_volume_with_its_affine_header_and_shape(tmp_path, preset):
    datalist = write_volume_site(tmp_path / "d", 5, shape=(24, 20, 10), msd=True, n_unlabeled=2)
    for entry in json.loads(datalist.read_text())["test"]:  # a header field a viewer shows
        img = nib.load(tmp_path / "d" / entry)
        img.header["descrip"] = b"scanner X"
        nib.save(img, tmp_path / "d" / entry)
    ckpt, model = _checkpoint(tmp_path / "m.pt", preset)
    out = tmp_path / "pred"
    assert main(["predict", "--model", str(ckpt), "--datalist", str(datalist), "--split", "testing", "--out", str(out)]) == 0
    entries = read_datalist(datalist, "testing", labeled=False)  # MSD's unlabeled test images
    assert sorted(p.name for p in out.iterdir()) == ["case_100_pred.nii.gz", "case_101_pred.nii.gz"]
    data = get_preset(preset, PRESETS[preset])["data"]
    for entry, pred in predict_on_stored_grid(model, entries, data, 2, "cpu"):
        source = nib.load(entry["image"])
        written = nib.load(out / entry["image"].split("/")[-1].replace(".nii.gz", "_pred.nii.gz"))
        assert written.shape == source.shape == (24, 20, 10) and np.allclose(written.affine, ORIENTED)
        assert written.header["descrip"].tobytes().startswith(b"scanner X") and written.get_data_dtype() == np.uint8
        assert np.array_equal(written.get_fdata(), pred.as_tensor()[0].numpy())


def _plane_volume(folder, name, axis, at_image, at_label, shape=(12, 10, 8)):
    image, label = np.zeros(shape, np.float32), np.zeros(shape, np.uint8)
    np.moveaxis(image, axis, 0)[at_image] = 1.0
    np.moveaxis(label, axis, 0)[at_label] = 1
    nib.save(nib.Nifti1Image(image, ORIENTED), folder / f"{name}_img.nii.gz")
    nib.save(nib.Nifti1Image(label, ORIENTED), folder / f"{name}_lbl.nii.gz")
    return {"image": f"{name}_img.nii.gz", "label": f"{name}_lbl.nii.gz"}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_per_volume_hd95_on_the_stored_grid_equals_the_distance_in_mm(tmp_path, preset):
    """ORIENTED voxels are 0.8 x 0.9 x 3 mm along the stored axes and the model sees them reoriented to RAS (and, in
    2D, slice by slice): a predictor that thresholds the image puts a plane 2 voxels (6 mm) or 3 voxels (2.4 mm) from
    the labelled one; the metric on the stored grid must say so."""
    cases = [_plane_volume(tmp_path, "far", 2, 5, 3), _plane_volume(tmp_path, "near", 0, 7, 4)]
    (tmp_path / "site.json").write_text(json.dumps({"training": cases, "validation": cases, "testing": cases}))
    data = get_preset(preset, {**PRESETS[preset], "data": {**PRESETS[preset]["data"], "intensity": "none", "image_size": None}}
                      if preset.endswith("2d") else {**PRESETS[preset], "data": {**PRESETS[preset]["data"], "intensity": "none"}})["data"]
    threshold = lambda x: torch.cat([0.5 - x, x - 0.5], 1)  # noqa: E731 - logits of "image > 0.5"
    entries = volume_entries(tmp_path / "site.json", "testing", data)
    result = evaluate(None, scored_batches(threshold, entries, data, 2, "cpu"), task="segmentation", num_classes=2,
                      metrics=["hd95", "surface_dice_2.3mm", "surface_dice_2.4mm", "dice"], predict=lambda x: x)
    rows = {row["name"]: row for row in result["per_case"]}
    assert rows["far_img.nii.gz"]["hd95"] == pytest.approx(6.0) and rows["near_img.nii.gz"]["hd95"] == pytest.approx(2.4)
    assert rows["near_img.nii.gz"]["surface_dice_2.3mm"] == 0.0 and rows["near_img.nii.gz"]["surface_dice_2.4mm"] == 1.0


def test_evaluate_on_volumes_prints_per_volume_scores_of_the_stored_grid(tmp_path, capsys):
    datalist = write_volume_site(tmp_path / "d", 5, shape=(24, 20, 10))
    ckpt, model = _checkpoint(tmp_path / "m.pt", "seg_volumes_2d")
    out = tmp_path / "r.json"
    assert main(["evaluate", "--model", str(ckpt), "--datalist", str(datalist), "--split", "validation", "--verbose",
                 "--out", str(out)]) == 0
    site = json.loads(out.read_text())["evaluations"][0]["sites"][str(datalist)]
    data = get_preset("seg_volumes_2d", PRESETS["seg_volumes_2d"])["data"]
    entries = volume_entries(datalist, "validation", data)
    direct = evaluate(None, scored_batches(model, entries, data, 2, "cpu"), task="segmentation", num_classes=2,
                      metrics=get_preset("seg_volumes_2d")["eval"]["metrics"], predict=lambda x: x)
    assert [c["name"] for c in site["per_case"]] == ["case_003.nii.gz"]  # one row per volume, not per slice
    assert site["mean"] == pytest.approx(direct["mean"], nan_ok=True)
    assert "surface_dice_2mm" in capsys.readouterr().out


def test_data_from_folder_writes_a_datalist_a_site_loads(tmp_path, monkeypatch, capsys):
    write_volume_site(tmp_path / "Task05", 6, msd=True, n_unlabeled=1)
    (tmp_path / "Task05" / "site.json").unlink()
    out = tmp_path / "lists" / "site-1.json"
    assert main(["data", "--from-folder", str(tmp_path / "Task05"), "--out", str(out)]) == 0
    assert "training 4, validation 1, testing 1, test 1" in capsys.readouterr().out
    monkeypatch.setenv("MEDFLARE_DATA", str(out.parent))
    monkeypatch.setenv("MEDFLARE_CACHE", str(tmp_path / "cache"))
    from medflare.data import load_site

    site = load_site("site-1", get_preset("seg_volumes_2d", PRESETS["seg_volumes_2d"])["data"])
    assert len(site.whole_volumes.datasets["test"]) == 1
    assert main(["data", "--from-folder", str(tmp_path / "lists")]) == 2
    assert "found no image/label pairs" in capsys.readouterr().err
