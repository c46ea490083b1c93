"""Property-based tests (hypothesis) of every loader against bad files: whatever a broken or hostile site
stores (truncated or corrupted NIfTI and PNG bytes, .npz archives with wrong dtypes, shapes or missing keys,
datalist JSON with missing or wrongly-typed keys and hostile paths), loading ends in a valid dataset or a
``MedflareError`` whose one-line message names the file (and the key or entry), never in another exception.

Derandomized (the same cases on every run, so CI is reproducible) and small. How many cases each loader
ran, and how many were accepted or refused: ``pytest tests/unit/test_bad_file_properties.py
--hypothesis-show-statistics``.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import pathlib
import warnings

import nibabel as nib
import numpy as np
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from PIL import Image

from medflare import MedflareError
from medflare.data import load_npz_split, load_seg_split
from medflare.data.datalists import read_datalist, site_splits

CASES = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _fresh(tmp_path: pathlib.Path, name: str) -> pathlib.Path:
    """A new empty folder per example (hypothesis reuses the function-scoped ``tmp_path``)."""
    folder = tmp_path / f"{name}_{len(list(tmp_path.iterdir()))}"
    folder.mkdir()
    return folder


def _assert_names(err: MedflareError, *names: str) -> None:
    event(f"refused: {type(err).__name__}")  # --hypothesis-show-statistics counts refused and accepted cases
    text = str(err)
    assert "\n" not in text, f"not one line: {text!r}"
    assert any(n in text for n in names), f"{text!r} names none of {names}"


# ---- corrupted image files --------------------------------------------------------------------
def _nifti_bytes(array: np.ndarray, gz: bool) -> bytes:
    img = nib.Nifti1Image(array, np.eye(4))
    raw = img.to_bytes()  # header + data of a single-file .nii
    return gzip.compress(raw, mtime=0) if gz else raw


def _png_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


@st.composite
def corruptions(draw, data: bytes) -> bytes:
    """``data`` truncated, with bytes overwritten, with random bytes appended or replaced by random bytes."""
    how = draw(st.sampled_from(["truncate", "overwrite", "append", "garbage", "empty"]))
    if how == "truncate":
        return data[: draw(st.integers(0, len(data) - 1))]
    if how == "overwrite":
        out = bytearray(data)
        for _ in range(draw(st.integers(1, 8))):
            at = draw(st.integers(0, len(out) - 1))
            chunk = draw(st.binary(min_size=1, max_size=8))
            out[at:at + len(chunk)] = chunk
        return bytes(out[: len(data)])
    if how == "append":
        return data + draw(st.binary(min_size=1, max_size=64))
    if how == "garbage":
        return draw(st.binary(min_size=1, max_size=512))
    return b""


def _image_and_label(seed: int):
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 255, (12, 10)).astype(np.uint8)
    label = (rng.random((12, 10)) > 0.6).astype(np.uint8)
    return image, label


def _check_seg_dataset(ds, num_classes: int) -> None:
    for i in range(len(ds)):
        item = ds[i]
        assert item["image"].dtype == torch.float32 and item["image"].ndim == 3
        assert bool(torch.isfinite(item["image"]).all())
        assert item["label"].dtype == torch.int64 and item["label"].shape[1:] == item["image"].shape[1:]
        assert int(item["label"].min()) >= 0 and int(item["label"].max()) < num_classes


def _load_corrupt_pair(folder: pathlib.Path, files: dict[str, bytes], suffix: str) -> None:
    """Write ``image``/``label`` bytes as one training case and load it; valid dataset or MedflareError naming the file."""
    for role, data in files.items():
        (folder / f"{role}{suffix}").write_bytes(data)
    datalist = folder / "site.json"
    datalist.write_text(json.dumps({"training": [{"image": f"image{suffix}", "label": f"label{suffix}"}]}))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ds = load_seg_split(datalist, "training", num_classes=2)
    except MedflareError as err:
        _assert_names(err, f"image{suffix}", f"label{suffix}")
    else:
        event("accepted")
        _check_seg_dataset(ds, 2)


@CASES
@given(seed=st.integers(0, 1000), gz=st.booleans(), which=st.sampled_from(["image", "label"]), data=st.data())
def test_corrupt_nifti_is_a_valid_case_or_an_error_naming_the_file(tmp_path, seed, gz, which, data):
    image, label = _image_and_label(seed)
    files = {"image": _nifti_bytes(image.astype(np.float32), gz), "label": _nifti_bytes(label, gz)}
    files[which] = data.draw(corruptions(files[which]), label="corrupted " + which)
    _load_corrupt_pair(_fresh(tmp_path, "nii"), files, ".nii.gz" if gz else ".nii")


@CASES
@given(seed=st.integers(0, 1000), which=st.sampled_from(["image", "label"]), data=st.data())
def test_corrupt_png_is_a_valid_case_or_an_error_naming_the_file(tmp_path, seed, which, data):
    image, label = _image_and_label(seed)
    files = {"image": _png_bytes(image), "label": _png_bytes(label)}
    files[which] = data.draw(corruptions(files[which]), label="corrupted " + which)
    _load_corrupt_pair(_fresh(tmp_path, "png"), files, ".png")


# ---- .npz with wrong dtypes, shapes and keys --------------------------------------------------
DTYPES = ["uint8", "int8", "int16", "uint16", "int64", "uint64", "float16", "float32", "float64", "bool",
          "complex64", "complex128", "<U3", "S2", "object", "datetime64[s]", "timedelta64[ms]", "V4"]


@st.composite
def npz_arrays(draw):
    """A random array: any of :data:`DTYPES`, 0-5 dimensions of size 0-6, values from a random range."""
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=5)))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    values = rng.normal(0, draw(st.sampled_from([1.0, 1e3, 1e30])), size=shape)
    if draw(st.booleans()) and values.size:
        values.flat[0] = draw(st.sampled_from([np.nan, np.inf, -np.inf, -1.0, 1e20]))
    if dtype.kind in "US":
        return values.astype(str).astype(dtype)
    if dtype.kind == "O":
        return np.array(values.tolist() if values.ndim else [values.tolist()], dtype=object)
    if dtype.kind == "V":
        return np.zeros(shape, dtype)
    if dtype.kind == "c":
        return (values + 1j * values).astype(dtype)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return np.abs(values).astype(dtype) if draw(st.booleans()) else values.astype(dtype)


@st.composite
def npz_pairs(draw):
    """(images, labels): a third of the time shaped like a MedMNIST split (any dtype), else two random arrays."""
    if draw(st.booleans()):
        return draw(npz_arrays()), draw(npz_arrays())
    n, side = draw(st.integers(1, 5)), draw(st.integers(5, 9))
    shape = draw(st.sampled_from([(n, side, side), (n, side, side, 3), (n, 1, side, side)]))
    images = draw(npz_arrays()).flat  # values and dtype of a random array, put into a plausible shape
    base = np.resize(np.asarray(images[:]), shape) if len(images) else np.zeros(shape, draw(st.sampled_from(["uint8", "float32", "complex64", "<U3"])))
    labels = np.arange(n) % draw(st.sampled_from([2, 2, 12]))
    labels = labels.astype(draw(st.sampled_from(["uint8", "int64", "float32", "bool", "complex64", "<U2"])))
    return base, labels[:, None] if draw(st.booleans()) else labels


@CASES
@given(pair=npz_pairs(), drop=st.sampled_from([None, None, None, "val_images", "val_labels"]),
       num_classes=st.sampled_from([None, 2, 10]), corrupt=st.integers(0, 3).map(lambda i: i == 0), data=st.data())
def test_any_npz_is_a_valid_split_or_an_error_naming_the_file_and_key(tmp_path, pair, drop, num_classes, corrupt, data):
    images, labels = pair
    folder = _fresh(tmp_path, "npz")
    path = folder / "site.npz"
    arrays = {"val_images": images, "val_labels": labels}
    arrays.pop(drop, None)
    np.savez(path, **arrays)
    if corrupt:
        path.write_bytes(data.draw(corruptions(path.read_bytes()), label="corrupted npz"))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", np.exceptions.ComplexWarning)  # a silent cast would be a failure
            ds = load_npz_split(path, "val", num_classes=num_classes)
    except MedflareError as err:
        _assert_names(err, str(path))
        if not corrupt:  # a readable archive: the message names the key at fault
            assert "'val_images'" in str(err) or "'val_labels'" in str(err), str(err)
    else:
        event("accepted")
        assert images.dtype.kind in "uifb" and labels.dtype.kind in "uifb", f"{images.dtype}/{labels.dtype} was accepted"
        assert len(ds) == len(images) > 0
        assert ds.images.dtype == torch.float32 and ds.images.ndim == 4
        assert bool(torch.isfinite(ds.images).all()) and float(ds.images.min()) >= 0 and float(ds.images.max()) <= 1
        assert ds.labels.dtype == torch.int64 and int(ds.labels.min()) >= 0
        if num_classes is not None:
            assert int(ds.labels.max()) < num_classes


# ---- datalist JSON: missing keys, wrong types, hostile paths ----------------------------------
def _store(folder: pathlib.Path) -> dict[str, str]:
    """Files and links a datalist in ``folder/lists`` may name: valid pairs inside, outside (``..``), absolute, via symlinks."""
    lists, outside = folder / "lists", folder / "elsewhere"
    lists.mkdir()
    outside.mkdir()
    image, label = _image_and_label(0)
    for where in (lists, outside):
        Image.fromarray(image).save(where / "img.png")
        Image.fromarray(label).save(where / "lbl.png")
    os.symlink(outside / "img.png", lists / "link_img.png")
    os.symlink(outside / "lbl.png", lists / "link_lbl.png")
    os.symlink(outside, lists / "link_dir")
    os.symlink(lists / "missing.png", lists / "dangling.png")
    return {
        "img": "img.png", "lbl": "lbl.png",
        "up_img": "../elsewhere/img.png", "up_lbl": "../elsewhere/lbl.png",
        "abs_img": str(outside / "img.png"), "abs_lbl": str(outside / "lbl.png"),
        "link_img": "link_img.png", "link_lbl": "link_lbl.png", "link_dir_img": "link_dir/img.png",
    }


HOSTILE_STRINGS = ["missing.png", "dangling.png", "link_dir", "/", ".", "..", "../../../../etc/passwd", "/etc/passwd",
                   "/dev/null", "", "   ", "a\x00b", "x" * 300, "lists.json"]


def _value(draw, names: dict[str, str], good: bool, role: str = "image"):
    """An ``image``/``label`` value: a good path (to a file of that ``role``), a hostile string, a list, or a value
    of a wrong type (mostly a good path when ``good``, so that whole datalists are accepted often enough to check
    what loads)."""
    kind = "good" if good else draw(st.sampled_from(["good", "good", "hostile", "list", "wrong_type"]))
    if kind == "good":
        suffix = "img" if role == "image" else "lbl"
        return names[draw(st.sampled_from(sorted(n for n in names if n.endswith(suffix))))]
    if kind == "hostile":
        return draw(st.sampled_from(HOSTILE_STRINGS))
    if kind == "list":
        return draw(st.lists(st.sampled_from([names["img"], names["up_img"], "missing.png", 3]), max_size=3))
    return draw(st.sampled_from([None, 0, 1.5, True, {"path": "img.png"}, [[]]]))


@st.composite
def datalists(draw, names: dict[str, str]):
    """A datalist document: splits present, missing or of a wrong type; entries with missing, extra or bad keys."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.sampled_from([[], "training", 3, None, [{"image": "img.png"}]]))
    doc, good = {}, draw(st.booleans())  # good: every value a path to a file of its role (the paths may be hostile)
    for split in ("training", "validation", "testing", "test"):
        shape = draw(st.sampled_from(["list"] if good and split == "training" else ["list", "absent"] if good else
                                     ["list", "list", "list", "absent", "empty", "wrong"]))
        if shape == "absent":
            continue
        if shape == "empty":
            doc[split] = []
        elif shape == "wrong":
            doc[split] = draw(st.sampled_from([{"image": "img.png"}, "img.png", 7, None]))
        else:
            entries = []
            for _ in range(draw(st.integers(1, 4))):
                form = draw(st.sampled_from(["pair"] * 8 + ["extra"] if good else
                                            ["pair", "pair", "pair", "no_label", "no_image", "string", "extra", "junk"]))
                if form == "string":
                    entries.append(_value(draw, names, good))
                elif form == "junk":
                    entries.append(draw(st.sampled_from([None, 5, [], ["img.png", "lbl.png"]])))
                else:
                    entry = {"image": _value(draw, names, good), "label": _value(draw, names, good, "label")}
                    if form == "no_label":
                        entry.pop("label")
                    elif form == "no_image":
                        entry.pop("image")
                    elif form == "extra":
                        entry["notes"] = "x"
                    entries.append(entry)
            doc[split] = entries
    return doc


@CASES
@given(data=st.data(), labeled=st.booleans(),
       raw=st.sampled_from(["json"] * 4 + ["not_json", "utf16_bom", "latin1"]))
def test_any_datalist_is_valid_entries_or_an_error_naming_the_file_and_entry(tmp_path, data, labeled, raw):
    folder = _fresh(tmp_path, "dl")
    names = _store(folder)
    doc = data.draw(datalists(names), label="datalist")
    path = folder / "lists" / "lists.json"
    text = json.dumps(doc)
    path.write_bytes({"json": text.encode(), "not_json": text.encode()[:-1] + b"\xff",
                      "utf16_bom": text.encode("utf-16"), "latin1": (text[:-1] + " \u00e9" + text[-1:]).encode("latin-1")}[raw])
    for split in ("training", "testing"):
        try:
            entries = read_datalist(path, split, labeled=labeled)
        except MedflareError as err:
            _assert_names(err, str(path))
            continue
        for entry in entries:  # every path the loader accepted is a regular file
            for value in (entry["image"] if isinstance(entry["image"], list) else [entry["image"]]):
                assert os.path.isfile(value)
            assert not labeled or os.path.isfile(entry["label"])
    try:
        splits = site_splits(path, val_fraction=0.2, test_fraction=0.2)
    except MedflareError as err:
        _assert_names(err, str(path))
        return
    try:  # the accepted entries load end to end (every good path names the same valid pair)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ds = load_seg_split(path, "training", num_classes=2)
    except MedflareError as err:
        _assert_names(err, str(path), "img.png", "lbl.png")
    else:
        event("accepted")
        _check_seg_dataset(ds, 2)
    assert all(len(v) >= 1 for v in splits.values())
