"""Property-based tests (hypothesis) of the MedMNIST-layout .npz loader, the classification loader every job
shares: for any layout, size, dtype and value range a site might store, the items are (C, H, W) float32 in
[0, 1] with the labels unchanged and the images' relative brightness kept; labels outside the classes are a
DataError naming the file."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from medflare import DataError
from medflare.data.loaders import load_npz_split

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
