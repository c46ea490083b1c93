"""Property-based tests (hypothesis) of the loaders on VALID files: whatever valid file a site stores, it is accepted
and its values come through.

- the MedMNIST-layout .npz loader, the classification loader every job shares: for any layout, size, dtype and value
  range a site might store, the items are (C, H, W) float32 in [0, 1] with the labels unchanged and the images'
  relative brightness kept; labels outside the classes are a DataError naming the file;
- the datalist + 2D image loader of the segmentation jobs: any valid datalist (splits, entries, relative or absolute
  paths inside the site's folder) of NIfTI (.nii / .nii.gz, any numeric dtype and range) or PNG image / label pairs is
  read entry by entry in order, and every item is the stored image min-max scaled to [0, 1] (1, H, W) with the stored
  label map unchanged.

tests/unit/test_bad_file_properties.py covers the other side (broken or hostile files: a valid dataset or an error)."""

from __future__ import annotations

import json
import warnings

import nibabel as nib
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from medflare import DataError
from medflare.data.datalists import read_datalist
from medflare.data.loaders import load_npz_split, load_seg_split

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])


@st.composite
def stored_images(draw):
    """(array as stored, channels-first float copy of its values, channels) for a random MedMNIST-like split."""
    n = draw(st.integers(1, 6))
    h, w = draw(st.integers(5, 12)), draw(st.integers(5, 12))  # sides outside (1, 3, 4): the layout is unambiguous
    channels = draw(st.sampled_from([1, 3]))
    layout = draw(st.sampled_from(["NHW", "NHWC", "NCHW"] if channels == 1 else ["NHWC", "NCHW"]))
    dtype = draw(st.sampled_from(["uint8", "float32"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    if dtype == "uint8":
        chw = rng.integers(0, 256, size=(n, channels, h, w)).astype(np.uint8)
    else:
        lo, span = draw(st.sampled_from([(0.0, 1.0), (-1000.0, 5000.0), (0.2, 0.5)])) if draw(st.booleans()) else (
            draw(st.floats(-1000, 1000, allow_nan=False)), draw(st.floats(0.5, 5000, allow_nan=False)))
        chw = (lo + span * rng.random((n, channels, h, w))).astype(np.float32)
    stored = {"NHW": chw[:, 0], "NHWC": chw.transpose(0, 2, 3, 1), "NCHW": chw}[layout]
    return stored, chw.astype(np.float64), channels


@SETTINGS
@given(data=stored_images(), num_classes=st.integers(2, 10), column=st.booleans(), seed=st.integers(0, 1000))
def test_any_stored_layout_loads_as_chw_in_unit_range_with_labels_and_order_kept(tmp_path, data, num_classes, column, seed):
    stored, chw, channels = data
    n = len(stored)
    labels = np.random.default_rng(seed).integers(0, num_classes, size=n)
    path = tmp_path / "site.npz"
    np.savez(path, train_images=stored, train_labels=labels[:, None] if column else labels)
    ds = load_npz_split(path, "train", num_classes=num_classes)
    assert len(ds) == n
    images = np.stack([ds[i]["image"].numpy() for i in range(n)])
    assert images.dtype == np.float32 and images.shape == chw.shape
    assert images.min() >= 0.0 and images.max() <= 1.0
    assert [int(ds[i]["label"]) for i in range(n)] == labels.tolist()
    if stored.dtype == np.uint8:
        np.testing.assert_allclose(images * 255.0, chw, atol=1e-3)
    elif chw.min() >= 0.0 and chw.max() <= 1.0:  # float data already in [0, 1] is kept as stored
        np.testing.assert_allclose(images, chw, atol=1e-6)
    else:  # one affine map for the whole array: every pair of pixels keeps its order, across images too
        flat_in, flat_out = chw.reshape(-1), images.reshape(-1).astype(np.float64)
        order = np.argsort(flat_in, kind="stable")
        assert np.all(np.diff(flat_out[order]) >= -1e-6)
        if flat_in.max() > flat_in.min():
            assert flat_out.max() == pytest.approx(1.0, abs=1e-6) and flat_out.min() == pytest.approx(0.0, abs=1e-6)


@SETTINGS
@given(num_classes=st.integers(2, 10), offset=st.integers(0, 5), negative=st.booleans())
def test_labels_outside_the_classes_are_a_data_error_naming_the_file(tmp_path, num_classes, offset, negative):
    labels = np.zeros(4, dtype=np.int64)
    labels[2] = -1 - offset if negative else num_classes + offset
    path = tmp_path / "bad_site.npz"
    np.savez(path, val_images=np.zeros((4, 8, 8), np.uint8), val_labels=labels)
    with pytest.raises(DataError, match="bad_site.npz"):
        load_npz_split(path, "validation", num_classes=num_classes)


# ---- datalists of 2D NIfTI / PNG segmentation pairs ------------------------------------------------
NIFTI_DTYPES = ["uint8", "int16", "uint16", "int32", "float32", "float64"]


@st.composite
def segmentation_sites(draw):
    """A valid site: {split: [(image array, label array, format), ...]} of one image size, and num_classes."""
    h, w = draw(st.integers(4, 16)), draw(st.integers(4, 16))
    num_classes = draw(st.integers(2, 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    splits = {}
    for split in ["training"] + [s for s in ("validation", "testing") if draw(st.booleans())]:
        cases = []
        for _ in range(draw(st.integers(1, 3))):
            fmt = draw(st.sampled_from(["png", "nii", "nii.gz"]))
            dtype = "uint8" if fmt == "png" else draw(st.sampled_from(NIFTI_DTYPES))
            info = np.iinfo(dtype) if np.dtype(dtype).kind in "iu" else None
            lo, hi = (info.min, info.max) if info is not None and info.bits <= 16 else (-3000.0, 3000.0)
            lo = max(lo, -3000) if info is None or info.min < 0 else 0
            image = rng.uniform(lo, min(hi, 3000), (h, w))
            image.flat[:2] = lo, min(hi, 3000)  # not constant: the min-max scaling is defined
            label = rng.integers(0, num_classes, (h, w))
            cases.append((image.astype(dtype), label.astype(np.uint8 if fmt == "png" else draw(st.sampled_from(["uint8", "int16", "int64"]))), fmt))
        splits[split] = cases
    return splits, num_classes


def _write_case(folder, stem, image, label, fmt, absolute):
    names = []
    for role, array in (("image", image), ("label", label)):
        path = folder / f"{stem}_{role}.{fmt}"
        if fmt == "png":
            Image.fromarray(array).save(path)
        else:
            nib.save(nib.Nifti1Image(array, np.eye(4), dtype=array.dtype), path)
        names.append(str(path) if absolute else path.name)
    return {"image": names[0], "label": names[1]}


@SETTINGS
@given(site=segmentation_sites(), absolute=st.booleans(), n=st.integers(0, 10**6))
def test_any_valid_datalist_of_2d_pairs_is_accepted_with_its_values(tmp_path, site, absolute, n):
    splits, num_classes = site
    folder = tmp_path / f"site_{n}_{len(list(tmp_path.iterdir()))}"  # hypothesis reuses tmp_path: a fresh folder per example
    folder.mkdir()
    doc = {split: [_write_case(folder, f"{split}_{i}", *case, absolute) for i, case in enumerate(cases)] for split, cases in splits.items()}
    datalist = folder / "site.json"
    datalist.write_text(json.dumps(doc))
    for split, cases in splits.items():
        entries = read_datalist(datalist, split)
        assert [str(e["image"]) for e in entries] == [str(folder / ((folder / d["image"]).name)) for d in doc[split]]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ds = load_seg_split(datalist, split, num_classes=num_classes)
        assert len(ds) == len(cases)
        for i, (image, label, fmt) in enumerate(cases):
            item = ds[i]
            assert item["image"].dtype == torch.float32 and tuple(item["image"].shape) == (1, *image.shape), (fmt, item["image"].shape)
            stored = image.astype(np.float64)
            np.testing.assert_allclose(item["image"][0].numpy(), (stored - stored.min()) / (stored.max() - stored.min()), atol=1e-5)
            assert item["label"].dtype == torch.int64 and np.array_equal(item["label"][0].numpy(), label.astype(np.int64)), fmt
