"""Small hospital-like data sets written to disk for tests and benchmarks: NIfTI volumes and RGB photographs.

Not the embedded synthetic default (that is :mod:`medflare.data.synthetic_seg`): these exercise what real
sites store and the default never does: 3D volumes with anisotropic voxels in an orientation other than
RAS, several channels, MSD ``dataset.json`` files with unlabeled test images, and colour images of
different sizes. Each case holds one ellipsoid (label 1, brighter than its surroundings, with a second
label 2 core when ``classes`` is 3) on a noisy background with a dimmer distractor blob.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import nibabel as nib
import numpy as np

from medflare.data.util import stable_seed

#: voxel-to-world matrices of the volumes: an anisotropic LPS-like grid with permuted axes (so that
#: reorientation to RAS changes the array) and a plain RAS grid
ORIENTED = np.array([[0.0, 0.0, -3.0, 40.0], [-0.8, 0.0, 0.0, 20.0], [0.0, 0.9, 0.0, -10.0], [0.0, 0.0, 0.0, 1.0]])


def _ellipsoid(shape: Sequence[int], centre, radii) -> np.ndarray:
    grids = np.meshgrid(*[np.arange(s, dtype=np.float32) for s in shape], indexing="ij")
    return sum(((g - c) / r) ** 2 for g, c, r in zip(grids, centre, radii)) <= 1.0


def make_case(shape: Sequence[int], rng: np.random.Generator, classes: int = 2, channels: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """One image (``shape`` or ``shape + (channels,)``, float32) and its label map (uint8) in array space."""
    shape = tuple(shape)
    radii = [rng.uniform(0.18, 0.3) * s for s in shape]
    centre = [rng.uniform(r + 1, s - r - 1) for r, s in zip(radii, shape)]
    obj = _ellipsoid(shape, centre, radii)
    label = obj.astype(np.uint8)
    if classes == 3:
        label[_ellipsoid(shape, centre, [r * 0.5 for r in radii])] = 2
    distractor = _ellipsoid(shape, [rng.uniform(0, s) for s in shape], [0.12 * s for s in shape]) & ~obj
    base = 200.0 + 150.0 * obj + 60.0 * distractor + 80.0 * (label == 2)
    images = [base * rng.uniform(0.8, 1.2) + rng.normal(0, 25.0, shape) for _ in range(channels)]
    image = np.stack(images, -1) if channels > 1 else images[0]
    return image.astype(np.float32), label


def write_volume_site(folder: str | Path, n_cases: int = 6, *, shape: Sequence[int] = (24, 20, 10),
                      affine: np.ndarray = ORIENTED, classes: int = 2, channels: int = 1, msd: bool = False,
                      n_unlabeled: int = 1, seed: int = 0, datalist: str | Path | None = None) -> Path:
    """NIfTI volumes under ``folder`` and a datalist (``msd``: an MSD ``dataset.json`` with only training + unlabeled test).

    Without ``msd`` the cases are split half training, a quarter each validation and testing (at least one
    each). The datalist is written to ``datalist`` (default ``folder/site.json``; paths relative to it).
    Returns the datalist path.
    """
    folder = Path(folder)
    path = Path(datalist) if datalist is not None else folder / "site.json"
    path.parent.mkdir(parents=True, exist_ok=True)

    def rel(name: str) -> str:
        return os.path.relpath(folder / name, path.parent)

    (folder / "imagesTr").mkdir(parents=True, exist_ok=True)
    (folder / "labelsTr").mkdir(exist_ok=True)
    rng = np.random.default_rng(stable_seed("volumes", seed, str(shape), channels))
    entries = []
    for i in range(n_cases):
        image, label = make_case(shape, rng, classes, channels)
        img, lbl = f"imagesTr/case_{i:03d}.nii.gz", f"labelsTr/case_{i:03d}.nii.gz"
        nib.save(nib.Nifti1Image(image, affine), folder / img)
        nib.save(nib.Nifti1Image(label, affine), folder / lbl)
        entries.append({"image": rel(img), "label": rel(lbl)})
    if msd:
        (folder / "imagesTs").mkdir(exist_ok=True)
        test = []
        for i in range(n_unlabeled):
            image, _ = make_case(shape, rng, classes, channels)
            nib.save(nib.Nifti1Image(image, affine), folder / f"imagesTs/case_{100 + i:03d}.nii.gz")
            test.append(rel(f"imagesTs/case_{100 + i:03d}.nii.gz"))
        content = {"name": "toy", "tensorImageSize": "4D" if channels > 1 else "3D",
                   "labels": {str(k): f"class {k}" for k in range(classes)}, "numTraining": n_cases,
                   "numTest": n_unlabeled, "training": entries, "test": test}
    else:
        n_val = n_test = max(1, n_cases // 4)
        content = {"training": entries[: n_cases - n_val - n_test], "validation": entries[n_cases - n_val - n_test: n_cases - n_test],
                   "testing": entries[n_cases - n_test:]}
    path.write_text(json.dumps(content, indent=1))
    return path


def write_rgb_site(folder: str | Path, sizes: Sequence[tuple[int, int]], *, classes: int = 2, seed: int = 0,
                   mask_values: Sequence[int] | None = None, layout: str = "images_masks") -> Path:
    """Colour photographs (JPEG-free PNG, varied ``sizes`` (H, W)) with masks, as a fundus folder holds them.

    ``layout`` "images_masks": ``images/<id>.png`` and ``masks/<id>_mask.png``. Mask values are
    ``mask_values[k]`` for class k (default 0, 255 for two classes). Returns the folder.
    """
    from PIL import Image

    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    (folder / "masks").mkdir(exist_ok=True)
    values = list(mask_values) if mask_values is not None else ([0, 255] if classes == 2 else list(range(classes)))
    rng = np.random.default_rng(stable_seed("rgb", seed))
    for i, (h, w) in enumerate(sizes):
        grey, label = make_case((h, w), rng, classes)
        grey = (grey - grey.min()) / (grey.max() - grey.min())
        rgb = np.stack([0.6 + 0.4 * grey, 0.2 + 0.6 * grey, 0.1 + 0.3 * grey], -1)
        Image.fromarray((rgb * 255).astype(np.uint8)).save(folder / "images" / f"img_{i:02d}.png")
        Image.fromarray(np.asarray(values, np.uint8)[label]).save(folder / "masks" / f"img_{i:02d}_mask.png")
    return folder
