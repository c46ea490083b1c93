"""Embedded synthetic segmentation sites: 2D fundus-like images of an optic disc and cup.

Each case shows an elliptic disc (label 1, the rim) holding a cup (label 2) on a textured background
crossed by dark vessel-like curves, with a few bright disc-like spots as distractors, so a threshold
does not segment it. Sites differ the way hospitals do, through a per-site *style*:

==========  ===================  ======  =====  ========  ======  ====  =====  ====  ======  =====  =====
site        family               invert  gamma  contrast  offset  bias  noise  blur  radius  ecc    cases
==========  ===================  ======  =====  ========  ======  ====  =====  ====  ======  =====  =====
site-1      bright-clean         no      1.0    1.0       0.00    0.10  0.02   0.5   0.16    1.00   240
site-2      inverted-ct          yes     0.7    1.2       0.00    0.30  0.05   0.0   0.13    1.35   60
site-3      hazy-low-contrast    no      1.5    0.5       0.20    0.40  0.03   1.5   0.20    1.10   120
site-4      noisy-small          no      0.8    0.9       -0.05   0.20  0.12   0.3   0.11    1.60   40
site-5      dark-biased          no      2.2    1.1       -0.05   0.60  0.04   1.0   0.18    0.70   180
site-6      inverted-blurred     yes     1.3    0.6       0.05    0.25  0.06   2.0   0.15    1.20   90
==========  ===================  ======  =====  ========  ======  ====  =====  ====  ======  =====  =====

``radius`` is the disc radius as a fraction of the image side, ``ecc`` the axis ratio of the disc
ellipse (1 = circle), ``blur`` a Gaussian sigma in pixels at 64 px (scaled with the image size), and
``cases`` the number of cases at ``scale=1.0`` (split 50/25/25 into training/validation/testing).
``site-<k>`` for k > 6 reuses family ``(k-1) % 6`` with a deterministic jitter; any other site name
draws its family and jitter from a SHA-256 hash of (seed, name). Sites of one family are therefore
closer to each other than to any other family, which is what the FedSM benchmark needs.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import nibabel as nib
import numpy as np
from scipy import ndimage
from skimage.draw import line as draw_line

from medflare import DataError
from medflare.data.util import stable_seed

#: The fixed style table for ``site-1`` .. ``site-6`` (see the module docstring).
STYLE_TABLE: tuple[dict[str, Any], ...] = (
    dict(family="bright-clean", invert=False, gamma=1.0, contrast=1.0, offset=0.00, bias=0.10, noise=0.02,
         blur=0.5, disc_radius=0.16, eccentricity=1.00, cup_ratio=0.45, vessels=4, n_cases=240),
    dict(family="inverted-ct", invert=True, gamma=0.7, contrast=1.2, offset=0.00, bias=0.30, noise=0.05,
         blur=0.0, disc_radius=0.13, eccentricity=1.35, cup_ratio=0.55, vessels=6, n_cases=60),
    dict(family="hazy-low-contrast", invert=False, gamma=1.5, contrast=0.5, offset=0.20, bias=0.40, noise=0.03,
         blur=1.5, disc_radius=0.20, eccentricity=1.10, cup_ratio=0.40, vessels=3, n_cases=120),
    dict(family="noisy-small", invert=False, gamma=0.8, contrast=0.9, offset=-0.05, bias=0.20, noise=0.12,
         blur=0.3, disc_radius=0.11, eccentricity=1.60, cup_ratio=0.60, vessels=5, n_cases=40),
    dict(family="dark-biased", invert=False, gamma=2.2, contrast=1.1, offset=-0.05, bias=0.60, noise=0.04,
         blur=1.0, disc_radius=0.18, eccentricity=0.70, cup_ratio=0.50, vessels=4, n_cases=180),
    dict(family="inverted-blurred", invert=True, gamma=1.3, contrast=0.6, offset=0.05, bias=0.25, noise=0.06,
         blur=2.0, disc_radius=0.15, eccentricity=1.20, cup_ratio=0.50, vessels=5, n_cases=90),
)
_JITTERED = ("gamma", "contrast", "bias", "noise", "blur", "disc_radius", "eccentricity", "cup_ratio", "n_cases")


def segmentation_style(site: str, seed: int = 0) -> dict[str, Any]:
    """The imaging style of ``site``: a row of :data:`STYLE_TABLE`, jittered unless it is site-1..site-6.

    Deterministic in (seed, site) across processes; the dict also records ``"jitter"`` (0 for table rows).
    """
    key = stable_seed("seg-style", seed, site)
    k = _site_index(site)
    if k is not None and k <= len(STYLE_TABLE):
        return dict(STYLE_TABLE[k - 1], jitter=0.0)
    family = (k - 1) % len(STYLE_TABLE) if k is not None else key % len(STYLE_TABLE)
    style = dict(STYLE_TABLE[family])
    rng = np.random.default_rng(key)
    jitter = 0.15
    for name in _JITTERED:
        style[name] = float(style[name] * (1.0 + jitter * rng.uniform(-1.0, 1.0)))
    style["offset"] = float(style["offset"] + 0.05 * rng.uniform(-1.0, 1.0))
    style["n_cases"] = int(round(style["n_cases"]))
    style["jitter"] = jitter
    return style


def _site_index(site: str) -> int | None:
    """k for a site named ``site-<k>`` (k >= 1), else None."""
    prefix, _, number = site.rpartition("-")
    return int(number) if prefix == "site" and number.isdigit() and int(number) >= 1 else None


def _ellipse_distance(yy: np.ndarray, xx: np.ndarray, cy: float, cx: float, a: float, b: float, theta: float) -> np.ndarray:
    """Normalised elliptic distance (H, W): < 1 inside the ellipse with semi-axes a, b rotated by theta."""
    dy, dx = yy - cy, xx - cx
    u = dx * np.cos(theta) + dy * np.sin(theta)
    v = -dx * np.sin(theta) + dy * np.cos(theta)
    return np.sqrt((u / a) ** 2 + (v / b) ** 2)


def _smooth_field(rng: np.random.Generator, size: int, sigma: float) -> np.ndarray:
    """A smooth random field (H, W) scaled to [-1, 1]: white noise low-passed by a Gaussian of ``sigma`` px."""
    field = ndimage.gaussian_filter(rng.standard_normal((size, size)), sigma, mode="reflect")
    return field / (np.abs(field).max() + 1e-8)


def _vessels(rng: np.random.Generator, size: int, cy: float, cx: float, count: int) -> np.ndarray:
    """Dark vessel-like curves (H, W) in [0, 1]: random walks leaving the disc centre, blurred to a width."""
    canvas = np.zeros((size, size), np.float64)
    step = max(1.0, size / 16)
    for _ in range(count):
        angle = rng.uniform(0, 2 * np.pi)
        y, x = cy, cx
        for _ in range(24):
            angle += rng.normal(0, 0.35)
            ny, nx = y + step * np.sin(angle), x + step * np.cos(angle)
            rr, cc = draw_line(int(round(y)), int(round(x)), int(round(ny)), int(round(nx)))
            keep = (rr >= 0) & (rr < size) & (cc >= 0) & (cc < size)
            canvas[rr[keep], cc[keep]] = 1.0
            y, x = ny, nx
            if not (0 <= y < size and 0 <= x < size):
                break
    canvas = ndimage.gaussian_filter(canvas, max(0.5, size / 96))
    return canvas / (canvas.max() + 1e-8)


def render_case(style: dict[str, Any], rng: np.random.Generator, size: int, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """One case of a site: image (H, W) float32 in [0, 1] and label (H, W) uint8 in [0, num_classes)."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64)
    cy, cx = rng.uniform(0.32, 0.68, size=2) * size
    radius = style["disc_radius"] * size * float(np.clip(1 + 0.12 * rng.standard_normal(), 0.7, 1.3))
    ecc = style["eccentricity"] * float(np.clip(1 + 0.08 * rng.standard_normal(), 0.8, 1.2))
    theta = rng.uniform(0, np.pi)
    a, b = radius * np.sqrt(ecc), radius / np.sqrt(ecc)
    d_disc = _ellipse_distance(yy, xx, cy, cx, a, b, theta)
    cup = style["cup_ratio"] * float(np.clip(1 + 0.1 * rng.standard_normal(), 0.75, 1.25))
    shift = rng.uniform(-0.15, 0.15, size=2) * radius
    d_cup = _ellipse_distance(yy, xx, cy + shift[0], cx + shift[1], a * cup, b * cup, theta + rng.normal(0, 0.2))

    disc_mask, cup_mask = d_disc < 1.0, (d_cup < 1.0) & (d_disc < 1.0)
    label = disc_mask.astype(np.uint8)
    if num_classes >= 3:
        label[cup_mask] = 2

    # anatomy: textured background, soft-edged disc and cup, bright distractor spots, dark vessels
    edge = max(0.6, size / 96)
    soft = lambda d, r: 1.0 / (1.0 + np.exp(-(1.0 - d) * r / edge))  # noqa: E731 - local one-liner
    img = 0.25 + 0.06 * rng.standard_normal() + 0.08 * _smooth_field(rng, size, size / 10)
    img = img + (0.40 + 0.05 * rng.standard_normal()) * soft(d_disc, radius)
    img = img + (0.25 + 0.05 * rng.standard_normal()) * soft(d_cup, radius * cup)
    for _ in range(rng.integers(1, 4)):  # exudate-like spots as bright as the rim, away from the disc
        sy, sx = rng.uniform(0.1, 0.9, size=2) * size
        r_spot = radius * rng.uniform(0.15, 0.35)
        img = img + rng.uniform(0.3, 0.45) * soft(_ellipse_distance(yy, xx, sy, sx, r_spot, r_spot, 0.0), r_spot)
    img = img - (0.25 + 0.05 * rng.standard_normal()) * _vessels(rng, size, cy, cx, style["vessels"])

    # the site's acquisition: blur, bias field, gamma, contrast/offset, inversion, noise
    if style["blur"] > 0:
        img = ndimage.gaussian_filter(img, style["blur"] * size / 64)
    img = np.clip(img, 0.0, 1.0) * (1.0 + style["bias"] * _smooth_field(rng, size, size / 4))
    img = np.clip(img, 0.0, 1.0) ** style["gamma"]
    img = 0.5 + style["contrast"] * (img - 0.5) + style["offset"]
    if style["invert"]:
        img = 1.0 - img
    img = img + style["noise"] * rng.standard_normal((size, size))
    return np.clip(img, 0.0, 1.0).astype(np.float32), label


def split_sizes(n: int) -> tuple[int, int, int]:
    """Training/validation/testing sizes for ``n`` cases (50/25/25, each at least 1 when n >= 3)."""
    n_train = n // 2
    n_val = (n - n_train) // 2
    return n_train, n_val, n - n_train - n_val


def make_seg_site(
    site: str,
    out_dir: str | os.PathLike,
    *,
    image_size: int = 64,
    num_classes: int = 3,
    seed: int = 0,
    scale: float = 1.0,
) -> pathlib.Path:
    """Write ``site``'s synthetic cases as NIfTI under ``out_dir/<site>/`` and return ``out_dir/<site>.json``.

    The datalist is MONAI Decathlon style with paths relative to the JSON, so the generated site is
    loaded by exactly the code that loads a hospital's datalist. Same (seed, site, params) gives
    identical arrays. Images are 2D (H, W) float32 NIfTI (loaded back as (1, H, W)); labels uint8.
    """
    if num_classes not in (2, 3):
        raise DataError(f"synthetic_seg: num_classes must be 2 (disc) or 3 (rim + cup), got {num_classes}")
    if image_size < 16:
        raise DataError(f"synthetic_seg: image_size must be >= 16, got {image_size}")
    if scale <= 0:
        raise DataError(f"synthetic_seg: scale must be > 0, got {scale}")
    out_dir = pathlib.Path(out_dir)
    style = segmentation_style(site, seed)
    n_cases = max(8, int(round(style["n_cases"] * scale)))
    case_dir = out_dir / site
    case_dir.mkdir(parents=True, exist_ok=True)
    site_key = stable_seed("seg-case", seed, site, image_size, num_classes)
    entries = []
    for i in range(n_cases):
        rng = np.random.default_rng([site_key, i])
        image, label = render_case(style, rng, image_size, num_classes)
        img_name, lbl_name = f"{site}_{i:04d}_img.nii.gz", f"{site}_{i:04d}_seg.nii.gz"
        nib.save(nib.Nifti1Image(image, np.eye(4)), case_dir / img_name)
        nib.save(nib.Nifti1Image(label, np.eye(4)), case_dir / lbl_name)
        entries.append({"image": f"{site}/{img_name}", "label": f"{site}/{lbl_name}"})
    n_train, n_val, _ = split_sizes(n_cases)
    datalist = {
        "name": f"medflare synthetic segmentation {site}",
        "description": f"style {style['family']}, seed {seed}, image_size {image_size}, scale {scale}",
        "labels": {"0": "background", "1": "disc" if num_classes == 2 else "rim", **({"2": "cup"} if num_classes == 3 else {})},
        "training": entries[:n_train],
        "validation": entries[n_train : n_train + n_val],
        "testing": entries[n_train + n_val :],
    }
    json_path = out_dir / f"{site}.json"
    json_path.write_text(json.dumps(datalist, indent=1))
    return json_path
