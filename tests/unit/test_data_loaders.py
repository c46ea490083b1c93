"""Datalist (NIfTI/PNG) and MedMNIST-npz loaders: formats, batching and every user-caused error."""

from __future__ import annotations

import json

import nibabel as nib
import numpy as np
import pytest
import torch
from PIL import Image

from medflare import MedflareError
from medflare.data import load_npz_split, load_seg_split


def _write_nifti_site(root, n=2, shape=(8, 8), label_shape=None, label_value=1, splits=("training", "validation", "testing")):
    """A tiny NIfTI datalist ``root/site.json`` with ``n`` cases per split; returns the JSON path."""
    rng = np.random.default_rng(0)
    content = {}
    for split in splits:
        content[split] = []
        for i in range(n):
            img, lbl = root / f"{split}_{i}_img.nii.gz", root / f"{split}_{i}_lbl.nii.gz"
            nib.save(nib.Nifti1Image(rng.random(shape).astype(np.float32), np.eye(4)), img)
            mask = np.zeros(label_shape or shape, np.uint8)
            mask[2:5, 2:5] = label_value
            nib.save(nib.Nifti1Image(mask, np.eye(4)), lbl)
            content[split].append({"image": img.name, "label": lbl.name})
    path = root / "site.json"
    path.write_text(json.dumps(content))
    return path


def _write_npz(path, n=6, drop=None, **overrides):
    """A tiny MedMNIST-layout npz; ``drop`` removes a key, ``overrides`` replaces arrays."""
    rng = np.random.default_rng(0)
    arrays = {}
    for split in ("train", "val", "test"):
        arrays[f"{split}_images"] = rng.integers(0, 256, (n, 8, 8), dtype=np.uint8)
        arrays[f"{split}_labels"] = (np.arange(n) % 3).astype(np.uint8)[:, None]
    arrays.update(overrides)
    arrays.pop(drop, None)
    np.savez(path, **arrays)
    return path


def test_nifti_datalist_loads_and_batches(tmp_path):
    ds = load_seg_split(_write_nifti_site(tmp_path), "validation", num_classes=2)
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=2)))
    assert batch["image"].shape == (2, 1, 8, 8) and batch["label"].shape == (2, 1, 8, 8)
    assert batch["label"].dtype == torch.int64 and batch["name"] == ["validation_0_img.nii.gz", "validation_1_img.nii.gz"]


def test_png_datalist_loads_like_nifti(tmp_path):
    img = (np.arange(6 * 10).reshape(6, 10) * 4).astype(np.uint8)  # H=6, W=10, not square
    mask = np.zeros((6, 10), np.uint8)
    mask[1:3, 2:7] = 2
    content = {}
    for split in ("training", "validation", "testing"):
        Image.fromarray(img).save(tmp_path / f"{split}.png")
        Image.fromarray(np.stack([img] * 3, -1)).save(tmp_path / f"{split}_rgb.png")
        Image.fromarray(mask).save(tmp_path / f"{split}_mask.png")
        content[split] = [{"image": f"{split}.png", "label": f"{split}_mask.png"}, {"image": f"{split}_rgb.png", "label": f"{split}_mask.png"}]
    (tmp_path / "png.json").write_text(json.dumps(content))
    ds = load_seg_split(tmp_path / "png.json", "training", num_classes=3)
    gray, rgb = ds[0], ds[1]
    assert gray["image"].shape == (1, 6, 10) and rgb["image"].shape == (3, 6, 10)
    assert torch.equal(gray["label"][0], torch.from_numpy(mask).long())  # row-major, same as the array
    assert torch.allclose(gray["image"][0], torch.from_numpy(img / img.max()).float(), atol=1e-5)


def test_npz_round_trip_and_layouts(tmp_path):
    images = np.random.default_rng(0).integers(0, 256, (5, 8, 8, 3), dtype=np.uint8)
    path = _write_npz(tmp_path / "s.npz", n=5, test_images=images, test_labels=np.arange(5))
    ds = load_npz_split(path, "test", num_classes=10)
    assert len(ds) == 5 and ds[2]["name"] == "test_2"
    assert torch.allclose(ds[2]["image"], torch.from_numpy(images[2].transpose(2, 0, 1) / 255.0).float())
    assert ds[3]["label"].item() == 3 and ds[3]["label"].dtype == torch.int64
    floats = _write_npz(tmp_path / "f.npz", train_images=np.linspace(0, 1000, 6 * 64).reshape(6, 8, 8))
    x = load_npz_split(floats, "train")[5]["image"]
    assert x.shape == (1, 8, 8) and float(x.max()) == pytest.approx(1.0)
    # one scale over the whole array, not per image: image 0 holds the lowest 64 of 384 values
    x0 = load_npz_split(floats, "train")[0]["image"]
    assert float(x0.min()) == 0.0 and float(x0.max()) == pytest.approx(63 / 383)
    unit = np.linspace(0.2, 0.7, 6 * 64).reshape(6, 8, 8)  # float already in [0, 1]: kept as is
    kept = load_npz_split(_write_npz(tmp_path / "u.npz", train_images=unit), "train")[1]["image"]
    assert torch.allclose(kept[0], torch.from_numpy(unit[1]).float())
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=5)))
    assert batch["image"].shape == (5, 3, 8, 8) and batch["label"].shape == (5,)


# ---- errors: one test each, the message names the file / key ----

def test_error_missing_image_file(tmp_path):
    path = _write_nifti_site(tmp_path)
    (tmp_path / "training_1_img.nii.gz").unlink()
    with pytest.raises(MedflareError, match="training_1_img.nii.gz"):
        load_seg_split(path, "training", num_classes=2)


def test_error_unreadable_image_file(tmp_path):
    path = _write_nifti_site(tmp_path)
    (tmp_path / "testing_0_lbl.nii.gz").write_bytes(b"not a nifti")
    with pytest.raises(MedflareError, match="testing_0_lbl.nii.gz"):
        load_seg_split(path, "testing", num_classes=2)


def test_error_unreadable_file_surfaces_lazily_without_cache(tmp_path):
    path = _write_nifti_site(tmp_path)
    (tmp_path / "testing_0_img.nii.gz").write_bytes(b"garbage")
    ds = load_seg_split(path, "testing", num_classes=2, cache=False)
    with pytest.raises(MedflareError, match="testing_0_img.nii.gz"):
        ds[0]


def test_error_image_label_shape_mismatch(tmp_path):
    path = _write_nifti_site(tmp_path, label_shape=(8, 6))
    with pytest.raises(MedflareError, match=r"training_0_img.nii.gz.*shape"):
        load_seg_split(path, "training", num_classes=2)


def test_error_label_out_of_range(tmp_path):
    path = _write_nifti_site(tmp_path, label_value=255)
    with pytest.raises(MedflareError, match=r"training_0_lbl.nii.gz.*\[0, 3\)"):
        load_seg_split(path, "training", num_classes=3)


def test_error_empty_split(tmp_path):
    path = _write_nifti_site(tmp_path)
    content = json.loads(path.read_text())
    content["validation"] = []
    path.write_text(json.dumps(content))
    with pytest.raises(MedflareError, match=r"site.json.*'validation' is empty"):
        load_seg_split(path, "validation", num_classes=2)


def test_error_datalist_missing_split_key(tmp_path):
    path = _write_nifti_site(tmp_path, splits=("training", "validation"))
    with pytest.raises(MedflareError, match=r"site.json.*'testing'"):
        load_seg_split(path, "testing", num_classes=2)


def test_error_datalist_not_json(tmp_path):
    (tmp_path / "bad.json").write_text("{training: [")
    with pytest.raises(MedflareError, match=r"bad.json.*not valid JSON"):
        load_seg_split(tmp_path / "bad.json", "training", num_classes=2)


def test_error_npz_missing_key(tmp_path):
    path = _write_npz(tmp_path / "s.npz", drop="val_labels")
    with pytest.raises(MedflareError, match=r"s.npz.*'val_labels'"):
        load_npz_split(path, "val")


def test_error_npz_empty_split(tmp_path):
    path = _write_npz(tmp_path / "s.npz", test_images=np.zeros((0, 8, 8), np.uint8), test_labels=np.zeros((0, 1)))
    with pytest.raises(MedflareError, match=r"s.npz.*'test' is empty"):
        load_npz_split(path, "test")


def test_error_npz_label_out_of_range(tmp_path):
    path = _write_npz(tmp_path / "s.npz", train_labels=np.full((6, 1), 12))
    with pytest.raises(MedflareError, match=r"s.npz.*\[0, 10\)"):
        load_npz_split(path, "train", num_classes=10)


def test_error_npz_unreadable(tmp_path):
    (tmp_path / "x.npz").write_bytes(b"nope")
    with pytest.raises(MedflareError, match="x.npz"):
        load_npz_split(tmp_path / "x.npz", "train")
