"""Photographs as a fundus folder holds them (RGB, any size, masks 0/255) and datalists written for folders."""

from __future__ import annotations

import json

import nibabel as nib
import numpy as np
import pytest
import torch
from PIL import Image

from medflare import DataError
from medflare.data import load_site
from medflare.data.datalists import datalist_from_folder, site_splits
from medflare.presets import get_preset
from medflare.testing.hospital_data import write_rgb_site, write_volume_site

SIZES = [(40, 56), (64, 48), (33, 70), (50, 50), (45, 60), (80, 36)]
NO_AUG = {"flip": 0.0, "rotate": 0.0, "intensity": 0.0, "contrast": 0.0, "prob": 0.0}


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("MEDFLARE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MEDFLARE_DATA", raising=False)


def _fundus_site(tmp_path, **kw):
    folder = write_rgb_site(tmp_path / "fundus", SIZES, **kw)
    path = tmp_path / "site-1.json"
    path.write_text(json.dumps(datalist_from_folder(folder, path, val_fraction=0.2, test_fraction=0.2)))
    return path


def test_rgb_images_of_varied_sizes_are_resized_and_batch(tmp_path, monkeypatch):
    _fundus_site(tmp_path)
    monkeypatch.setenv("MEDFLARE_DATA", str(tmp_path))
    site = load_site("site-1", get_preset("seg_images_2d", {"data": {"image_size": [24, 32], "augment": NO_AUG}})["data"])
    assert site.in_channels == 3 and (len(site.train), len(site.val), len(site.test)) == (4, 1, 1)
    batch = next(iter(torch.utils.data.DataLoader(site.train, batch_size=4)))
    assert batch["image"].shape == (4, 3, 24, 32) and batch["label"].shape == (4, 1, 24, 32)
    assert set(batch["label"].unique().tolist()) == {0, 1}  # masks stored 0/255: foreground of a 2-class preset
    assert float(batch["image"].min()) >= 0 and float(batch["image"].max()) <= 1
    # resizing keeps the colour: red stays the strongest channel
    assert bool((batch["image"][:, 0].mean((1, 2)) > batch["image"][:, 2].mean((1, 2))).all())


def test_pad_crop_and_a_label_value_list(tmp_path, monkeypatch):
    _fundus_site(tmp_path, classes=3, mask_values=[255, 128, 0])  # REFUGE-style: background 255, disc 128, cup 0
    monkeypatch.setenv("MEDFLARE_DATA", str(tmp_path))
    data = get_preset("seg_images_2d", {"data": {"image_size": [48, 48], "fit": "pad_crop", "num_classes": 3,
                                                 "labels": [255, 128, 0], "augment": NO_AUG}})["data"]
    site = load_site("site-1", data)
    item = site.train[0]
    assert item["image"].shape == (3, 48, 48) and set(item["label"].unique().tolist()) <= {0, 1, 2}
    assert int((item["label"] == 2).sum()) > 0  # the cup


def test_augmentation_changes_training_items_only(tmp_path, monkeypatch):
    _fundus_site(tmp_path)
    monkeypatch.setenv("MEDFLARE_DATA", str(tmp_path))
    flip = {"flip": 1.0, "rotate": 0.0, "intensity": 0.0, "contrast": 0.0, "prob": 0.0}
    plain = load_site("site-1", get_preset("seg_images_2d", {"data": {"image_size": [32, 32], "augment": NO_AUG}})["data"])
    flipped = load_site("site-1", get_preset("seg_images_2d", {"data": {"image_size": [32, 32], "augment": flip}})["data"])
    a, b = plain.train[0], flipped.train[0]
    assert torch.allclose(b["image"], a["image"].flip(1, 2)) and torch.equal(b["label"], a["label"].flip(1, 2))
    assert b["label"].dtype == torch.int64
    assert torch.equal(flipped.val[0]["image"], plain.val[0]["image"])


def test_grey_image_for_an_rgb_preset_is_an_error_naming_the_file(tmp_path, monkeypatch):
    folder = write_rgb_site(tmp_path / "f", SIZES[:5])
    Image.open(folder / "images" / "img_03.png").convert("L").save(folder / "images" / "img_03.png")
    path = tmp_path / "site-1.json"
    path.write_text(json.dumps(datalist_from_folder(folder, path)))
    monkeypatch.setenv("MEDFLARE_DATA", str(tmp_path))
    with pytest.raises(DataError, match=r"site 'site-1'.*img_03.png' has 1 channel\(s\) but the preset expects 3"):
        load_site("site-1", get_preset("seg_images_2d", {"data": {"cache": {"mode": "none", "rate": 0.0, "dir": None}}})["data"])


def test_datalists_for_the_usual_folder_layouts(tmp_path):
    # MSD / nnU-Net: imagesTr + labelsTr (+ imagesTs, unlabeled)
    write_volume_site(tmp_path / "msd", 5, msd=True, n_unlabeled=2)
    msd = datalist_from_folder(tmp_path / "msd", tmp_path / "msd.json")
    assert sum(len(msd[k]) for k in ("training", "validation", "testing")) == 5 and len(msd["test"]) == 2
    assert msd["training"][0]["image"].startswith("msd/imagesTr/") and msd["training"][0]["label"].startswith("msd/labelsTr/")
    # BraTS: one folder per case, modalities + _seg
    for case in ("BraTS_001", "BraTS_002", "BraTS_003"):
        (tmp_path / "brats" / case).mkdir(parents=True)
        for name in ("flair", "t1", "t1ce", "t2", "seg"):
            nib.save(nib.Nifti1Image(np.zeros((4, 4, 4), np.float32), np.eye(4)), tmp_path / "brats" / case / f"{case}_{name}.nii.gz")
    brats = datalist_from_folder(tmp_path / "brats", tmp_path / "brats.json", val_fraction=0.34, test_fraction=0.34)
    entry = (brats["training"] + brats["validation"] + brats["testing"])[0]
    assert [p.rsplit("_", 1)[-1] for p in entry["image"]] == ["flair.nii.gz", "t1.nii.gz", "t1ce.nii.gz", "t2.nii.gz"]
    assert entry["label"].endswith("_seg.nii.gz")
    # a fundus folder: images/ + masks/<id>_mask.png; an image without a mask is listed, never loaded
    folder = write_rgb_site(tmp_path / "fundus", SIZES[:4])
    Image.new("RGB", (8, 8)).save(folder / "images" / "orphan.png")
    fundus = datalist_from_folder(folder, tmp_path / "fundus.json")
    assert fundus["unmatched"] == ["orphan"] and sum(len(fundus[k]) for k in ("training", "validation", "testing")) == 4
    (tmp_path / "fundus.json").write_text(json.dumps(fundus))
    assert sum(len(v) for v in site_splits(tmp_path / "fundus.json").values()) == 4
    with pytest.raises(DataError, match="found no image/label pairs"):
        datalist_from_folder(tmp_path / "fundus" / "masks", tmp_path / "x.json")
