"""The bad files measured in issue 17, each refused with one line naming the file and the key or entry: a text file
listed as an image, a complex-valued .npz, NaN or complex NIfTI; and the rule for where a site's own datalist may
point (anywhere the operator wrote: ``..``, absolute paths, symlinks; but only to regular files)."""

from __future__ import annotations

import json
import os

import nibabel as nib
import numpy as np
import pytest
import torch

from medflare import DataError
from medflare.cli import main
from medflare.common.persistence import model_from_preset
from medflare.common.results import describe
from medflare.data import load_npz_split, load_seg_split, make_seg_site
from medflare.data.datalists import read_datalist


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
