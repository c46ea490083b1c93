"""3D NIfTI volumes as stored by hospitals: slices and patches with the preset's preprocessing, MSD dataset.json,
errors before training, disk cache, and training on them learns (2D on slices, 3D on patches)."""

from __future__ import annotations

import json
import logging

import nibabel as nib
import numpy as np
import pytest
import torch

from medflare import DataError
from medflare.baselines.standalone import run_standalone
from medflare.data import load_site
from medflare.data.datalists import read_datalist
from medflare.presets import SMALL_SITE_OFF, get_preset
from medflare.testing.hospital_data import ORIENTED, write_volume_site

SHAPE = (24, 20, 10)  # stored array; ORIENTED: axis 0 -> A/P 0.8 mm, axis 1 -> S/I 0.9 mm, axis 2 -> L/R 3 mm
NO_AUG = {"flip": 0.0, "rotate": 0.0, "intensity": 0.0, "contrast": 0.0, "prob": 0.0}
TINY_2D = {"data": {"image_size": [16, 24], "augment": NO_AUG},
           "model": {"args": {"in_channels": 1, "out_channels": 2, "channels": [8, 16, 32], "strides": [2, 2]}},
           "train": {"batch_size": 8, "lr": 1e-2, **SMALL_SITE_OFF}}  # the curve starts from one epoch of the old work
TINY_3D = {"data": {"patch": {"size": [16, 16, 8], "per_volume": 4}, "augment": NO_AUG},
           "model": {"args": {"in_channels": 1, "out_channels": 2, "channels": [8, 16, 32], "strides": [2, 2], "spatial_dims": 3}},
           "train": {"batch_size": 2, "lr": 1e-2, **SMALL_SITE_OFF}}


@pytest.fixture(scope="module")
def sites(tmp_path_factory):
    """MEDFLARE_DATA folder: site-a (6 volumes: 4 training, 1 validation, 1 testing), site-msd (an MSD dataset.json)."""
    root = tmp_path_factory.mktemp("volumes")
    write_volume_site(root / "a", 6, shape=SHAPE, datalist=root / "site-a.json")
    write_volume_site(root / "msd", 6, shape=SHAPE, msd=True, n_unlabeled=2, seed=1, datalist=root / "site-msd.json")
    return root


@pytest.fixture(autouse=True)
def _data(sites, monkeypatch, tmp_path):
    monkeypatch.setenv("MEDFLARE_DATA", str(sites))
    monkeypatch.setenv("MEDFLARE_CACHE", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add overhead on a shared 2-core machine
    yield
    torch.set_num_threads(threads)


def _cfg(preset="seg_volumes_2d", **data):
    return get_preset(preset, {"data": {**TINY_2D["data"], **data}} if preset.endswith("2d") else {"data": {**TINY_3D["data"], **data}})["data"]


def test_slices_follow_orientation_spacing_and_size(sites):
    stored = load_site("site-a", _cfg(orientation=None, image_size=None))
    # as stored: slices along array axis 2 (the 3 mm axis), 10 per volume, 24 x 20 at 0.8 x 0.9 mm
    assert len(stored.train) == 4 * 10 and stored.train[0]["image"].shape == (1, 24, 20)
    assert stored.train[0]["spacing"].tolist() == pytest.approx([0.8, 0.9])
    ras = load_site("site-a", _cfg(image_size=None))
    # reoriented to RAS: (L/R 10 @ 3 mm, A/P 24 @ 0.8, S/I 20 @ 0.9): axial slices along S/I
    item = ras.train[0]
    assert len(ras.train) == 4 * 20 and item["image"].shape == (1, 10, 24) and item["label"].shape == (1, 10, 24)
    assert item["image"].dtype == torch.float32 and item["label"].dtype == torch.int64
    assert item["spacing"].tolist() == pytest.approx([3.0, 0.8]) and item["name"] == "case_000.nii.gz[0]"
    assert ras.in_channels == 1 and ras.spatial_dims == 2 and ras.num_classes == 2
    whole = ras.whole_volumes.datasets["val"][0]
    assert whole["image"].shape == (1, 10, 24, 20) and whole["spacing"].tolist() == pytest.approx([3.0, 0.8, 0.9])
    spaced = load_site("site-a", _cfg(spacing=[1.5, 1.6, 1.8], image_size=None)).whole_volumes.datasets["val"][0]
    n0, n1, n2 = spaced["image"].shape[1:]
    assert spaced["spacing"].tolist() == pytest.approx([1.5, 1.6, 1.8]) and n2 == 10  # 20 x 0.9 mm -> 10 x 1.8 mm
    assert n0 * 1.5 == pytest.approx(10 * 3.0, abs=1.5) and n1 * 1.6 == pytest.approx(24 * 0.8, abs=1.6)
    resampled = load_site("site-a", _cfg(spacing=[1.5, 1.6, 1.8], image_size=[16, 12]))
    w = resampled.whole_volumes.datasets["val"][0]
    assert w["image"].shape == (1, 16, 12, 10)  # then resized in-plane to image_size: the extent in mm is kept
    assert w["spacing"].tolist() == pytest.approx([1.5 * n0 / 16, 1.6 * n1 / 12, 1.8], rel=1e-3)
    batch = next(iter(torch.utils.data.DataLoader(resampled.train, batch_size=4)))
    assert batch["image"].shape == (4, 1, 16, 12) and batch["spacing"].shape == (4, 2)


def test_foreground_slices_and_ratio():
    every = load_site("site-a", _cfg())
    fg = load_site("site-a", _cfg(slices={"axis": 2, "select": "foreground", "ratio": 1.0}))
    assert 0 < len(fg.train) < len(every.train)
    assert all(int(fg.train[i]["label"].sum()) > 0 for i in range(len(fg.train)))
    half = load_site("site-a", _cfg(slices={"axis": 2, "select": "foreground", "ratio": 0.5}))
    assert abs(len(half.train) - len(fg.train) / 2) <= 3  # per volume, rounded
    assert len(half.val) == len(every.val)  # evaluation splits keep every slice


def test_intensity_modes():
    vol = lambda **kw: load_site("site-a", _cfg(image_size=None, **kw)).whole_volumes.datasets["val"][0]  # noqa: E731
    pct = vol(intensity="percentile", percentiles=[1.0, 99.0])["image"]
    assert float(pct.min()) == 0.0 and float(pct.max()) == 1.0
    z = vol(intensity="zscore")["image"]
    nonzero = z[z != 0]
    assert abs(float(nonzero.mean())) < 1e-3 and float(nonzero.std()) == pytest.approx(1.0, abs=1e-2)
    ct = vol(intensity="ct_window", window=[250.0, 350.0])["image"]
    assert float(ct.min()) == 0.0 and float(ct.max()) == 1.0 and 0 < float((ct == 1).float().mean()) < 1


def test_msd_dataset_json_as_published_loads(sites):
    content = json.loads((sites / "site-msd.json").read_text())
    assert set(content) >= {"training", "test"} and "validation" not in content and isinstance(content["test"][0], str)
    site = load_site("site-msd", _cfg())
    volumes = {s: {site.whole_volumes.datasets[s][i]["name"] for i in range(len(site.whole_volumes.datasets[s]))}
               for s in ("val", "test")}
    train = {site.train[i]["volume"] for i in range(len(site.train))}
    # 6 labeled cases carved into 4 / 1 / 1 (20% each, at least one); the unlabeled test images are not trained on
    assert len(train) == 4 and len(volumes["val"]) == len(volumes["test"]) == 1
    assert not (train & volumes["val"]) and not (train & volumes["test"]) and not any("case_10" in n for n in train)
    unlabeled = read_datalist(sites / "site-msd.json", "testing", labeled=False)
    assert [e["image"].split("/")[-1] for e in unlabeled] == ["case_100.nii.gz", "case_101.nii.gz"]
    with pytest.raises(DataError, match=r"site-msd.json.*'testing'.*MSD"):
        read_datalist(sites / "site-msd.json", "testing")


def _site_with(tmp_path, monkeypatch, image, label, suffix=".nii.gz", label_affine=ORIENTED):
    """MEDFLARE_DATA/site-x.json whose every split is one case of the given arrays."""
    folder = tmp_path / "x"
    folder.mkdir(exist_ok=True)
    for name, arr, affine in (("img", image, ORIENTED), ("lbl", label, label_affine)):
        if suffix == ".png":
            from PIL import Image
            Image.fromarray(arr).save(folder / f"{name}{suffix}")
        else:
            nib.save(nib.Nifti1Image(arr, affine), folder / f"{name}{suffix}")
    entry = [{"image": f"x/img{suffix}", "label": f"x/lbl{suffix}"}]
    (tmp_path / "site-x.json").write_text(json.dumps({"training": entry, "validation": entry, "testing": entry}))
    monkeypatch.setenv("MEDFLARE_DATA", str(tmp_path))


@pytest.mark.parametrize("case, preset, message", [
    ("png", "seg_volumes_2d", r"site 'site-x'.*img.png' is a 2D image .* data kind 'volumes' expects 3D volumes"),
    ("volume", "seg_images_2d", r"site 'site-x'.*img.nii.gz' is a 3D volume .*expects 2D images; volumes train with preset 'seg_volumes_2d'"),
    ("two_channels", "seg_volumes_3d", r"site 'site-x'.*img.nii.gz' has 2 channel\(s\) but the preset expects 1 .*'data.channels'"),
    ("label_shape", "seg_volumes_2d", r"img.nii.gz' has shape \(1, 24, 20, 10\) but label .*lbl.nii.gz' has shape \(1, 24, 20, 9\)"),
    ("label_values", "seg_volumes_2d", r"lbl.nii.gz' has values in \[0, 4\], expected integers in \[0, 3\)"),
    ("label_affine", "seg_volumes_3d", r"label .*lbl.nii.gz' lies elsewhere than image .*img.nii.gz': their affines differ"),
])
def test_mismatches_are_clear_errors_before_training(tmp_path, monkeypatch, case, preset, message):
    """load_site runs at START_RUN, before any training: a mismatch stops the site there, naming the file."""
    vol = np.random.default_rng(0).random(SHAPE).astype(np.float32)
    lab = np.zeros(SHAPE, np.uint8)
    overrides = {}
    if case == "png":
        _site_with(tmp_path, monkeypatch, (vol[..., 0] * 255).astype(np.uint8), lab[..., 0], suffix=".png")
    elif case == "volume":
        _site_with(tmp_path, monkeypatch, vol, lab)
        overrides = {"data": {"channels": 1}}
    elif case == "two_channels":
        _site_with(tmp_path, monkeypatch, np.stack([vol, vol], -1), lab)
    elif case == "label_shape":
        _site_with(tmp_path, monkeypatch, vol, lab[..., :9])
    elif case == "label_affine":
        _site_with(tmp_path, monkeypatch, vol, lab, label_affine=np.diag([1.0, 1.0, 1.0, 1.0]))
    else:
        lab[2:5, 2:5, 2:5] = 4
        _site_with(tmp_path, monkeypatch, vol, lab)
        overrides = {"data": {"num_classes": 3}}
    with pytest.raises(DataError, match=message):
        load_site("site-x", get_preset(preset, overrides)["data"])


def test_channel_indices_pick_a_modality_and_label_values_map(tmp_path, monkeypatch):
    vol = np.random.default_rng(0).random(SHAPE).astype(np.float32)
    lab = np.zeros(SHAPE, np.uint8)
    lab[2:6, 2:6, 2:6], lab[8:12, 8:12, 3:6] = 4, 2  # BraTS-like stored values 0, 2, 4
    _site_with(tmp_path, monkeypatch, np.stack([vol, 1 - vol], -1), lab)
    data = get_preset("seg_volumes_2d", {"data": {"channel_indices": [1], "num_classes": 3, "labels": [0, 2, 4],
                                                  "intensity": "none", "orientation": None, "image_size": None}})["data"]
    site = load_site("site-x", data)
    whole = site.whole_volumes.datasets["val"][0]
    assert torch.allclose(whole["image"][0], torch.from_numpy(1 - vol)) and site.in_channels == 1
    assert torch.equal(whole["label"][0], torch.from_numpy(np.select([lab == 2, lab == 4], [1, 2], 0)).long())


def test_patches_and_whole_volumes_3d():
    site = load_site("site-a", _cfg("seg_volumes_3d"))
    assert site.spatial_dims == 3 and len(site.train) == 4 * 4
    patches = [site.train[i] for i in range(len(site.train))]
    assert all(p["image"].shape == (1, 16, 16, 8) and p["label"].shape == (1, 16, 16, 8) for p in patches)
    assert sum(int(p["label"].sum()) > 0 for p in patches) >= len(patches) // 2  # pos_fraction 0.5 centres on foreground
    assert site.val[0]["image"].shape == (1, 10, 24, 20)  # a whole volume (RAS) for per-volume scoring


def test_disk_cache_holds_preprocessed_volumes_and_is_reused(tmp_path, monkeypatch):
    from medflare.data import transforms

    calls = []
    original = transforms.LoadPair.__call__
    monkeypatch.setattr(transforms.LoadPair, "__call__", lambda self, entry: calls.append(entry["image"]) or original(self, entry))
    cache = {"mode": "disk", "rate": 1.0, "dir": str(tmp_path / "disk")}
    first = load_site("site-a", _cfg(cache=cache))
    # each volume preprocessed once; the cache holds the 6 volumes and, for 2D training, every slice of them
    slices = len(first.train) + len(first.val) + len(first.test)
    assert len(calls) == 6 and len(list((tmp_path / "disk").glob("*.pt"))) == 6 + slices
    again = load_site("site-a", _cfg(cache=cache))
    assert len(calls) == 6  # every volume and slice came from the disk cache
    memory = load_site("site-a", _cfg())
    for i in (0, 17, len(first.train) - 1):
        assert torch.equal(again.train[i]["image"], memory.train[i]["image"])
        assert torch.equal(again.train[i]["label"], memory.train[i]["label"])


def test_files_are_read_by_their_own_reader(caplog, monkeypatch):
    """No NIfTI file is first offered to the PIL reader (which logged 'unable to load' at INFO for each)."""
    with caplog.at_level(logging.DEBUG):
        load_site("site-a", _cfg())
        monkeypatch.delenv("MEDFLARE_DATA")
        synthetic = load_site("site-1", dict(get_preset("seg_synthetic_tiny")["data"], scale=0.05))  # 2D NIfTI
    assert len(synthetic.train) > 0 and "unable to load" not in caplog.text


def test_training_on_slices_from_volumes_learns():
    out = run_standalone("local", "seg_volumes_2d", ["site-a"], epochs=5, overrides=TINY_2D, device="cpu", log=lambda _: None)
    # per-volume Dice of the site's validation volume, epoch by epoch, and on its test volume
    assert out["curve"][-1] > out["curve"][0] + 0.2 and out["curve"][-1] > 0.8, out["curve"]
    assert out["client_average"]["dice"] > 0.8 and out["client_average"]["hd95"] < 3.0, out["client_average"]


def test_3d_baseline_on_patches_learns():
    out = run_standalone("local", "seg_volumes_3d", ["site-a"], epochs=5, overrides=TINY_3D, device="cpu", log=lambda _: None)
    assert out["curve"][-1] > out["curve"][0] + 0.2 and out["curve"][-1] > 0.75, out["curve"]
    assert out["client_average"]["dice"] > 0.75, out["client_average"]
