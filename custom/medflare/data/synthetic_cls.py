"""Embedded synthetic classification sites: 10 shape/texture classes, Dirichlet label skew over K sites.

Classes are patterns, not intensities: 0 horizontal grating, 1 vertical grating, 2 diagonal grating,
3 ring, 4 filled blob, 5 plus-cross, 6 x-cross, 7 pair of blobs, 8 square outline, 9 checkerboard,
each at a random position, scale and small rotation, over a textured background. Every image is then
normalised to a random mean and contrast, so no single pixel statistic (mean, std, one pixel) tells
the class; a small ConvNet needs real training. The pool (about 6000 images at ``scale=1.0``) is dealt
to ``site-1`` .. ``site-K`` by :func:`medflare.data.partition.dirichlet_label_skew` and, with
``style_shift``, each site gets its own contrast, brightness and noise level. Each site is written as a
MedMNIST-layout ``.npz`` (uint8 images, (N, 1) labels) split 70/15/15 into train/val/test.
"""

from __future__ import annotations

import os
import pathlib

import numpy as np

from medflare import DataError
from medflare.data.partition import dirichlet_label_skew
from medflare.data.util import stable_seed

CLASS_NAMES = (
    "grating-h", "grating-v", "grating-d", "ring", "blob", "plus", "cross", "blob-pair", "square", "checker",
)
POOL_SIZE = 6000


def _pattern(cls: int, rng: np.random.Generator, size: int) -> np.ndarray:
    """Class ``cls``'s foreground (H, W) in [0, 1] at a random position, scale and small rotation."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64)
    cy, cx = rng.uniform(0.35, 0.65, size=2) * size
    r = rng.uniform(0.22, 0.36) * size
    th = rng.normal(0.0, 0.15)
    dy, dx = yy - cy, xx - cx
    u = (dx * np.cos(th) + dy * np.sin(th)) / r
    v = (-dx * np.sin(th) + dy * np.cos(th)) / r
    rad = np.hypot(u, v)
    edge = 1.0 / (r / 1.2)  # about a pixel, in units of r
    soft = lambda d: 1.0 / (1.0 + np.exp(-d / edge))  # noqa: E731 - >0 inside, smooth over ~1 px
    window = soft(1.0 - rad)
    width = rng.uniform(0.18, 0.3)
    freq = rng.uniform(2.0, 3.0) * np.pi
    phase = rng.uniform(0, 2 * np.pi)
    if cls == 0:
        return window * (0.5 + 0.5 * np.cos(freq * v + phase))
    if cls == 1:
        return window * (0.5 + 0.5 * np.cos(freq * u + phase))
    if cls == 2:
        return window * (0.5 + 0.5 * np.cos(freq * (u + v) / np.sqrt(2) + phase))
    if cls == 3:
        return soft(width / 2 - np.abs(rad - 0.75))
    if cls == 4:
        return soft(rng.uniform(0.5, 0.8) - rad)
    if cls == 5:
        return window * np.maximum(soft(width / 2 - np.abs(u)), soft(width / 2 - np.abs(v)))
    if cls == 6:
        d1, d2 = np.abs(u + v) / np.sqrt(2), np.abs(u - v) / np.sqrt(2)
        return window * np.maximum(soft(width / 2 - d1), soft(width / 2 - d2))
    if cls == 7:
        ang = rng.uniform(0, np.pi)
        off = 0.55 * np.array([np.cos(ang), np.sin(ang)])
        r_blob = rng.uniform(0.3, 0.4)
        return np.maximum(soft(r_blob - np.hypot(u - off[0], v - off[1])), soft(r_blob - np.hypot(u + off[0], v + off[1])))
    if cls == 8:
        cheb = np.maximum(np.abs(u), np.abs(v))
        return soft(width / 2 - np.abs(cheb - 0.7))
    if cls == 9:
        cells = rng.uniform(0.35, 0.5)
        return window * (0.5 + 0.5 * np.sign(np.sin(np.pi * u / cells) * np.sin(np.pi * v / cells)))
    raise DataError(f"synthetic_cls: class {cls} outside 0..{len(CLASS_NAMES) - 1}")


def render_image(cls: int, rng: np.random.Generator, size: int) -> np.ndarray:
    """One image (H, W) float64 in [0, 1] of class ``cls``, normalised to a random mean and contrast."""
    img = _pattern(cls, rng, size) * rng.uniform(0.6, 1.0)
    img = img + 0.15 * rng.standard_normal((size, size))
    z = (img - img.mean()) / (img.std() + 1e-8)
    return np.clip(rng.uniform(0.35, 0.65) + rng.uniform(0.08, 0.18) * z, 0.0, 1.0)


def site_style(site: str, seed: int) -> dict[str, float]:
    """A classification site's acquisition shift: contrast factor, brightness offset, noise std."""
    rng = np.random.default_rng(stable_seed("cls-style", seed, site))
    return {"contrast": rng.uniform(0.6, 1.4), "brightness": rng.uniform(-0.15, 0.15), "noise": rng.uniform(0.0, 0.08)}


def _split3(n: int) -> tuple[int, int]:
    """Cut points of a 70/15/15 train/val/test split of n >= 3 samples (val and test never empty)."""
    n_val = max(1, round(0.15 * n))
    n_test = max(1, round(0.15 * n))
    return n - n_val - n_test, n - n_test


def make_cls_sites(
    out_dir: str | os.PathLike,
    *,
    num_sites: int = 10,
    beta: float = 0.1,
    image_size: int = 28,
    channels: int = 1,
    num_classes: int = 10,
    style_shift: bool = True,
    seed: int = 0,
    scale: float = 1.0,
) -> dict[str, pathlib.Path]:
    """Generate the pool, deal it to ``site-1`` .. ``site-<num_sites>``, write ``out_dir/<site>.npz``.

    Deterministic in all arguments. Returns {site name: npz path}.
    """
    if not 2 <= num_classes <= len(CLASS_NAMES):
        raise DataError(f"synthetic_cls: num_classes must be in 2..{len(CLASS_NAMES)}, got {num_classes}")
    if channels not in (1, 3):
        raise DataError(f"synthetic_cls: channels must be 1 or 3, got {channels}")
    if image_size < 16:
        raise DataError(f"synthetic_cls: image_size must be >= 16, got {image_size}")
    min_per_site = 10
    n = max(int(round(POOL_SIZE * scale)), num_sites * min_per_site)
    rng = np.random.default_rng(stable_seed("cls-pool", seed, image_size, num_classes, n))
    labels = rng.permutation(np.arange(n) % num_classes)
    images = np.stack([render_image(int(c), rng, image_size) for c in labels])  # (N, H, W)
    if channels == 3:  # a random tint per image: colour carries no class information
        images = images[..., None] * rng.uniform(0.6, 1.0, size=(n, 1, 1, 3))
    parts = dirichlet_label_skew(labels, num_sites, beta, seed=seed, min_per_site=min_per_site)

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for k, idx in enumerate(parts, start=1):
        site = f"site-{k}"
        site_rng = np.random.default_rng(stable_seed("cls-site", seed, site, n))
        idx = site_rng.permutation(idx)
        x = images[idx]
        if style_shift:
            st = site_style(site, seed)
            x = 0.5 + st["contrast"] * (x - 0.5) + st["brightness"] + st["noise"] * site_rng.standard_normal(x.shape)
        x = np.round(np.clip(x, 0.0, 1.0) * 255).astype(np.uint8)
        y = labels[idx].astype(np.uint8)[:, None]
        a, b = _split3(len(idx))
        paths[site] = out_dir / f"{site}.npz"
        np.savez_compressed(
            paths[site],
            train_images=x[:a], train_labels=y[:a], val_images=x[a:b], val_labels=y[a:b],
            test_images=x[b:], test_labels=y[b:],
        )
    return paths
