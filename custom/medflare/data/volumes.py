"""3D volumes of a site's datalist as training data: 2D slices or 3D patches, and whole volumes for evaluation.

Each volume goes once through the preset's deterministic preprocessing (:mod:`medflare.data.transforms`:
reader by file type, checks, channels, labels, orientation, target spacing, intensity, in-plane size)
and is kept by a MONAI dataset chosen by ``data.cache`` (:func:`medflare.data.loaders.cached_dataset`):
``CacheDataset`` in RAM (``rate`` of the volumes), ``PersistentDataset`` on disk (memory bounded by one
volume at a time, for data larger than RAM; 2D slices are then cached as slices too), or nothing
(reloaded on every access). From those:

* ``spatial_dims: 2`` (the papers' setting): the training split is a :class:`SliceDataset` of 2D items
  ``{"image": (C, H, W), "label": (1, H, W) int64, "name": "<file>[k]", "spacing": (2,) mm, "volume": "<file>",
  "slice": k}`` drawn along ``slices.axis`` (``select`` "all" or "foreground" slices, a seeded
  ``ratio`` of them); validation and testing splits hold every slice.
* ``spatial_dims: 3``: the training split is a :class:`PatchDataset` of ``patch.per_volume`` random patches
  per volume and epoch (MONAI ``RandCropByPosNegLabeld``, ``patch.pos_fraction`` centred on foreground);
  validation and testing splits are whole volumes ``(C, H, W, D)`` (batch 1).

Whatever the training unit, models are scored per volume (:class:`WholeVolumes`): a 2D model slice by
slice with the slices stacked back into the volume, a 3D model by MONAI sliding-window inference, and the
metrics use the voxel spacing in mm.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from monai.data import Dataset
from monai.transforms import Compose, RandCropByPosNegLabeld, SpatialPadd, Transform
from torch.utils.data import Dataset as TorchDataset

from medflare import ConfigError
from medflare.data.datalists import SEG_SPLITS
from medflare.data.loaders import cached_dataset, make_loader
from medflare.data.transforms import Augment, ToItem, augmentation, check_image_size, preprocess
from medflare.data.util import stable_seed

#: The keys of a ``kind: "volumes"`` preset's data section besides :data:`~medflare.data.transforms.PREPROCESSING_KEYS`,
#: with their defaults.
VOLUME_KEYS: dict[str, Any] = {
    # 2: train 2D models on slices; 3: train 3D models on patches
    "spatial_dims": 2,
    # 2D: slices along ``axis`` (after reorientation; 2 = axial for RAS); ``select`` "all" | "foreground"
    # (slices whose label has foreground); ``ratio``: the fraction of those used for training (seeded)
    "slices": {"axis": 2, "select": "all", "ratio": 1.0},
    # 3D: patch size in voxels, patches per volume and epoch, fraction centred on foreground; the
    # sliding window of evaluation has the patch size, ``overlap`` and ``sw_batch_size`` windows per pass
    "patch": {"size": [96, 96, 32], "per_volume": 4, "pos_fraction": 0.5, "overlap": 0.25, "sw_batch_size": 4},
}


def volume_setting(data_cfg: Mapping[str, Any], key: str) -> Any:
    """The preset's value of a volume ``key`` or its default (nested dicts filled key by key)."""
    default = VOLUME_KEYS[key]
    value = data_cfg.get(key, default)
    if isinstance(default, dict):
        unknown = set(value or {}) - set(default)
        if unknown:
            raise ConfigError(f"unknown config key(s) {sorted(f'data.{key}.{k}' for k in unknown)} (known: {sorted(default)})")
        return {**default, **(value or {})}
    return value


@dataclass(frozen=True)
class VolumeLayout:
    """What a volume preset asks for, checked: training unit, slicing axis, patch and window settings."""

    spatial_dims: int
    axis: int
    select: str
    ratio: float
    patch: tuple[int, int, int]
    per_volume: int
    pos_fraction: float
    overlap: float
    sw_batch_size: int
    image_size: tuple[int, int] | None

    @classmethod
    def from_config(cls, data_cfg: Mapping[str, Any]) -> "VolumeLayout":
        dims = volume_setting(data_cfg, "spatial_dims")
        if dims not in (2, 3):
            raise ConfigError(f"config key 'data.spatial_dims' must be 2 (slices) or 3 (patches), got {dims!r}")
        slices, patch = volume_setting(data_cfg, "slices"), volume_setting(data_cfg, "patch")
        if slices["axis"] not in (0, 1, 2):
            raise ConfigError(f"config key 'data.slices.axis' must be 0, 1 or 2, got {slices['axis']!r}")
        if slices["select"] not in ("all", "foreground"):
            raise ConfigError(f"config key 'data.slices.select' must be 'all' or 'foreground', got {slices['select']!r}")
        if not 0 < float(slices["ratio"]) <= 1:
            raise ConfigError(f"config key 'data.slices.ratio' must be in (0, 1], got {slices['ratio']!r}")
        size = patch["size"]
        if not isinstance(size, (list, tuple)) or len(size) != 3 or not all(isinstance(s, int) and s > 0 for s in size):
            raise ConfigError(f"config key 'data.patch.size' must be three positive ints, got {size!r}")
        if not isinstance(patch["per_volume"], int) or patch["per_volume"] < 1:
            raise ConfigError(f"config key 'data.patch.per_volume' must be a positive int, got {patch['per_volume']!r}")
        if not 0 <= float(patch["pos_fraction"]) <= 1 or not 0 <= float(patch["overlap"]) < 1:
            raise ConfigError("config keys 'data.patch.pos_fraction' must be in [0, 1] and 'data.patch.overlap' in [0, 1)")
        image_size = check_image_size(data_cfg)
        if dims == 3 and image_size is not None:
            raise ConfigError("config key 'data.image_size' is for 2D presets; 3D presets train on 'data.patch.size' patches")
        return cls(dims, int(slices["axis"]), slices["select"], float(slices["ratio"]), tuple(size), int(patch["per_volume"]),
                   float(patch["pos_fraction"]), float(patch["overlap"]), int(patch["sw_batch_size"]),
                   tuple(image_size) if image_size else None)

    def volume_size(self) -> list[int] | None:
        """The size volumes are brought to before caching: 2D presets resize in-plane, keeping the slicing axis."""
        if self.spatial_dims == 3 or self.image_size is None:
            return None
        size = list(self.image_size)
        size.insert(self.axis, -1)
        return size

    def inference(self) -> dict[str, Any]:
        """How a model of this layout predicts a whole volume (see :class:`medflare.metrics.inference.VolumeInference`)."""
        return {"model_dims": self.spatial_dims, "axis": self.axis, "roi_size": self.patch,
                "overlap": self.overlap, "sw_batch_size": self.sw_batch_size}


def volume_transform(data_cfg: Mapping[str, Any], layout: VolumeLayout, num_classes: int, *, keep_meta: bool = False,
                     has_label: bool = True) -> Compose:
    """Deterministic preprocessing of one datalist entry into a volume item (plain tensors, label uint8).

    With ``keep_meta`` the result keeps MetaTensors (affine, applied operations) for inversion, else it is
    the compact item the caches hold: ``{"image": (C, H, W, D) float32, "label": (1, H, W, D) uint8,
    "spacing": (3,) mm, "name"}``.
    """
    chain = preprocess(data_cfg, spatial_dims=3, num_classes=num_classes, has_label=has_label,
                       size=layout.volume_size(), kind="volumes")
    if not keep_meta:
        chain.append(ToItem(spacing=True, compact=True))
    return Compose(chain)


class _LastVolume:
    """The most recently read volume of a dataset (slices of one volume are often read one after another)."""

    def __init__(self, volumes: TorchDataset) -> None:
        self.volumes, self.index, self.item = volumes, None, None

    def __call__(self, v: int) -> Mapping[str, Any]:
        if v != self.index:
            self.item, self.index = self.volumes[v], v
        return self.item


def slice_index(volumes: TorchDataset, axis: int, select: str = "all", ratio: float = 1.0, seed: int = 0) -> list[tuple[int, int]]:
    """``[(volume, slice)]`` of the slices to use: all or those with foreground, a seeded ``ratio`` of them.

    Reads every volume once, in order (this is also when a disk cache is written and every file checked).
    """
    rng = np.random.default_rng(seed)
    index: list[tuple[int, int]] = []
    for v in range(len(volumes)):
        label = volumes[v]["label"]
        n = label.shape[axis + 1]
        if select == "foreground":
            other = tuple(d for d in range(1, label.ndim) if d != axis + 1)
            keep = torch.nonzero(label.amax(dim=other)[0] > 0).flatten().tolist() if label.numel() else []
        else:
            keep = list(range(n))
        if ratio < 1 and keep:
            count = max(1, round(len(keep) * ratio))
            keep = sorted(rng.choice(keep, size=count, replace=False).tolist())
        index += [(v, k) for k in keep]
    return index


class SliceDataset(TorchDataset):
    """2D items drawn from the volumes of a dataset along ``axis``, augmented by ``augment`` (training).

    Items: ``{"image": (C, H, W) float32, "label": (1, H, W) int64, "name": "<file>[k]", "spacing": (2,) mm,
    "volume": "<file>", "slice": k}``.
    """

    def __init__(self, volumes: TorchDataset, index: Sequence[tuple[int, int]], axis: int,
                 augment: Callable | None = None) -> None:
        self.volumes, self.index, self.axis, self.augment = volumes, list(index), axis, augment
        self._volume = _LastVolume(volumes)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, Any]:
        v, k = self.index[i]
        item = take_slice(self._volume(v), self.axis, k)
        return self.augment(item) if self.augment is not None else item


def take_slice(vol: Mapping[str, Any], axis: int, k: int) -> dict[str, Any]:
    """Slice ``k`` along spatial ``axis`` of a volume item, as a 2D item (see :class:`SliceDataset`)."""
    spacing = vol["spacing"]
    return {
        "image": vol["image"].select(axis + 1, k).clone(),
        "label": vol["label"].select(axis + 1, k).to(torch.int64),
        "name": f"{vol['name']}[{k}]",
        "spacing": torch.cat([spacing[:axis], spacing[axis + 1:]]),
        "volume": vol["name"],
        "slice": k,
    }


class SliceOf(Transform):
    """Deterministic transform: a slice entry ``{..., "volume_index": v, "slice": k}`` -> that 2D item.

    Reads volume ``v`` from ``volumes`` (the last one kept), so a caching dataset over slice entries in
    volume order reads each volume once while it writes the slices.
    """

    def __init__(self, volumes: TorchDataset, axis: int) -> None:
        self.volume, self.axis = _LastVolume(volumes), axis

    def __call__(self, entry: Mapping[str, Any]) -> dict[str, Any]:
        return take_slice(self.volume(entry["volume_index"]), self.axis, entry["slice"])


class PatchDataset(TorchDataset):
    """``per_volume`` random 3D patches per volume and pass (MONAI ``RandCropByPosNegLabeld``), augmented.

    Index ``i`` draws a fresh patch of volume ``i // per_volume``, so an epoch sees every volume
    ``per_volume`` times. Volumes smaller than the patch are zero-padded first. Items: ``{"image": (C, *patch)
    float32, "label": (1, *patch) int64, "name", "spacing": (3,) mm}``.
    """

    def __init__(self, volumes: TorchDataset, patch: Sequence[int], per_volume: int, pos_fraction: float,
                 augment: Callable | None = None, seed: int = 0) -> None:
        self.volumes, self.per_volume, self.augment = volumes, per_volume, augment
        self.crop = Compose([
            SpatialPadd(["image", "label"], spatial_size=list(patch)),
            RandCropByPosNegLabeld(["image", "label"], label_key="label", spatial_size=list(patch),
                                   pos=pos_fraction, neg=1.0 - pos_fraction, num_samples=1, allow_smaller=True),
        ])
        self.crop.set_random_state(seed=seed)

    def __len__(self) -> int:
        return len(self.volumes) * self.per_volume

    def __getitem__(self, i: int) -> dict[str, Any]:
        vol = self.volumes[i // self.per_volume]
        patch = self.crop({"image": vol["image"], "label": vol["label"].float()})[0]
        item = {"image": torch.as_tensor(patch["image"]).float().contiguous(),
                "label": torch.round(torch.as_tensor(patch["label"])).to(torch.int64).contiguous(),
                "name": vol["name"], "spacing": vol["spacing"]}
        return self.augment(item) if self.augment is not None else item


class WholeVolume(TorchDataset):
    """The volumes of a dataset as items with an int64 label: ``(C, H, W, D)``, ``(1, H, W, D)``, spacing, name."""

    def __init__(self, volumes: TorchDataset) -> None:
        self.volumes = volumes

    def __len__(self) -> int:
        return len(self.volumes)

    def __getitem__(self, i: int) -> dict[str, Any]:
        vol = self.volumes[i]
        return {"image": vol["image"], "label": vol["label"].to(torch.int64), "spacing": vol["spacing"], "name": vol["name"]}


@dataclass
class WholeVolumes:
    """Per-volume scoring of a site's validation and testing volumes (what validate and evaluate use).

    ``datasets`` maps "val"/"test" to :class:`WholeVolume` datasets; ``inference`` says how a model predicts
    a whole volume (:class:`medflare.metrics.inference.VolumeInference` arguments).
    """

    datasets: dict[str, TorchDataset]
    inference: dict[str, Any]

    def loader(self, split: str):
        """Batches of one volume (volumes differ in size)."""
        return make_loader(self.datasets[split], 1, False)

    def predictor(self, forward: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        """``forward`` (a model or predictor on slices/patches) as a predictor on whole volumes (B, C, H, W, D)."""
        from medflare.metrics.inference import VolumeInference

        return VolumeInference(**self.inference).wrap(forward)


def _slices(store: TorchDataset, entries: list[dict[str, Any]], index: list[tuple[int, int]], axis: int,
            augment: Augment | None, cache: Mapping[str, Any], tag: str) -> TorchDataset:
    """2D items of ``index``: views of the volumes in RAM, or (disk cache) their own small cached files.

    On disk, reading a whole preprocessed volume for every slice would cost a volume read per slice in a
    shuffled epoch; the slices are therefore cached themselves (MONAI PersistentDataset over slice entries),
    written now in volume order, so each volume is read once and an epoch reads only slices.
    """
    if cache["mode"] != "disk":
        return SliceDataset(store, index, axis, augment)
    slice_entries = [{**entries[v], "volume_index": v, "slice": k} for v, k in index]
    slices = cached_dataset(slice_entries, Compose([SliceOf(store, axis)]), cache, tag)
    written = pathlib.Path(slices.cache_dir) / f"slices-{_digest(slices.data)}.done"
    if not written.is_file():  # in volume order: writes every slice file, reading each volume once
        for i in range(len(slices)):
            slices[i]
        written.touch()
    return Dataset(slices, transform=augment) if augment is not None else slices


def _digest(entries: Sequence[Mapping[str, Any]]) -> str:
    """A short hash of a list of (stamped) entries: names one warm-up of a slice cache."""
    return hashlib.sha256(json.dumps(list(entries), sort_keys=True, default=str).encode()).hexdigest()[:16]


def volume_datasets(entries: Mapping[str, list[dict[str, Any]]], data_cfg: Mapping[str, Any], *, num_classes: int,
                    site: str, cache: Mapping[str, Any], tag: str) -> tuple[list[TorchDataset], WholeVolumes, int]:
    """Train/val/test datasets of a volume site, its per-volume scoring and the image channel count.

    ``entries`` maps "training"/"validation"/"testing" to datalist entries; ``cache`` is the preset's
    ``data.cache`` (:func:`medflare.data.loaders.cached_dataset`), ``tag`` names its settings.
    """
    layout = VolumeLayout.from_config(data_cfg)
    transform = volume_transform(data_cfg, layout, num_classes)
    splits = SEG_SPLITS
    stores = {split: cached_dataset(entries[split], transform, cache, tag) for split in splits}
    seed = stable_seed("volumes", site, int(data_cfg.get("seed", 0)))
    if layout.spatial_dims == 2:
        augment = Augment(augmentation(data_cfg, 2), seed=seed)
        index = {s: slice_index(stores[s], layout.axis, *((layout.select, layout.ratio, seed) if s == "training" else ()))
                 for s in splits}
        train, val, test = (_slices(stores[s], entries[s], index[s], layout.axis, augment if s == "training" else None, cache, tag)
                            for s in splits)
    else:
        augment = Augment(augmentation(data_cfg, 3), seed=seed)
        for split in SEG_SPLITS:
            for v in range(len(stores[split])):  # every volume read (and checked) before training starts
                stores[split][v]
        train = PatchDataset(stores["training"], layout.patch, layout.per_volume, layout.pos_fraction, augment, seed)
        val, test = WholeVolume(stores["validation"]), WholeVolume(stores["testing"])
    in_channels = int(stores["training"][0]["image"].shape[0])
    whole = WholeVolumes({"val": WholeVolume(stores["validation"]), "test": WholeVolume(stores["testing"])}, layout.inference())
    return [train, val, test], whole, in_channels

