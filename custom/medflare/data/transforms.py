"""A site's preprocessing and augmentation, built from a preset's ``data`` section with MONAI transforms.

One place turns the preset keys into MONAI transform chains, for 2D images (PNG/JPEG/NIfTI) and for 3D
volumes alike (every key is documented in :data:`PREPROCESSING_KEYS`). Order of the deterministic part
(cached by the datasets): load with the reader of the file's type -> check dimensionality and channels
-> select channels -> map label values -> orientation -> resampling to a target spacing -> intensity
normalisation -> resize / pad-crop to the model's size -> plain-tensor item. The random part
(training only) follows: flips, rotation, intensity and contrast jitter.

Readers are chosen by file type (NIfTI: nibabel; PNG/JPEG/BMP/TIFF: PIL in row-major order, so that
PNG and NIfTI arrays agree), so no file is first offered to a reader that cannot read it.
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping, Sequence

import torch
from monai.data import MetaTensor
from monai.data.image_reader import NibabelReader, PILReader
from monai.transforms import (
    AsDiscreted,
    Compose,
    EnsureChannelFirst,
    LoadImage,
    MapLabelValued,
    NormalizeIntensityd,
    Orientationd,
    RandAdjustContrastd,
    RandFlipd,
    RandRotated,
    RandScaleIntensityd,
    RandShiftIntensityd,
    Resized,
    ResizeWithPadOrCropd,
    ScaleIntensityd,
    ScaleIntensityRangePercentilesd,
    ScaleIntensityRanged,
    Spacingd,
    RandomizableTrait,
    Transform,
)

from medflare import ConfigError, DataError
from medflare.data.limits import LIMIT_DEFAULTS, Limits, check_stored_size, stored_header

NIFTI_SUFFIXES = (".nii", ".nii.gz")
PIL_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff")
INTENSITY_MODES = ("minmax", "percentile", "zscore", "ct_window", "none")
LABEL_MODES = ("auto", "foreground", "as_is")
FIT_MODES = ("resize", "pad_crop")

#: Every preprocessing key a preset's ``data`` section may hold, with its default (the behaviour of a
#: datalist preset that names none of them: images as stored, per-image min-max scaling, no augmentation).
PREPROCESSING_KEYS: dict[str, Any] = {
    # image channels the model takes (after channel_indices); a file with other channels is a DataError
    "channels": None,
    # channels to keep, e.g. [0] for the T2 of MSD prostate's (T2, ADC); null keeps all
    "channel_indices": None,
    # "auto": foreground (any label > 0 -> 1) when num_classes is 2, else as stored; "foreground";
    # "as_is"; or a list of stored values mapped to 0..K-1 in order (BraTS: [0, 1, 2, 4])
    "labels": "auto",
    # volumes: orientation codes to reorient to, e.g. "RAS"; null keeps the stored orientation
    "orientation": None,
    # volumes: target voxel size in mm, e.g. [0.6, 0.6, 3.0] (null: each volume keeps its own)
    "spacing": None,
    # "minmax" (per image to [0, 1]) | "percentile" (percentiles -> [0, 1], clipped, per channel) |
    # "zscore" (mean 0, std 1 over the non-zero (foreground) voxels, per channel; values leave [0, 1]) |
    # "ct_window" (Hounsfield window -> [0, 1], clipped) | "none"
    "intensity": "minmax",
    "percentiles": [0.5, 99.5],
    "window": [-160.0, 240.0],
    # in-plane size of the model's input, e.g. [256, 256]; null keeps each image's size (2D datalists
    # then need images of one size); not used by 3D presets (patches and sliding windows instead)
    "image_size": None,
    # how image_size is reached: "resize" (interpolate; nearest for labels) | "pad_crop" (centre)
    "fit": "resize",
    # training-time augmentation (training split only); every probability 0 switches it off
    "augment": {"flip": 0.0, "rotate": 0.0, "intensity": 0.0, "contrast": 0.0, "prob": 0.0},
    # largest image a site reads, checked from the file's header before decoding (medflare.data.limits):
    # elements (all channel files together) and decompressed bytes
    **LIMIT_DEFAULTS,
}


def setting(data_cfg: Mapping[str, Any], key: str) -> Any:
    """The preset's value of a preprocessing ``key`` or its documented default."""
    if key not in PREPROCESSING_KEYS:
        raise KeyError(key)
    value = data_cfg.get(key, PREPROCESSING_KEYS[key])
    if isinstance(PREPROCESSING_KEYS[key], dict):
        return {**PREPROCESSING_KEYS[key], **(value or {})}
    return value


def _files(value: Any) -> tuple[str, ...]:
    return tuple(str(v) for v in value) if isinstance(value, (list, tuple)) else (str(value),)


def describe_files(value: Any) -> str:
    """A file (or a list of modality files) as a user reads it in an error message."""
    files = _files(value)
    return f"'{files[0]}'" if len(files) == 1 else "[" + ", ".join(f"'{f}'" for f in files) + "]"


def reader_for(value: Any):
    """The MONAI reader for a file's type (all files of a multi-file image must share it); None: no reader of ours."""
    names = [f.lower() for f in _files(value)]
    if all(n.endswith(NIFTI_SUFFIXES) for n in names):
        return NibabelReader()
    if all(n.endswith(PIL_SUFFIXES) for n in names):
        return PILReader(reverse_indexing=False)
    return None


class LoadPair(Transform):
    """Load a datalist entry's image (and label, when the entry has one) channel-first, and check it.

    Checks, each a DataError naming the file and what the preset expects: the number of spatial
    dimensions (``spatial_dims``: 2 for images, 3 for volumes; a 2D image stored with a trailing
    singleton axis is accepted as 2D), the image's channel count (``channels``, after
    ``channel_indices``), a single-channel label of the image's spatial shape and affine (1e-2 tolerance),
    real finite values (complex, empty, NaN or inf arrays are refused, never cast). Before anything is decoded,
    each file's header is checked against ``limits`` (:class:`medflare.data.limits.Limits`, the preset's
    ``data.max_voxels`` / ``data.max_bytes``), so a small file that decompresses to gigabytes is refused by its
    header. MONAI readers are picked by file type (:func:`reader_for`). Outputs MetaTensors (affine, spacing,
    applied operations) so that later transforms can be inverted.
    """

    def __init__(self, spatial_dims: int, channels: int | None = None, channel_indices: Sequence[int] | None = None,
                 kind: str = "datalist", limits: Limits | None = None) -> None:
        self.spatial_dims = spatial_dims
        self.channels = channels
        self.channel_indices = list(channel_indices) if channel_indices is not None else None
        self.kind = kind
        self.limits = limits or Limits.from_config({})
        self._load = LoadImage(image_only=True)
        self._first = EnsureChannelFirst()

    def read(self, value: Any, what: str) -> MetaTensor:
        """One image or label file (or list of channel files) channel-first; a DataError names the file."""
        reader = reader_for(value)
        if reader is None:
            raise DataError(f"cannot read {what} {describe_files(value)}: not a NIfTI ({', '.join(NIFTI_SUFFIXES)}) or "
                            f"{'/'.join(s.lstrip('.').upper() for s in PIL_SUFFIXES)} file (all channel files of one image "
                            "in one of these formats)")
        try:
            headers = [stored_header(f) for f in _files(value)]
            check_stored_size(headers, f"{what} {describe_files(value)}", self.limits)
            # MONAI would cast a complex volume to float, dropping its imaginary part
            if any(dtype.kind not in "uifb" for _, dtype in headers):
                raise DataError(f"{what} {describe_files(value)} has dtype {headers[0][1]}; expected real-valued intensities")
            img = self._load(_files(value) if isinstance(value, (list, tuple)) else str(value), reader=reader)
            img = self._first(img)
        except DataError:
            raise
        except Exception as exc:  # noqa: BLE001 - any reader failure is a bad file for the operator
            raise DataError(f"cannot read {what} {describe_files(value)}: {first_line(exc)}") from exc
        if 0 in img.shape:
            raise DataError(f"{what} {describe_files(value)} is empty (channel-first shape {tuple(img.shape)})")
        if img.is_floating_point() and not bool(torch.isfinite(img).all()):
            raise DataError(f"{what} {describe_files(value)} holds NaN or inf values")
        # a 2D image stored as (H, W, 1) (NIfTI) is a 2D image
        while self.spatial_dims == 2 and img.ndim == 4 and img.shape[-1] == 1:
            img = img[..., 0]
        return img

    def _wrong_dims(self, value: Any, img: torch.Tensor) -> DataError:
        found = img.ndim - 1
        what = {2: "a 2D image", 3: "a 3D volume"}.get(found, f"a {found}D array")
        if self.spatial_dims == 2:
            hint = "; volumes train with preset 'seg_volumes_2d' (slices) or 'seg_volumes_3d'"
        else:
            hint = "; 2D images train with preset 'seg_datalist' or 'seg_images_2d'"
        return DataError(
            f"image {describe_files(value)} is {what} (channel-first shape {tuple(img.shape)}) but data kind "
            f"'{self.kind}' expects {self.spatial_dims}D {'volumes' if self.spatial_dims == 3 else 'images'}{hint}"
        )

    def __call__(self, entry: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(entry)
        image = self.read(entry["image"], "image")
        if image.ndim - 1 != self.spatial_dims:
            raise self._wrong_dims(entry["image"], image)
        if self.channel_indices is not None:
            if max(self.channel_indices) >= image.shape[0]:
                raise DataError(
                    f"image {describe_files(entry['image'])} has {image.shape[0]} channel(s); config key "
                    f"'data.channel_indices' {self.channel_indices} asks for more"
                )
            image = image[self.channel_indices]
        if self.channels is not None and image.shape[0] != self.channels:
            raise DataError(
                f"image {describe_files(entry['image'])} has {image.shape[0]} channel(s) but the preset expects "
                f"{self.channels} (config key 'data.channels'; pick channels with 'data.channel_indices')"
            )
        out["image"] = image.float()
        if entry.get("label") is not None:
            label = self.read(entry["label"], "label")
            if label.shape[0] != 1 or label.shape[1:] != image.shape[1:]:
                raise DataError(
                    f"image {describe_files(entry['image'])} has shape {tuple(image.shape)} but label "
                    f"{describe_files(entry['label'])} has shape {tuple(label.shape)}; expected a (C, *spatial) "
                    f"image and a (1, *spatial) label of the same spatial size"
                )
            if not torch.allclose(label.affine.double(), image.affine.double(), atol=1e-2):
                raise DataError(
                    f"label {describe_files(entry['label'])} lies elsewhere than image {describe_files(entry['image'])}: "
                    f"their affines differ ({label.affine.numpy().round(3).tolist()} vs "
                    f"{image.affine.numpy().round(3).tolist()}); the label must be on the image's voxel grid"
                )
            out["label"] = label
        return out


def first_line(exc: BaseException) -> str:
    """The first line of what a library raised (of its cause, when it wrapped one), for a one-line DataError."""
    cause = exc.__cause__ or exc
    text = str(cause).strip().splitlines()
    return text[0] if text else type(cause).__name__


class CheckLabels(Transform):
    """Labels must be integers in [0, num_classes) after mapping: a DataError names the label file."""

    def __init__(self, num_classes: int) -> None:
        self.num_classes = num_classes

    def __call__(self, data: Mapping[str, Any]) -> Mapping[str, Any]:
        if "label" not in data:
            return data
        label = torch.as_tensor(data["label"])
        lo, hi = float(label.min()), float(label.max())
        if not torch.equal(torch.round(label), label) or lo < 0 or hi >= self.num_classes:
            name = data.get("src_label", "?")
            raise DataError(
                f"label {describe_files(name)} has values in [{lo:g}, {hi:g}], expected integers in [0, {self.num_classes})"
                " (config key 'data.labels' maps stored values, e.g. 'foreground' or [0, 1, 2, 4])"
            )
        return data


class CheckSize(Transform):
    """Every image of a site must reach the model's input size, or a DataError at load names the file.

    ``size`` (H, W) is the size every item must have: a preset's ``data.image_size`` where the images are used as
    stored (the synthetic kinds: generated at that size); ``None`` (a datalist preset without ``image_size``)
    takes the first image checked as the site's size. A site shares one instance over its splits, so a 1x1 image
    in a 32x32 site is named at load instead of failing every round in the data loader ("stack expects each
    tensor to be equal size", no file named). ``why`` says where the size comes from.
    """

    def __init__(self, size: Sequence[int] | None = None, why: str = "") -> None:
        self.size = tuple(size) if size is not None else None
        self.why = why
        self.first: str | None = None

    def __call__(self, data: Mapping[str, Any]) -> Mapping[str, Any]:
        image = data["image"]
        shape, source = tuple(int(s) for s in image.shape[1:]), _source(image, data)
        if self.size is None:
            self.size, self.first = shape, source
        if shape != self.size:
            why = self.why or (f"the site's first image {describe_files(self.first)} is {_side(self.size)} and images are "
                               "used as stored (config key 'data.image_size' resizes them)")
            raise DataError(f"image {describe_files(source)} is {_side(shape)}, but {why}")
        return data


def _side(shape: Sequence[int]) -> str:
    return " x ".join(str(s) for s in shape)


def _source(image: Any, data: Mapping[str, Any]) -> Any:
    """The file(s) an image was read from (its MetaTensor's ``filename_or_obj``), else its item name."""
    meta = getattr(image, "meta", None) or {}
    return meta.get("filename_or_obj") or data.get("name", "?")


class ToItem(Transform):
    """MetaTensors -> the plain-tensor item every job takes: image float32, label int (uint8 when ``compact``).

    ``spacing`` adds the physical pixel/voxel size in mm (float32, one entry per spatial axis), read from
    the affine after every geometric transform.
    """

    def __init__(self, spacing: bool = False, compact: bool = False) -> None:
        self.spacing, self.compact = spacing, compact

    def __call__(self, data: Mapping[str, Any]) -> dict[str, Any]:
        image = data["image"]
        out: dict[str, Any] = {"image": _plain(image).float().contiguous(), "name": data["name"]}
        if "label" in data:
            label = torch.round(_plain(data["label"]))
            out["label"] = label.to(torch.uint8 if self.compact else torch.int64).contiguous()
        if self.spacing:
            pixdim = image.pixdim if isinstance(image, MetaTensor) else torch.ones(image.ndim - 1)
            out["spacing"] = torch.as_tensor(pixdim, dtype=torch.float32)[: image.ndim - 1].clone()
        return out


def _plain(t: Any) -> torch.Tensor:
    return t.as_tensor() if isinstance(t, MetaTensor) else torch.as_tensor(t)


class Named(Transform):
    """Add ``name`` (the image's file name) and ``src_label`` (for error messages) to an entry."""

    def __call__(self, entry: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(entry)
        out["name"] = os.path.basename(_files(entry["image"])[0])
        out["src_label"] = entry.get("label")
        return out


def _keys(data_has_label: bool) -> list[str]:
    return ["image", "label"] if data_has_label else ["image"]


def label_transforms(data_cfg: Mapping[str, Any], num_classes: int) -> list:
    """Stored label values -> classes 0..num_classes-1 (``data.labels``), then the range check."""
    mode = setting(data_cfg, "labels")
    out: list = []
    if isinstance(mode, (list, tuple)):
        if len(mode) != num_classes:
            raise ConfigError(f"config key 'data.labels' lists {len(mode)} values but data.num_classes is {num_classes}")
        out.append(MapLabelValued("label", orig_labels=list(mode), target_labels=list(range(num_classes)),
                                  allow_missing_keys=True))
    elif mode not in LABEL_MODES:
        raise ConfigError(f"config key 'data.labels' is {mode!r}; expected one of {list(LABEL_MODES)} or a list of values")
    elif mode == "foreground" or (mode == "auto" and num_classes == 2):
        if num_classes != 2:
            raise ConfigError(f"config key 'data.labels' 'foreground' makes 2 classes but data.num_classes is {num_classes}")
        out.append(AsDiscreted("label", threshold=0.5, allow_missing_keys=True))
    out.append(CheckLabels(num_classes))
    return out


def intensity_transforms(data_cfg: Mapping[str, Any]) -> list:
    """``data.intensity`` as a MONAI transform on the image."""
    mode = setting(data_cfg, "intensity")
    if mode == "minmax":
        return [ScaleIntensityd("image", minv=0.0, maxv=1.0)]
    if mode == "percentile":
        lower, upper = (float(v) for v in setting(data_cfg, "percentiles"))
        if not 0 <= lower < upper <= 100:
            raise ConfigError(f"config key 'data.percentiles' must be [lower, upper] with 0 <= lower < upper <= 100, got {[lower, upper]}")
        return [ScaleIntensityRangePercentilesd("image", lower, upper, b_min=0.0, b_max=1.0, clip=True, channel_wise=True)]
    if mode == "zscore":
        return [NormalizeIntensityd("image", nonzero=True, channel_wise=True)]
    if mode == "ct_window":
        lo, hi = (float(v) for v in setting(data_cfg, "window"))
        if not lo < hi:
            raise ConfigError(f"config key 'data.window' must be [low, high] Hounsfield units with low < high, got {[lo, hi]}")
        return [ScaleIntensityRanged("image", a_min=lo, a_max=hi, b_min=0.0, b_max=1.0, clip=True)]
    if mode == "none":
        return []
    raise ConfigError(f"config key 'data.intensity' is {mode!r}; expected one of {list(INTENSITY_MODES)}")


def geometry_transforms(data_cfg: Mapping[str, Any], has_label: bool) -> list:
    """Volumes: reorientation (``data.orientation``) and resampling to ``data.spacing`` mm (labels nearest)."""
    keys = _keys(has_label)
    out: list = []
    axcodes = setting(data_cfg, "orientation")
    if axcodes:
        if not isinstance(axcodes, str) or len(axcodes) != 3 or set(axcodes.upper()) - set("LRAPSI"):
            raise ConfigError(f"config key 'data.orientation' must be three of L/R, A/P, S/I such as 'RAS', got {axcodes!r}")
        out.append(Orientationd(keys, axcodes=axcodes.upper(), labels=None))
    spacing = setting(data_cfg, "spacing")
    if spacing is not None:
        if not isinstance(spacing, (list, tuple)) or len(spacing) != 3 or not all(float(s) > 0 for s in spacing):
            raise ConfigError(f"config key 'data.spacing' must be three positive voxel sizes in mm, got {spacing!r}")
        out.append(Spacingd(keys, pixdim=[float(s) for s in spacing], mode=("bilinear", "nearest")[: len(keys)]))
    return out


def fit_transforms(data_cfg: Mapping[str, Any], has_label: bool, size: Sequence[int] | None) -> list:
    """Bring images to the model's ``size`` (``-1`` keeps an axis): resize (labels nearest) or centre pad/crop."""
    if size is None:
        return []
    keys = _keys(has_label)
    fit = setting(data_cfg, "fit")
    if fit == "resize":
        return [Resized(keys, spatial_size=list(size), mode=("bilinear", "nearest")[: len(keys)],
                        anti_aliasing=(True, False)[: len(keys)])]
    if fit == "pad_crop":
        return [ResizeWithPadOrCropd(keys, spatial_size=list(size))]
    raise ConfigError(f"config key 'data.fit' is {fit!r}; expected one of {list(FIT_MODES)}")


def check_image_size(data_cfg: Mapping[str, Any]) -> list[int] | None:
    """``data.image_size`` as two positive ints within ``data.max_voxels`` (every image is resized to it), or None."""
    size = setting(data_cfg, "image_size")
    if size is None:
        return None
    if isinstance(size, int) and not isinstance(size, bool):
        size = [size, size]
    if not isinstance(size, (list, tuple)) or len(size) != 2 or not all(
            isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in size):
        raise ConfigError(f"config key 'data.image_size' must be [height, width] (positive ints), got {size!r}")
    Limits.from_config(data_cfg).check_size(size, "data.image_size")
    return list(size)


def preprocess(data_cfg: Mapping[str, Any], *, spatial_dims: int, num_classes: int, has_label: bool = True,
               size: Sequence[int] | None = None, kind: str = "datalist") -> list:
    """The deterministic chain up to (not including) :class:`ToItem`: entry -> MetaTensors in the model's grid.

    Kept as MetaTensors with their applied operations so that :class:`monai.transforms.Invertd` can map a
    prediction back onto the stored image's grid (``medflare predict``).
    """
    channels = setting(data_cfg, "channels")
    indices = setting(data_cfg, "channel_indices")
    if indices is not None and (not isinstance(indices, (list, tuple)) or not indices or
                                not all(isinstance(i, int) and i >= 0 for i in indices)):
        raise ConfigError(f"config key 'data.channel_indices' must be a non-empty list of channel numbers, got {indices!r}")
    chain: list = [Named(), LoadPair(spatial_dims, channels, indices, kind, Limits.from_config(data_cfg))]
    if has_label:
        chain += label_transforms(data_cfg, num_classes)
    if spatial_dims == 3:
        chain += geometry_transforms(data_cfg, has_label)
    chain += intensity_transforms(data_cfg)
    chain += fit_transforms(data_cfg, has_label, size)
    return chain


def augmentation(data_cfg: Mapping[str, Any], spatial_dims: int, axes: Sequence[int] | None = None) -> list:
    """Training-time augmentation on plain-tensor items: flips, in-plane rotation, intensity and contrast jitter.

    ``data.augment``: ``flip`` (probability per spatial axis), ``rotate`` (max degrees, in-plane),
    ``intensity`` (max relative scale and shift), ``contrast`` (gamma in [1 - c, 1 + c]); ``prob`` is the
    probability of each of rotation, intensity and contrast. ``axes`` are the spatial axes to flip
    (default all).
    """
    aug = setting(data_cfg, "augment")
    unknown = set(aug) - set(PREPROCESSING_KEYS["augment"])
    if unknown:
        raise ConfigError(f"unknown config key(s) {sorted('data.augment.' + k for k in unknown)} "
                          f"(known: {sorted(PREPROCESSING_KEYS['augment'])})")
    keys = ["image", "label"]
    prob, out = float(aug["prob"]), []
    if float(aug["flip"]) > 0:
        out += [RandFlipd(keys, prob=float(aug["flip"]), spatial_axis=a) for a in (axes if axes is not None else range(spatial_dims))]
    if float(aug["rotate"]) > 0 and prob > 0:
        angle = math.radians(float(aug["rotate"]))
        rng = {"range_x": angle} if spatial_dims == 2 else {"range_z": angle}
        out.append(RandRotated(keys, prob=prob, mode=("bilinear", "nearest"), padding_mode="zeros", **rng))
    if float(aug["intensity"]) > 0 and prob > 0:
        f = float(aug["intensity"])
        out += [RandScaleIntensityd("image", factors=f, prob=prob), RandShiftIntensityd("image", offsets=f, prob=prob)]
    if float(aug["contrast"]) > 0 and prob > 0:
        c = float(aug["contrast"])
        out.append(RandAdjustContrastd("image", gamma=(max(0.5, 1 - c), 1 + c), prob=prob))
    return out


class Augment(Transform, RandomizableTrait):
    """Apply MONAI random transforms to a plain-tensor item and restore the item's dtypes (label int64).

    A ``RandomizableTrait``: MONAI's caching datasets cache what comes before it, never its output.
    """

    def __init__(self, transforms: list, seed: int = 0) -> None:
        self.chain = Compose(transforms) if transforms else None
        if self.chain is not None:
            self.chain.set_random_state(seed=seed)

    def __call__(self, item: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(item)
        if self.chain is not None:
            moved = self.chain({"image": item["image"], "label": item["label"].float()})
            out["image"] = _plain(moved["image"]).float().contiguous()
            out["label"] = torch.round(_plain(moved["label"])).to(torch.int64).contiguous()
        else:
            out["label"] = item["label"].to(torch.int64)
        return out
