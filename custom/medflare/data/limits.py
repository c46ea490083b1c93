"""Size limits on what a site reads, checked from file headers before anything is decoded.

A 390 KB ``.nii.gz`` can decompress to a 20000 x 20000 image (400 M voxels): decoding it first and checking
afterwards drove one site to 4.5-6.1 GB before anything refused it (issue 28). Every image file a loader reads
(NIfTI through nibabel's header, PNG/JPEG/BMP/TIFF through PIL's lazy ``Image.open``, which parses the header
only) is therefore sized from its header first and refused above the preset's limits:

* ``data.max_voxels``: elements of one image (all its channel files together), default 512 x 512 x 1024, which
  admits real CT/MR volumes (a 512 x 512 x 1000 CT) and refuses the bomb above;
* ``data.max_bytes``: its bytes once decompressed, as stored (default 2 GiB: a float64 512 x 512 x 1000 volume).

The same voxel limit bounds what the settings ask the loaders to make: ``data.image_size`` (2D presets resize
every image to it; a result file's stored settings may ask for 100000 x 100000) and the synthetic generators'
image size. The limits change no preprocessed item, so they are not part of a cache key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import nibabel as nib
import numpy as np

from medflare import ConfigError, DataError

#: the limit keys of a preset's ``data`` section, with their defaults
LIMIT_DEFAULTS: dict[str, int] = {"max_voxels": 512 * 512 * 1024, "max_bytes": 2 * 1024**3}

#: PIL image modes -> the element type they decode to (every other mode: one uint8 per band)
_PIL_DTYPES = {"I": np.int32, "F": np.float32, "I;16": np.uint16, "I;16B": np.uint16, "I;16L": np.uint16, "I;16N": np.uint16}


@dataclass(frozen=True)
class Limits:
    """The checked size limits of a preset: ``max_voxels`` elements and ``max_bytes`` decompressed bytes per image."""

    max_voxels: int
    max_bytes: int

    @classmethod
    def from_config(cls, data_cfg: Mapping[str, Any]) -> "Limits":
        """``data.max_voxels`` / ``data.max_bytes`` of a preset's data section (defaults :data:`LIMIT_DEFAULTS`)."""
        values = {}
        for key, default in LIMIT_DEFAULTS.items():
            value = data_cfg.get(key, default)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"config key 'data.{key}' must be a positive int, got {value!r}")
            values[key] = value
        return cls(**values)

    def check_size(self, shape: Sequence[int], key: str) -> None:
        """A size the settings ask for (``key``, e.g. 'data.image_size') must not exceed ``max_voxels``."""
        count = math.prod(int(s) for s in shape)
        if count > self.max_voxels:
            raise ConfigError(f"config key '{key}' asks for {' x '.join(str(int(s)) for s in shape)} = {count:,} voxels per "
                              f"image, above config key 'data.max_voxels' ({self.max_voxels:,})")


def stored_header(path: str) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, element dtype) of an image file as its header states them; nothing is decoded.

    NIfTI: the header's data shape and dtype; PIL formats: (height, width, bands) and the mode's element type.
    A file whose header cannot be read raises whatever nibabel or PIL raise (the caller names the file).
    """
    if path.lower().endswith((".nii", ".nii.gz")):
        header = nib.load(path).header
        return tuple(int(s) for s in header.get_data_shape()), np.dtype(header.get_data_dtype())
    from PIL import Image

    with Image.open(path) as img:  # lazy: parses the header, decodes nothing
        width, height = img.size
        return (int(height), int(width), len(img.getbands())), np.dtype(_PIL_DTYPES.get(img.mode, np.uint8))


def check_stored_size(headers: Sequence[tuple[tuple[int, ...], np.dtype]], name: str, limits: Limits) -> None:
    """Refuse an image whose channel files' ``headers`` (:func:`stored_header`) state more than ``limits`` allow.

    ``name`` says which image in the DataError ("image 'x.nii.gz'"), which also gives the stored shape and the
    config key that refused it.
    """
    voxels = sum(math.prod(shape) for shape, _ in headers)
    nbytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in headers)
    shape = " x ".join(str(s) for s in headers[0][0])
    if voxels > limits.max_voxels:
        raise DataError(f"{name} holds {shape} = {voxels:,} voxels, above config key 'data.max_voxels' "
                        f"({limits.max_voxels:,}); refused before decoding")
    if nbytes > limits.max_bytes:
        raise DataError(f"{name} holds {shape} voxels = {nbytes:,} bytes decompressed, above config key 'data.max_bytes' "
                        f"({limits.max_bytes:,}); refused before decoding")
