"""The bad files measured in issue 17, each refused with one line naming the file and the key or entry: a text file
listed as an image, a complex-valued .npz, NaN or complex NIfTI; and the rule for where a site's own datalist may
point (anywhere the operator wrote: ``..``, absolute paths, symlinks; but only to regular files). Issue 28's bounded
inputs and silent failures: decompression bombs refused from their headers, result files whose settings ask for
more than their weights hold or whose weights are NaN, an image of another size, a truncated disk-cache entry."""

from __future__ import annotations

import json
import logging
import os
import resource
import zlib

import nibabel as nib
import numpy as np
import pytest
import torch
from PIL import Image

from medflare import ConfigError, DataError
from medflare.cli import main
from medflare.common.persistence import model_from_preset
from medflare.common.results import describe
from medflare.data import load_npz_split, load_seg_split, load_site, make_seg_site
from medflare.data.datalists import read_datalist
from medflare.data.loaders import seg_image_dataset
from medflare.data.transforms import check_image_size
from medflare.presets import get_preset


def _checkpoint(path, preset):
    torch.save({"model": model_from_preset(preset).state_dict(), "train_conf": {"medflare": describe(preset)}}, path)
    return str(path)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A tiny synthetic site written as NIfTI + datalist: ``(folder, datalist path, its content)``."""
    folder = tmp_path_factory.mktemp("site")
    path = make_seg_site("site-1", folder, image_size=32, num_classes=3, scale=0.2)
    return path.parent, path, json.loads(path.read_text())


@pytest.mark.parametrize("name", ["notes.txt", "notes.npy", "notes.png", "notes.nii.gz"])
def test_evaluate_names_a_datalist_entry_that_is_not_an_image(tmp_path, capsys, site, name):
    folder, _, content = site
    (folder / name).write_text("not an image, just the operator's notes\n")
    bad = dict(content, testing=[{"image": name, "label": content["testing"][0]["label"]}, *content["testing"][1:]])
    datalist = folder / f"bad_{name}.json"
    datalist.write_text(json.dumps(bad))
    ckpt = _checkpoint(tmp_path / "m.pt", "seg_synthetic_tiny")
    assert main(["evaluate", "--model", ckpt, "--datalist", str(datalist), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err and str(folder / name) in err and "cannot read image" in err, err
    assert "allow_pickle" not in err and "Traceback" not in err


def test_evaluate_refuses_a_complex_valued_npz_naming_file_and_key(tmp_path, capsys):
    rng = np.random.default_rng(0)
    images = (rng.random((6, 28, 28)) + 1j * rng.random((6, 28, 28))).astype(np.complex64)
    npz = tmp_path / "site.npz"
    np.savez(npz, test_images=images, test_labels=np.arange(6) % 10)
    ckpt = _checkpoint(tmp_path / "m.pt", "cls_synthetic_tiny")
    with np.testing.suppress_warnings() as sup:
        record = sup.record(np.exceptions.ComplexWarning)
        assert main(["evaluate", "--model", ckpt, "--npz", str(npz), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(npz) in err and "'test_images'" in err and "complex64" in err, err
    assert not record, "the complex images were cast before being refused"


@pytest.mark.parametrize("dtype", ["complex64", "<U4", "datetime64[s]"])
def test_npz_labels_of_a_wrong_dtype_name_the_key(tmp_path, dtype):
    np.savez(tmp_path / "s.npz", val_images=np.zeros((3, 8, 8), np.uint8), val_labels=np.zeros(3).astype(dtype))
    with pytest.raises(DataError, match=r"s\.npz' key 'val_labels' has dtype"):
        load_npz_split(tmp_path / "s.npz", "val")


@pytest.mark.parametrize("what,array", [("nan", np.full((8, 8), np.nan, np.float32)),
                                        ("complex", np.ones((8, 8), np.complex64))])
def test_a_nifti_with_nan_or_complex_values_is_refused(tmp_path, site, what, array):
    folder, _, content = site
    image = tmp_path / f"{what}.nii.gz"
    nib.save(nib.Nifti1Image(array, np.eye(4)), image)
    label = tmp_path / "lbl.nii.gz"
    nib.save(nib.Nifti1Image(np.zeros((8, 8), np.uint8), np.eye(4)), label)
    (tmp_path / "d.json").write_text(json.dumps({"training": [{"image": image.name, "label": label.name}]}))
    with pytest.raises(DataError, match=rf"image '.*{what}\.nii\.gz' (holds NaN|has dtype complex)"):
        load_seg_split(tmp_path / "d.json", "training", num_classes=2)


def test_a_sites_own_datalist_may_point_anywhere_it_likes(tmp_path, site):
    """``..``, absolute paths and symlinks are the site operator's choice: all three load the same case."""
    folder, _, content = site
    first = content["training"][0]
    lists = tmp_path / "lists"
    lists.mkdir()
    os.symlink(folder / first["image"], lists / "linked_img.nii.gz")
    entries = [{"image": os.path.relpath(folder / first["image"], lists), "label": str(folder / first["label"])},
               {"image": "linked_img.nii.gz", "label": os.path.relpath(folder / first["label"], lists)}]
    (lists / "d.json").write_text(json.dumps({"training": entries}))
    ds = load_seg_split(lists / "d.json", "training", num_classes=3)
    assert len(ds) == 2 and torch.equal(ds[0]["image"], ds[1]["image"]) and torch.equal(ds[0]["label"], ds[1]["label"])


@pytest.mark.parametrize("value,message", [
    (".", r"entry 0 of 'training': image file '.*' is not a file"),
    ("/dev/null", r"entry 0 of 'training': image file '/dev/null' is not a file"),
    (7, r"entry 0 of 'training' has 'image' 7; expected a file path"),
    (["a.nii.gz", None], r"entry 0 of 'training' has 'image' \['a.nii.gz', None\]"),
])
def test_a_datalist_entry_that_is_no_file_path_names_split_entry_and_field(tmp_path, site, value, message):
    folder, _, content = site
    path = folder / "hostile.json"
    path.write_text(json.dumps({"training": [{"image": value, "label": content["training"][0]["label"]}]}))
    with pytest.raises(DataError, match=rf"datalist '{path}': {message}"):
        read_datalist(path, "training")


# ---- issue 28: bounded inputs, checked from headers before anything is decoded -----------------------------
def _nifti_bomb(path, side: int = 20000) -> None:
    """A gzipped NIfTI stating (and holding) ``side`` x ``side`` uint8 zeros: 389 KB on disk, 400 MB decompressed."""
    header = nib.Nifti1Header()
    header.set_data_shape((side, side))
    header.set_data_dtype(np.uint8)
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # wbits 31: gzip framing
    chunks, left, zeros = [packer.compress(header.binaryblock + b"\0" * 4)], side * side, bytes(1 << 24)
    while left:
        chunks.append(packer.compress(zeros[: min(left, len(zeros))]))
        left -= min(left, len(zeros))
    path.write_bytes(b"".join(chunks) + packer.flush())


def _one_case(folder, image, label_shape):
    label = folder / "lbl.nii.gz"
    nib.save(nib.Nifti1Image(np.zeros(label_shape, np.uint8), np.eye(4)), label)
    (folder / "d.json").write_text(json.dumps({"training": [{"image": image.name, "label": label.name}]}))
    return folder / "d.json"


def test_a_decompression_bomb_is_refused_from_its_header_in_bounded_memory(tmp_path):
    """A 389 KB .nii.gz of 20000 x 20000 drove a site to 4.5-6.1 GB before anything refused it; the default
    ``data.max_voxels`` (512 x 512 x 1024, which admits a 512 x 512 x 1000 CT) refuses it from the header."""
    bomb = tmp_path / "bomb.nii.gz"
    _nifti_bomb(bomb)
    assert bomb.stat().st_size < 500_000
    datalist = _one_case(tmp_path, bomb, (8, 8))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(DataError) as info:
        load_seg_split(datalist, "training", num_classes=2)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    message = str(info.value)
    assert "\n" not in message and str(bomb) in message and "20000 x 20000" in message and "'data.max_voxels'" in message
    assert grown_mb < 100, f"the refusal grew the process by {grown_mb:.0f} MB"


@pytest.mark.parametrize("suffix,array,limits,key", [
    (".png", np.zeros((64, 64), np.uint8), {"max_voxels": 1000}, "max_voxels"),
    (".nii.gz", np.zeros((64, 64), np.float32), {"max_voxels": 1000}, "max_voxels"),
    (".nii.gz", np.zeros((64, 64), np.float64), {"max_bytes": 4 * 64 * 64}, "max_bytes"),
])
def test_the_presets_size_limits_refuse_an_image_naming_file_and_key(tmp_path, suffix, array, limits, key):
    image = tmp_path / f"big{suffix}"
    if suffix == ".png":
        Image.fromarray(array).save(image)
    else:
        nib.save(nib.Nifti1Image(array, np.eye(4)), image)
    datalist = _one_case(tmp_path, image, (64, 64))
    entries = read_datalist(datalist, "training")
    seg_image_dataset(entries, {}, num_classes=2, cache={"mode": "none", "rate": 0.0, "dir": None})  # the defaults admit it
    with pytest.raises(DataError, match=rf"image '{image}' holds 64 x 64.* above config key 'data.{key}'"):
        seg_image_dataset(entries, limits, num_classes=2, cache={"mode": "none", "rate": 0.0, "dir": None})


def test_an_image_size_beyond_the_voxel_limit_is_a_config_error():
    """A result file's stored ``data.image_size`` 100000 would have every image resized to 10^10 pixels."""
    with pytest.raises(ConfigError, match=r"'data.image_size' asks for 100000 x 100000 .* above config key 'data.max_voxels'"):
        check_image_size({"image_size": 100000})
    assert check_image_size({"image_size": [512, 512]}) == [512, 512]


@pytest.mark.parametrize("preset,args", [
    ("seg_synthetic_tiny", {"in_channels": 1, "out_channels": 3, "channels": [65536] * 3, "strides": [2, 2]}),
    ("cls_synthetic_tiny", {"in_channels": 1, "num_classes": 10, "image_size": 100000, "width": 32}),
])
@pytest.mark.parametrize("command", ["show", "evaluate"])
def test_a_result_files_settings_are_checked_against_its_weights_before_allocating(tmp_path, capsys, site, preset, args, command):
    """Stored settings asking for ``channels [65536]x3`` or ``image_size 100000`` made show/evaluate/predict allocate
    149-154 GB and die with a traceback; the settings are now built on the meta device and matched to the weights."""
    desc = describe(preset)
    desc["model"] = {"name": desc["model"]["name"], "args": args}
    path = tmp_path / "hostile.pt"
    torch.save({"model": model_from_preset(preset).state_dict(), "train_conf": {"medflare": desc}}, path)
    source = ["--datalist", str(site[1])] if preset.startswith("seg") else ["--npz", str(_npz(tmp_path))]
    argv = [command, "--model", str(path), "--device", "cpu"] + (source if command == "evaluate" else [])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert main(argv) == 2
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024 < 200
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and "do not describe its stored weights" in err, err


def _npz(folder):
    path = folder / "cls.npz"
    np.savez(path, test_images=np.zeros((4, 28, 28), np.uint8), test_labels=np.arange(4))
    return path


@pytest.mark.parametrize("command", ["show", "evaluate", "predict"])
def test_nan_weights_in_a_result_file_are_refused(tmp_path, capsys, site, command):
    """A result file whose weights were NaN was evaluated (Dice 0.00, rc 0) and predicted all background, no warning."""
    net = model_from_preset("seg_synthetic_tiny")
    state = net.state_dict()
    next(iter(state.values())).fill_(float("nan"))
    path = tmp_path / "nan.pt"
    torch.save({"model": state, "train_conf": {"medflare": describe("seg_synthetic_tiny")}}, path)
    extra = {"show": [], "evaluate": ["--datalist", str(site[1])],
             "predict": ["--datalist", str(site[1]), "--out", str(tmp_path / "pred")]}[command]
    assert main([command, "--model", str(path), "--device", "cpu", *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and "NaN or Inf" in err, err
    assert not (tmp_path / "pred").exists() or not any((tmp_path / "pred").iterdir())


# ---- issue 28: an image the preset cannot take is named at load; a corrupt cache entry heals ----------------
def test_an_image_of_another_size_in_a_synthetic_site_is_named_at_load(tmp_path, monkeypatch):
    """A 1x1 image in a 32x32 site was accepted at load, then crashed the site every round with "stack expects
    each tensor to be equal size" (no file named)."""
    path = make_seg_site("site-1", tmp_path, image_size=32, num_classes=3, scale=0.2)
    entry = json.loads(path.read_text())["training"][1]
    for field in ("image", "label"):
        nib.save(nib.Nifti1Image(np.ones((1, 1), np.float32 if field == "image" else np.uint8), np.eye(4)),
                 tmp_path / entry[field])
    monkeypatch.setenv("MEDFLARE_DATA", str(tmp_path))
    monkeypatch.setenv("MEDFLARE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(DataError, match=rf"site 'site-1': image '.*{entry['image']}' is 1 x 1, but the preset's images are "
                                        r"32 x 32 \(config key 'data.image_size'"):
        load_site("site-1", get_preset("seg_synthetic_tiny")["data"])


def test_images_of_two_sizes_without_image_size_are_named_at_load(tmp_path, site):
    folder, _, content = site
    odd = tmp_path / "odd.nii.gz"
    nib.save(nib.Nifti1Image(np.ones((16, 16), np.float32), np.eye(4)), odd)
    label = tmp_path / "odd_lbl.nii.gz"
    nib.save(nib.Nifti1Image(np.zeros((16, 16), np.uint8), np.eye(4)), label)
    first = {k: str(folder / v) for k, v in content["training"][0].items()}
    (tmp_path / "d.json").write_text(json.dumps({"training": [first, {"image": str(odd), "label": str(label)}]}))
    with pytest.raises(DataError, match=rf"image '{odd}' is 16 x 16, but the site's first image '.*' is 32 x 32"):
        load_seg_split(tmp_path / "d.json", "training", num_classes=3)


def test_a_truncated_disk_cache_entry_is_logged_deleted_and_recomputed(tmp_path, site, caplog):
    """Truncated files in the preprocessed cache made every site fail with torch's "failed finding central
    directory" (no file named), on every rerun."""
    entries = read_datalist(site[1], "training")[:3]
    cache = {"mode": "disk", "rate": 1.0, "dir": str(tmp_path / "pp")}
    first = seg_image_dataset(entries, {}, num_classes=3, cache=cache)
    files = sorted((tmp_path / "pp").glob("*.pt"))
    assert len(files) == 3
    for f in files:
        f.write_bytes(f.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="medflare.data.loaders"):
        again = seg_image_dataset(entries, {}, num_classes=3, cache=cache)
        items = [again[i] for i in range(len(again))]
    assert all(str(f) in caplog.text for f in files) and "cannot be loaded" in caplog.text
    assert all(torch.equal(a["image"], first[i]["image"]) for i, a in enumerate(items))
    assert all(torch.load(f, weights_only=True) is not None for f in files)  # rewritten whole
