"""Loaders for a site's data: a Decathlon-style datalist of NIfTI/PNG/JPEG files, or a MedMNIST-layout .npz.

Both return map-style datasets whose items are plain-tensor dicts that a default DataLoader batches:
``{"image": float32 (C, H, W) in [0, 1], "label": ..., "name": str}``; the label is int64 (1, H, W) for
segmentation and an int64 scalar for classification. Bad inputs raise MedflareError naming the file.
A 2D datalist is preprocessed as the preset's ``data`` section says (:mod:`medflare.data.transforms`:
channels, label values, intensity, resizing to ``image_size``, training-time augmentation); with none of
those keys, images are taken as stored and min-max scaled per image. Volumes: :mod:`medflare.data.volumes`.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import pathlib
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch
from monai.data import CacheDataset, Dataset, PersistentDataset
from monai.transforms import Compose
from torch.utils.data import DataLoader
from torch.utils.data import Dataset as TorchDataset

from medflare import ConfigError, DataError, MedflareError
from medflare.data.datalists import SEG_SPLITS, read_datalist, split_keys
from medflare.data.limits import LIMIT_DEFAULTS
from medflare.data.transforms import Augment, CheckSize, ToItem, augmentation, check_image_size, first_line, preprocess
from medflare.data.util import cache_root

NPZ_SPLITS = ("train", "val", "test")
__all__ = ["NPZ_SPLITS", "SEG_SPLITS", "cached_dataset", "load_npz_split", "load_seg_split", "read_datalist",
           "seg_image_dataset"]

#: ``data.cache``: where preprocessed items are kept. "memory": MONAI CacheDataset holding ``rate`` of the
#: items in RAM (the rest is re-read and re-preprocessed on every access); "disk": MONAI PersistentDataset
#: under ``dir`` (default ``$MEDFLARE_CACHE/preprocessed/<settings hash>``), memory bounded by the item
#: being read, kept between runs (it holds preprocessed patient images: put it on the site's protected
#: storage); "none": re-read on every access.
CACHE_DEFAULT: dict[str, Any] = {"mode": "memory", "rate": 1.0, "dir": None}
CACHE_MODES = ("memory", "disk", "none")
_CACHE_VERSION = 1  # bump when preprocessing code changes what a cached item holds
_log = logging.getLogger(__name__)


def cache_setting(data_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``data.cache`` filled with defaults and checked."""
    value = {**CACHE_DEFAULT, **(data_cfg.get("cache") or {})}
    unknown = set(value) - set(CACHE_DEFAULT)
    if unknown:
        raise ConfigError(f"unknown config key(s) {sorted('data.cache.' + k for k in unknown)} (known: {sorted(CACHE_DEFAULT)})")
    if value["mode"] not in CACHE_MODES:
        raise ConfigError(f"config key 'data.cache.mode' is {value['mode']!r}; expected one of {list(CACHE_MODES)}")
    if not 0 <= float(value["rate"]) <= 1:
        raise ConfigError(f"config key 'data.cache.rate' must be in [0, 1], got {value['rate']!r}")
    return value


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


class _SegCacheDataset(CacheDataset):
    """CacheDataset that surfaces MedflareError (from loading at construction or later) unwrapped."""

    def _load_cache_item(self, idx: int):  # noqa: D401 - MONAI hook
        with _medflare_errors():
            return super()._load_cache_item(idx)

    def _transform(self, index: int):
        with _medflare_errors():
            return super()._transform(index)


class _SegPersistentDataset(PersistentDataset):
    """PersistentDataset (preprocessed items on disk) that surfaces MedflareError unwrapped and heals corrupt entries.

    MONAI recomputes a cache entry only for two kinds of corruption; a truncated file ("failed finding central
    directory") made every site fail at start, on every rerun, naming no file. Here an entry that exists but
    does not load is logged with its path, deleted and recomputed (or, where the cache cannot be written,
    recomputed without caching).
    """

    def _transform(self, index: int):
        with _medflare_errors():
            return super()._transform(index)

    def _entry(self, item: Any) -> pathlib.Path:
        """The cache file of ``item``, named as MONAI names it (hash of the item + hash of the transforms)."""
        return pathlib.Path(self.cache_dir) / f"{self.hash_func(item).decode('utf-8')}{self.transform_hash}.pt"

    def _cachecheck(self, item_transformed):  # noqa: D401 - MONAI hook
        try:
            with _medflare_errors():
                return super()._cachecheck(item_transformed)
        except MedflareError:
            raise
        except Exception as exc:  # noqa: BLE001 - an existing entry is what failed: MONAI computes only missing ones
            entry = self._entry(item_transformed)
            if not entry.is_file():
                raise
            _log.warning("disk cache entry '%s' cannot be loaded (%s); deleting and recomputing it", entry, first_line(exc))
            try:
                entry.unlink()
            except OSError as err:
                _log.warning("cannot delete disk cache entry '%s' (%s); using the item without caching it", entry, err)
                with _medflare_errors():
                    return self._pre_transform(copy.deepcopy(item_transformed))
        with _medflare_errors():
            return super()._cachecheck(item_transformed)


class _SegDataset(Dataset):
    """Dataset (lazy loading) that surfaces MedflareError unwrapped."""

    def _transform(self, index: int):
        with _medflare_errors():
            return super()._transform(index)


def _file_stamp(value: Any) -> str:
    """Size and modification time of an entry's file(s): part of a disk cache key, so an edited file is re-read."""
    files = value if isinstance(value, (list, tuple)) else [value]
    return ";".join(f"{os.path.getsize(f)}:{os.stat(f).st_mtime_ns}" for f in files if f is not None and os.path.isfile(f))


def settings_tag(data_cfg: Mapping[str, Any], num_classes: int) -> str:
    """A short hash of every setting that changes a preprocessed item (not augmentation, the cache or size limits)."""
    kept = {k: v for k, v in data_cfg.items() if k not in ("cache", "augment", *LIMIT_DEFAULTS)}
    text = json.dumps({"cfg": kept, "num_classes": num_classes, "v": _CACHE_VERSION}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cached_dataset(entries: Sequence[Mapping[str, Any]], transform: Compose, cache: Mapping[str, Any], tag: str) -> TorchDataset:
    """``entries`` through ``transform`` in the MONAI dataset ``cache`` (:data:`CACHE_DEFAULT`) asks for.

    The deterministic head of ``transform`` is what is cached; "memory" with rate 1 loads every item now.
    """
    with _medflare_errors():
        if cache["mode"] == "memory":
            return _SegCacheDataset(list(entries), transform, cache_rate=float(cache["rate"]), num_workers=0, progress=False)
        if cache["mode"] == "disk":
            folder = pathlib.Path(cache["dir"]).expanduser() if cache["dir"] else cache_root() / "preprocessed" / tag
            folder.mkdir(parents=True, exist_ok=True)
            stamped = [{**e, "stamp": _file_stamp(e["image"]) + "|" + _file_stamp(e.get("label"))} for e in entries]
            return _SegPersistentDataset(stamped, transform, cache_dir=folder)
        return _SegDataset(list(entries), transform)


def seg_image_dataset(entries: Sequence[Mapping[str, Any]], data_cfg: Mapping[str, Any], *, num_classes: int,
                      cache: Mapping[str, Any] | None = None, train: bool = False, seed: int = 0,
                      check: bool = True, size_check: CheckSize | None = None) -> TorchDataset:
    """2D segmentation items of datalist ``entries``, preprocessed (and, with ``train``, augmented) per the preset.

    Items: ``{"image": float32 (C, H, W), "label": int64 (1, H, W) in [0, num_classes), "name"}``. With
    ``check`` every item not already loaded by the cache is read once now, so a bad file fails before training.
    Without ``data.image_size`` images are used as stored and must share one size: ``size_check`` (one per site,
    shared by its splits; default one for these entries) names an image of another size.
    """
    size = check_image_size(data_cfg)
    chain = preprocess(data_cfg, spatial_dims=2, num_classes=num_classes, size=size, kind="datalist")
    if size is None:
        chain.append(size_check or CheckSize())
    chain.append(ToItem())
    if train:
        chain.append(Augment(augmentation(data_cfg, 2), seed=seed))
    cache = dict(cache or CACHE_DEFAULT)
    dataset = cached_dataset(entries, Compose(chain), cache, settings_tag(data_cfg, num_classes))
    if check and not (cache["mode"] == "memory" and float(cache["rate"]) >= 1):
        with _medflare_errors():
            for i in range(len(dataset)):
                dataset[i]
    return dataset


def load_seg_split(
    datalist: str | os.PathLike, split: str, *, num_classes: int, cache: bool = True,
    data_cfg: Mapping[str, Any] | None = None,
) -> TorchDataset:
    """A 2D segmentation dataset for one split of a datalist; with ``cache`` every item is loaded (and checked) now.

    Items: ``{"image": float32 (C, H, W) in [0, 1], "label": int64 (1, H, W) in [0, num_classes), "name"}``.
    ``data_cfg`` (a preset's data section) sets the preprocessing; none: images as stored, min-max scaled.
    """
    entries = read_datalist(datalist, split)
    mode = {"mode": "memory", "rate": 1.0, "dir": None} if cache else {"mode": "none", "rate": 0.0, "dir": None}
    return seg_image_dataset(entries, data_cfg or {}, num_classes=num_classes, cache=mode, check=False)


class NpzDataset(TorchDataset):
    """In-memory classification split: images float32 (N, C, H, W) in [0, 1], labels int64 (N,)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, split: str) -> None:
        self.images, self.labels, self.split = images, labels, split

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"image": self.images[i], "label": self.labels[i], "name": f"{self.split}_{i}"}


#: numpy dtype kinds a stored image or label array may have: unsigned/signed integers, floats, booleans.
#: Complex, string, object, structured and date/time arrays are refused (never cast: numpy would drop the
#: imaginary part of a complex image with only a warning).
NUMERIC_KINDS = "uifb"


def _check_dtype(array: np.ndarray, where: str) -> None:
    if array.dtype.kind not in NUMERIC_KINDS:
        raise DataError(f"{where} has dtype {array.dtype}; expected integers, floats or booleans (a complex, string or "
                        "object array is not an image or a label)")


def _images_to_nchw(images: np.ndarray, where: str) -> torch.Tensor:
    """MedMNIST images (N, H, W), (N, H, W, C) or (N, C, H, W), uint8 or float, as float32 (N, C, H, W) in [0, 1].

    uint8 is divided by 255; float data already in [0, 1] is kept, other float data is min-max scaled
    over the whole array (one scale for all images, so relative brightness between images survives).
    ``where`` names the file and key in a DataError (wrong dtype, layout, empty sides, NaN/inf).
    """
    _check_dtype(images, where)
    if images.ndim == 3:
        images = images[:, None]
    elif images.ndim == 4 and images.shape[-1] in (1, 3, 4):
        images = images.transpose(0, 3, 1, 2)
    elif not (images.ndim == 4 and images.shape[1] in (1, 3, 4)):
        raise DataError(f"{where}: images of shape {images.shape}; expected (N, H, W) or (N, H, W, C) with C in 1, 3")
    if 0 in images.shape[2:]:
        raise DataError(f"{where}: images of shape {images.shape} have an empty side")
    if images.dtype == np.uint8:
        out = images.astype(np.float32) / 255.0
    else:
        out = images.astype(np.float32)
        lo, hi = float(out.min()), float(out.max())
        if not np.isfinite([lo, hi]).all():
            raise DataError(f"{where}: images contain NaN or inf (or values beyond float32)")
        if lo < 0.0 or hi > 1.0:
            out = (out - lo) / max(hi - lo, 1e-8)
    return torch.from_numpy(np.ascontiguousarray(out))


def _labels(labels: np.ndarray, n: int, where: str, num_classes: int | None) -> torch.Tensor:
    """Class labels (N,) or (N, 1), integers (or integral floats, or booleans), as int64 in [0, num_classes)."""
    _check_dtype(labels, where)
    if labels.ndim == 2 and labels.shape[1] == 1:
        labels = labels[:, 0]
    if labels.ndim != 1 or len(labels) != n:
        raise DataError(f"{where}: labels of shape {labels.shape} do not match {n} images; expected (N,) or (N, 1)")
    if labels.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            integral = np.isfinite(labels).all() and np.array_equal(labels, np.round(labels)) and np.abs(labels).max() < 2**62
        if not integral:
            raise DataError(f"{where}: labels are not integers")
    elif labels.dtype.kind == "u" and labels.max() > np.iinfo(np.int64).max:
        raise DataError(f"{where}: labels up to {labels.max()} do not fit int64")
    labels = labels.astype(np.int64)
    upper = num_classes if num_classes is not None else np.iinfo(np.int64).max
    if labels.min() < 0 or labels.max() >= upper:
        raise DataError(f"{where}: labels in [{labels.min()}, {labels.max()}], expected [0, {num_classes})")
    return torch.from_numpy(labels)


def _read_npz(npz: pathlib.Path, keys: Sequence[str]) -> list[np.ndarray]:
    """The arrays ``keys`` of an .npz (never unpickling); a DataError names the file and the key that is missing or bad."""
    try:
        data = np.load(npz, allow_pickle=False)
    except Exception as exc:  # noqa: BLE001 - missing, truncated or non-npz file
        raise DataError(f"cannot read npz '{npz}': {first_line(exc)}") from exc
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise DataError(f"npz '{npz}' is a single .npy array, not an .npz archive with keys {list(keys)}")
    with data:
        present = set(data.files)
        out = []
        for key in keys:
            if key not in present:
                raise DataError(f"npz '{npz}' has no key '{key}' (has: {sorted(present)})")
            try:
                out.append(np.asarray(data[key]))
            except Exception as exc:  # noqa: BLE001 - a corrupt member, or an object array that would need pickle
                raise DataError(f"npz '{npz}' key '{key}' cannot be read: {first_line(exc)}") from exc
    return out


def load_npz_split(npz: str | os.PathLike, split: str, *, num_classes: int | None = None) -> TorchDataset:
    """A classification dataset for one split (train/val/test) of a MedMNIST-layout .npz.

    Items: ``{"image": float32 (C, H, W) in [0, 1], "label": int64 scalar, "name": "<split>_<i>"}``.
    ``num_classes``, when given, bounds the labels. A bad file, key, dtype or shape is a DataError naming
    the file and the key.
    """
    npz = pathlib.Path(npz)
    _, prefix = split_keys(split)
    image_key, label_key = f"{prefix}_images", f"{prefix}_labels"
    images, labels = _read_npz(npz, (image_key, label_key))
    if images.ndim == 0 or len(images) == 0:
        raise DataError(f"npz '{npz}' split '{prefix}' is empty (key '{image_key}' holds shape {images.shape})")
    labels_t = _labels(labels, len(images), f"npz '{npz}' key '{label_key}'", num_classes)
    return NpzDataset(_images_to_nchw(images, f"npz '{npz}' key '{image_key}'"), labels_t, prefix)


def make_loader(dataset: TorchDataset, batch_size: int, shuffle: bool, seed: int = 0, num_workers: int = 0) -> DataLoader:
    """A DataLoader with a seeded shuffle so that reruns of a job see the same batches.

    ``num_workers`` > 0 loads batches in that many worker processes (each with one torch thread); the
    batches and their order are the same as with 0.
    """
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=generator, num_workers=num_workers,
                      persistent_workers=False)
