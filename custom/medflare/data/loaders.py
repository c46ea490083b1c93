"""Loaders for a site's data: a Decathlon-style datalist of NIfTI/PNG files, or a MedMNIST-layout .npz.

Both return map-style datasets whose items are plain-tensor dicts that a default DataLoader batches:
``{"image": float32 (C, H, W) in [0, 1], "label": ..., "name": str}``; the label is int64 (1, H, W) for
segmentation and an int64 scalar for classification. Bad inputs raise MedflareError naming the file.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
from typing import Any, Iterator, Mapping

import numpy as np
import torch
from monai.data import CacheDataset, Dataset, load_decathlon_datalist
from monai.data.image_reader import PILReader
from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, ScaleIntensityd, Transform
from torch.utils.data import Dataset as TorchDataset

from medflare import DataError, MedflareError

SEG_SPLITS = ("training", "validation", "testing")
NPZ_SPLITS = ("train", "val", "test")
#: split names accepted by both loaders, mapped to (datalist key, npz prefix)
_SPLIT_ALIASES = {
    "training": ("training", "train"), "train": ("training", "train"),
    "validation": ("validation", "val"), "val": ("validation", "val"),
    "testing": ("testing", "test"), "test": ("testing", "test"),
}


def _split_keys(split: str) -> tuple[str, str]:
    """(datalist key, npz prefix) for ``split``; accepts both spellings (train/training, ...)."""
    if split not in _SPLIT_ALIASES:
        raise DataError(f"unknown split '{split}' (known: {sorted(_SPLIT_ALIASES)})")
    return _SPLIT_ALIASES[split]


@contextlib.contextmanager
def _medflare_errors() -> Iterator[None]:
    """Re-raise a MedflareError that MONAI's ``apply_transform`` wrapped in a RuntimeError, unwrapped."""
    try:
        yield
    except MedflareError:
        raise
    except Exception as exc:  # noqa: BLE001 - only re-raised, never swallowed
        cause: BaseException | None = exc
        while cause is not None:
            if isinstance(cause, MedflareError):
                raise cause from None
            cause = cause.__cause__
        raise


class _SegItem(Transform):
    """Load one datalist entry into a plain-tensor item and check it (shapes, label range).

    A deterministic MONAI ``Transform``, so CacheDataset runs (and caches) it at construction.

    Wraps MONAI's ``LoadImaged`` (NIfTI via nibabel, PNG via PIL in row-major order so that PNG and
    NIfTI arrays agree), ``EnsureChannelFirstd`` and ``ScaleIntensityd`` (per-image min-max to [0, 1]).
    """

    def __init__(self, num_classes: int) -> None:
        self.num_classes = num_classes
        self.load = Compose(
            [
                LoadImaged(["image", "label"], reader=PILReader(reverse_indexing=False), image_only=True),
                EnsureChannelFirstd(["image", "label"]),
                ScaleIntensityd("image", minv=0.0, maxv=1.0),
            ]
        )

    def __call__(self, entry: Mapping[str, Any]) -> dict[str, Any]:
        img_file, lbl_file = str(entry["image"]), str(entry["label"])
        try:
            loaded = self.load({"image": img_file, "label": lbl_file})
        except Exception as exc:  # noqa: BLE001 - any reader failure is a bad file for the operator
            raise DataError(f"cannot read image '{img_file}' or label '{lbl_file}': {exc.__cause__ or exc}") from exc
        image = loaded["image"].as_tensor().float()
        label = loaded["label"].as_tensor()
        if image.ndim != 3 or label.shape[1:] != image.shape[1:] or label.shape[0] != 1:
            raise DataError(
                f"image '{img_file}' has shape {tuple(image.shape)} but label '{lbl_file}' has shape "
                f"{tuple(label.shape)}; expected a (C, H, W) image and a (1, H, W) label of the same H, W"
            )
        rounded = torch.round(label)
        lo, hi = float(label.min()), float(label.max())
        if not torch.equal(rounded, label) or lo < 0 or hi >= self.num_classes:
            raise DataError(
                f"label '{lbl_file}' has values in [{lo:g}, {hi:g}], expected integers in [0, {self.num_classes})"
            )
        return {"image": image, "label": rounded.long(), "name": os.path.basename(img_file)}


class _SegCacheDataset(CacheDataset):
    """CacheDataset that surfaces MedflareError (from loading at construction or later) unwrapped."""

    def _load_cache_item(self, idx: int):  # noqa: D401 - MONAI hook
        with _medflare_errors():
            return super()._load_cache_item(idx)

    def _transform(self, index: int):
        with _medflare_errors():
            return super()._transform(index)


class _SegDataset(Dataset):
    """Dataset (lazy loading) that surfaces MedflareError unwrapped."""

    def _transform(self, index: int):
        with _medflare_errors():
            return super()._transform(index)


def read_datalist(datalist: str | os.PathLike, split: str) -> list[dict[str, str]]:
    """The entries of ``split`` in a Decathlon-style datalist, with absolute paths; checks files exist."""
    datalist = pathlib.Path(datalist)
    key, _ = _split_keys(split)
    try:
        content = json.loads(datalist.read_text())
    except OSError as exc:
        raise DataError(f"cannot read datalist '{datalist}': {exc}") from exc
    except json.JSONDecodeError as exc:
        raise DataError(f"datalist '{datalist}' is not valid JSON: {exc}") from exc
    if not isinstance(content, dict) or key not in content:
        raise DataError(f"datalist '{datalist}' has no '{key}' key (a list of {{image, label}} entries)")
    if not content[key]:
        raise DataError(f"datalist '{datalist}': split '{key}' is empty")
    for i, entry in enumerate(content[key]):
        if not isinstance(entry, dict) or "image" not in entry or "label" not in entry:
            raise DataError(f"datalist '{datalist}': entry {i} of '{key}' needs 'image' and 'label' keys")
    entries = load_decathlon_datalist(datalist, is_segmentation=True, data_list_key=key, base_dir=datalist.parent)
    for entry in entries:
        for field in ("image", "label"):
            if not os.path.isfile(entry[field]):
                raise DataError(f"datalist '{datalist}': {field} file '{entry[field]}' does not exist")
    return entries


def load_seg_split(
    datalist: str | os.PathLike, split: str, *, num_classes: int, cache: bool = True
) -> TorchDataset:
    """A segmentation dataset for one split of a datalist; with ``cache`` every item is loaded (and checked) now.

    Items: ``{"image": float32 (C, H, W) in [0, 1], "label": int64 (1, H, W) in [0, num_classes), "name"}``.
    """
    entries = read_datalist(datalist, split)
    transform = _SegItem(num_classes)
    with _medflare_errors():
        if cache:
            return _SegCacheDataset(entries, transform, cache_rate=1.0, num_workers=0, progress=False)
        return _SegDataset(entries, transform)


class NpzDataset(TorchDataset):
    """In-memory classification split: images float32 (N, C, H, W) in [0, 1], labels int64 (N,)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, split: str) -> None:
        self.images, self.labels, self.split = images, labels, split

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"image": self.images[i], "label": self.labels[i], "name": f"{self.split}_{i}"}


def _images_to_nchw(images: np.ndarray, where: str) -> torch.Tensor:
    """MedMNIST images (N, H, W), (N, H, W, C) or (N, C, H, W), uint8 or float, as float32 (N, C, H, W) in [0, 1].

    uint8 is divided by 255; float data already in [0, 1] is kept, other float data is min-max scaled
    over the whole array (one scale for all images, so relative brightness between images survives).
    """
    if images.ndim == 3:
        images = images[:, None]
    elif images.ndim == 4 and images.shape[-1] in (1, 3, 4):
        images = images.transpose(0, 3, 1, 2)
    elif not (images.ndim == 4 and images.shape[1] in (1, 3, 4)):
        raise DataError(f"{where}: images of shape {images.shape}; expected (N, H, W) or (N, H, W, C) with C in 1, 3")
    if images.dtype == np.uint8:
        out = images.astype(np.float32) / 255.0
    elif np.issubdtype(images.dtype, np.number):
        out = images.astype(np.float32)
        lo, hi = float(out.min()), float(out.max())
        if not np.isfinite([lo, hi]).all():
            raise DataError(f"{where}: images contain NaN or inf")
        if lo < 0.0 or hi > 1.0:
            out = (out - lo) / max(hi - lo, 1e-8)
    else:
        raise DataError(f"{where}: images have non-numeric dtype {images.dtype}")
    return torch.from_numpy(np.ascontiguousarray(out))


def load_npz_split(npz: str | os.PathLike, split: str, *, num_classes: int | None = None) -> TorchDataset:
    """A classification dataset for one split (train/val/test) of a MedMNIST-layout .npz.

    Items: ``{"image": float32 (C, H, W) in [0, 1], "label": int64 scalar, "name": "<split>_<i>"}``.
    ``num_classes``, when given, bounds the labels.
    """
    npz = pathlib.Path(npz)
    _, prefix = _split_keys(split)
    try:
        with np.load(npz, allow_pickle=False) as data:
            keys = set(data.files)
            for key in (f"{prefix}_images", f"{prefix}_labels"):
                if key not in keys:
                    raise DataError(f"npz '{npz}' has no key '{key}' (has: {sorted(keys)})")
            images, labels = data[f"{prefix}_images"], data[f"{prefix}_labels"]
    except MedflareError:
        raise
    except Exception as exc:  # noqa: BLE001 - missing, truncated or non-npz file
        raise DataError(f"cannot read npz '{npz}': {exc}") from exc
    where = f"npz '{npz}' split '{prefix}'"
    if len(images) == 0:
        raise DataError(f"{where} is empty")
    labels = np.asarray(labels)
    if labels.ndim == 2 and labels.shape[1] == 1:
        labels = labels[:, 0]
    if labels.ndim != 1 or len(labels) != len(images):
        raise DataError(f"{where}: labels of shape {labels.shape} do not match {len(images)} images; expected (N,) or (N, 1)")
    if not np.issubdtype(labels.dtype, np.integer) and not np.array_equal(labels, np.round(labels)):
        raise DataError(f"{where}: labels are not integers")
    labels = labels.astype(np.int64)
    upper = num_classes if num_classes is not None else np.iinfo(np.int64).max
    if labels.min() < 0 or labels.max() >= upper:
        raise DataError(f"{where}: labels in [{labels.min()}, {labels.max()}], expected [0, {num_classes})")
    return NpzDataset(_images_to_nchw(np.asarray(images), where), torch.from_numpy(labels), prefix)
