"""Decathlon-style datalists: reading them (MSD ``dataset.json`` as published included), splitting, writing one for a folder.

A datalist is a JSON file with lists of ``{"image": path | [paths], "label": path}`` entries under
``training``, ``validation`` and ``testing``; paths are relative to the file. A Medical Segmentation
Decathlon ``dataset.json`` has only ``training`` and an unlabeled ``test`` list of image paths: such a
file loads too; :func:`site_splits` then carves validation and testing cases out of ``training``
(seeded), and the unlabeled ``test`` images are what ``medflare predict --split test`` reads.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from typing import Any, Mapping

from monai.data import partition_dataset

from medflare import DataError
from medflare.data.transforms import NIFTI_SUFFIXES, PIL_SUFFIXES, describe_files

SEG_SPLITS = ("training", "validation", "testing")
#: split names accepted everywhere, mapped to (datalist key, npz prefix)
SPLIT_ALIASES = {
    "training": ("training", "train"), "train": ("training", "train"),
    "validation": ("validation", "val"), "val": ("validation", "val"),
    "testing": ("testing", "test"), "test": ("testing", "test"),
}
#: an MSD dataset.json names its unlabeled test images so
MSD_TEST_KEY = "test"


def split_keys(split: str) -> tuple[str, str]:
    """(datalist key, npz prefix) for ``split``; accepts both spellings (train/training, ...)."""
    if split not in SPLIT_ALIASES:
        raise DataError(f"unknown split '{split}' (known: {sorted(SPLIT_ALIASES)})")
    return SPLIT_ALIASES[split]


def _read_json(datalist: pathlib.Path) -> dict:
    try:
        content = json.loads(datalist.read_bytes())
    except OSError as exc:
        raise DataError(f"cannot read datalist '{datalist}': {exc}") from exc
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bytes that are not UTF-8/16/32, absurd nesting
        raise DataError(f"datalist '{datalist}' is not valid JSON: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc
    if not isinstance(content, dict):
        raise DataError(f"datalist '{datalist}' holds a {type(content).__name__}, expected an object with 'training', ...")
    return content


def _is_path(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip()) and "\x00" not in value


def _check_field(datalist: pathlib.Path, key: str, i: int, field: str, value: Any, multi: bool) -> None:
    """A datalist entry's ``image`` (a path, or with ``multi`` a non-empty list of channel paths) or ``label`` (a path)."""
    if _is_path(value) or (multi and isinstance(value, list) and value and all(_is_path(v) for v in value)):
        return
    expected = "a file path or a list of file paths (one per channel)" if multi else "a file path"
    raise DataError(f"datalist '{datalist}': entry {i} of '{key}' has '{field}' {value!r:.80}; expected {expected}")


def _absolute(base: pathlib.Path, entry: Mapping[str, Any]) -> dict[str, Any]:
    """``entry`` with its image and label paths joined to ``base`` (as MONAI's ``load_decathlon_datalist`` does, on
    the content already read and checked here: the file is not read a second time)."""
    out = dict(entry)
    for field in ("image", "label"):
        value = out.get(field)
        if value is not None:
            out[field] = ([os.path.normpath(base / v) for v in value] if isinstance(value, list)
                          else os.path.normpath(base / value))
    return out


def _entries(datalist: pathlib.Path, content: dict, key: str, labeled: bool) -> list[dict[str, Any]]:
    """The checked entries of ``content[key]`` with absolute paths (see :func:`read_datalist` for the rules)."""
    raw = content[key]
    if not isinstance(raw, list):
        raise DataError(f"datalist '{datalist}': split '{key}' holds a {type(raw).__name__}, expected a list of entries")
    if not raw:
        raise DataError(f"datalist '{datalist}': split '{key}' is empty")
    for i, entry in enumerate(raw):
        if isinstance(entry, str) and not labeled:
            _check_field(datalist, key, i, "image", entry, multi=False)
            continue
        if not isinstance(entry, dict) or entry.get("image") is None:
            raise DataError(f"datalist '{datalist}': entry {i} of '{key}' needs 'image' and 'label' keys, got {entry!r:.80}")
        _check_field(datalist, key, i, "image", entry["image"], multi=True)
        if entry.get("label") is not None:
            _check_field(datalist, key, i, "label", entry["label"], multi=False)
        elif labeled:
            raise DataError(
                f"datalist '{datalist}': entry {i} of '{key}' ({describe_files(entry['image'])}) has no label; "
                "this use needs labeled cases (MSD's unlabeled 'test' images are for predict)"
            )
    entries = [_absolute(datalist.parent, {"image": e} if isinstance(e, str) else e) for e in raw]
    for i, entry in enumerate(entries):
        for field in ("image", "label"):
            value = entry.get(field)
            for path in (value if isinstance(value, (list, tuple)) else [value] if value is not None else []):
                if not os.path.isfile(path):  # follows symlinks; a folder, device or FIFO is no image file
                    what = "is not a file" if os.path.exists(path) else "does not exist"
                    raise DataError(f"datalist '{datalist}': entry {i} of '{key}': {field} file '{path}' {what}")
    return entries


def read_datalist(datalist: str | os.PathLike, split: str, labeled: bool = True) -> list[dict[str, Any]]:
    """The entries of ``split`` in a datalist, with absolute paths; checks the entries' types and that the files exist.

    With ``labeled=False`` (prediction) entries may lack labels, and the ``testing`` split of an MSD
    ``dataset.json`` is its unlabeled ``test`` list. Any malformed entry is a DataError naming the
    datalist, the split, the entry's index and the field.

    Where the files may be: a datalist belongs to the site (its operator writes it, or points
    ``MEDFLARE_DATA`` / ``local/medflare_data.json`` at it; a job never names one), so its paths are
    trusted as the operator wrote them: relative paths are relative to the datalist's folder and may
    climb out of it with ``..``, absolute paths into a hospital's image store are normal, and symlinks are
    followed. Only regular files are read (a folder, device or FIFO is refused). What a *job* may name on
    a site is confined separately (:func:`medflare.data.site.confine_job_paths`).
    """
    datalist = pathlib.Path(datalist)
    key, _ = split_keys(split)
    content = _read_json(datalist)
    if key not in content and key == "testing" and not labeled and MSD_TEST_KEY in content:
        key = MSD_TEST_KEY
    if key not in content:
        hint = " (an MSD dataset.json: its unlabeled 'test' images are read by predict)" if MSD_TEST_KEY in content else ""
        raise DataError(f"datalist '{datalist}' has no '{key}' key (a list of {{image, label}} entries){hint}")
    return _entries(datalist, content, key, labeled)


def site_splits(datalist: str | os.PathLike, *, val_fraction: float = 0.2, test_fraction: float = 0.2,
                seed: int = 0) -> dict[str, list[dict[str, Any]]]:
    """Labeled training/validation/testing entries of a site's datalist.

    Splits the datalist names are used as they are. A split it lacks (an MSD ``dataset.json`` has
    only ``training``) is carved out of ``training`` (``val_fraction`` / ``test_fraction`` of its
    cases, shuffled with ``seed``, at least one case each), so every site gets all three.
    """
    datalist = pathlib.Path(datalist)
    content = _read_json(datalist)
    if "training" not in content:
        raise DataError(f"datalist '{datalist}' has no 'training' key (a list of {{image, label}} entries)")
    out = {"training": _entries(datalist, content, "training", labeled=True)}
    missing = [k for k in ("validation", "testing") if k not in content]
    for key in ("validation", "testing"):
        if key not in missing:
            out[key] = _entries(datalist, content, key, labeled=True)
    if missing:
        fractions = {"validation": val_fraction, "testing": test_fraction}
        n = len(out["training"])
        counts = {k: max(1, round(n * fractions[k])) for k in missing}
        if n - sum(counts.values()) < 1:
            raise DataError(
                f"datalist '{datalist}' has {n} training case(s) and no {' or '.join(repr(k) for k in missing)} "
                f"split; at least {sum(counts.values()) + 1} are needed to carve them out"
            )
        sizes = [n - sum(counts.values())] + [counts[k] for k in missing]
        parts = partition_dataset(out["training"], ratios=sizes, shuffle=True, seed=seed)
        out["training"] = parts[0]
        out.update(zip(missing, parts[1:]))
    return out


# ---- a datalist for a folder of image/label pairs ----------------------------------------------
IMAGE_DIRS = ("imagesTr", "images", "image", "imgs", "img")
LABEL_DIRS = ("labelsTr", "labels", "label", "masks", "mask", "annotations", "segmentations", "seg", "gt", "ground_truth")
UNLABELED_DIRS = ("imagesTs",)
#: a label file's stem ends with one of these (BraTS "_seg", fundus "_mask", ...); case-insensitive
LABEL_SUFFIXES = ("_seg", "_segmentation", "_label", "_labels", "_mask", "_gt", "-seg", "-mask", "-label")
#: nnU-Net / MSD channel suffix of an image file: case_0000.nii.gz, case_0001.nii.gz
_CHANNEL = re.compile(r"_(\d{4})$")


def _stem(name: str) -> str:
    low = name.lower()
    for suffix in (*NIFTI_SUFFIXES, *PIL_SUFFIXES):
        if low.endswith(suffix):
            return name[: -len(suffix)]
    return pathlib.Path(name).stem


def _images(folder: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")
                  and p.name.lower().endswith((*NIFTI_SUFFIXES, *PIL_SUFFIXES)))


def _label_case(stem: str) -> str | None:
    low = stem.lower()
    for suffix in LABEL_SUFFIXES:
        if low.endswith(suffix):
            return stem[: -len(suffix)]
    return None


def _case(stem: str) -> str:
    """The case an image file belongs to: its stem without a modality/channel suffix (``_0000``)."""
    return _CHANNEL.sub("", stem)


def _group(files: list[pathlib.Path]) -> dict[str, list[pathlib.Path]]:
    cases: dict[str, list[pathlib.Path]] = {}
    for f in files:
        cases.setdefault(_case(_stem(f.name)), []).append(f)
    return cases


def _pairs_in_folders(image_dir: pathlib.Path, label_dir: pathlib.Path) -> tuple[list[tuple], list[str]]:
    labels = {}
    for f in _images(label_dir):
        stem = _stem(f.name)
        labels[_label_case(stem) or stem] = f
    pairs, unmatched = [], []
    for case, files in sorted(_group(_images(image_dir)).items()):
        if case in labels:
            pairs.append((files, labels[case]))
        else:
            unmatched.append(case)
    return pairs, unmatched


def _pairs_in_one_folder(folder: pathlib.Path) -> tuple[list[tuple], list[str]]:
    files = _images(folder)
    labels = {c: f for f in files if (c := _label_case(_stem(f.name))) is not None}
    images = [f for f in files if _label_case(_stem(f.name)) is None]
    if len(labels) == 1 and len(images) > 1 and not any(_case(_stem(f.name)) in labels for f in images):
        # one case per folder (BraTS): every other file is a modality of that case, e.g. _t1, _t2, _flair
        return [(images, next(iter(labels.values())))], []
    pairs, unmatched = [], []
    for case, group in sorted(_group(images).items()):
        if case in labels:
            pairs.append((group, labels[case]))
        else:
            unmatched.append(case)
    return pairs, unmatched


def _find_dir(folder: pathlib.Path, names: tuple[str, ...]) -> pathlib.Path | None:
    by_lower = {p.name.lower(): p for p in folder.iterdir() if p.is_dir()}
    for name in names:
        if name.lower() in by_lower:
            return by_lower[name.lower()]
    return None


def datalist_from_folder(folder: str | os.PathLike, out: str | os.PathLike, *, val_fraction: float = 0.2,
                         test_fraction: float = 0.2, seed: int = 0) -> dict[str, Any]:
    """Pair images with labels in ``folder`` and return a datalist (paths relative to ``out``'s folder).

    Layouts recognised, in this order:
      * an image folder and a label folder (``imagesTr``/``labelsTr`` as in MSD and nnU-Net, or
        ``images``/``masks``, ``labels``, ``annotations``, ...): files pair by name, a label may carry a
        suffix such as ``_mask`` or ``_seg``, an image a channel suffix ``_0000`` (several channels of a
        case become a list); ``imagesTs`` becomes unlabeled ``test`` images;
      * one folder per case (BraTS): the file ending ``_seg`` (``_label``, ``_mask``) is the label and the
        other files, sorted by name, the image channels;
      * one flat folder: ``X.ext`` pairs with ``X_seg.ext`` (``_label``, ``_mask``, ...).
    Cases are split into training/validation/testing (seeded). A folder where nothing pairs is a DataError.
    """
    folder, out = pathlib.Path(folder), pathlib.Path(out)
    if not folder.is_dir():
        raise DataError(f"'{folder}' is not a folder")
    image_dir, label_dir = _find_dir(folder, IMAGE_DIRS), _find_dir(folder, LABEL_DIRS)
    unlabeled: list[list[pathlib.Path]] = []
    if image_dir is not None and label_dir is not None:
        pairs, unmatched = _pairs_in_folders(image_dir, label_dir)
        layout = f"images in '{image_dir.name}/', labels in '{label_dir.name}/'"
        test_dir = _find_dir(folder, UNLABELED_DIRS)
        if test_dir is not None:
            unlabeled = [files for _, files in sorted(_group(_images(test_dir)).items())]
    else:
        subdirs = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
        pairs, unmatched = [], []
        for sub in subdirs:
            p, u = _pairs_in_one_folder(sub)
            pairs += p
            unmatched += [f"{sub.name}/{c}" for c in u]
        layout = "one folder per case"
        if not pairs:
            pairs, unmatched = _pairs_in_one_folder(folder)
            layout = "image/label pairs in one folder"
    if not pairs:
        raise DataError(
            f"'{folder}': found no image/label pairs (looked for {IMAGE_DIRS[0]}/{LABEL_DIRS[0]} or images/masks "
            f"folders, one folder per case, or files named X and X{LABEL_SUFFIXES[0]}/X{LABEL_SUFFIXES[4]})"
        )
    base = out.resolve().parent

    def rel(paths: list[pathlib.Path]) -> str | list[str]:
        names = [os.path.relpath(p.resolve(), base) for p in sorted(paths)]
        return names[0] if len(names) == 1 else names

    entries = [{"image": rel(files), "label": rel([label])} for files, label in pairs]
    n = len(entries)
    n_val, n_test = round(n * val_fraction), round(n * test_fraction)
    if n - n_val - n_test < 1:
        raise DataError(f"'{folder}': {n} labeled case(s) are too few for validation and testing fractions "
                        f"{val_fraction} and {test_fraction}")
    sizes = [n - n_val - n_test, n_val, n_test]
    parts = partition_dataset(entries, ratios=sizes, shuffle=True, seed=seed)
    content: dict[str, Any] = {
        "description": f"written by 'medflare data --from-folder {folder}' ({layout}; {n} labeled cases, seed {seed})",
    }
    # an empty split is left out: loading then carves it out of training, or says there are too few cases
    content.update({key: part for key, part in zip(SEG_SPLITS, parts) if part})
    if unlabeled:
        content[MSD_TEST_KEY] = [rel(files) for files in unlabeled]
    if unmatched:
        content["unmatched"] = unmatched  # images without a label: listed for the operator, never loaded
    return content
