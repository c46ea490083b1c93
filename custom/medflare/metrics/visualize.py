"""Side-by-side image | ground truth | prediction panels and image grids for TensorBoard image summaries."""

from __future__ import annotations

import numpy as np
import torch

from medflare import MedflareError

__all__ = ["PALETTE", "image_grid", "overlay_image"]

#: RGB colour of each foreground class (class k uses PALETTE[(k - 1) % len(PALETTE)]).
PALETTE = np.array(
    [[230, 25, 75], [60, 180, 75], [0, 130, 200], [255, 225, 25], [145, 30, 180], [70, 240, 240], [245, 130, 48]],
    dtype=np.float32,
)


def _to_numpy(x: torch.Tensor | np.ndarray) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _as_2d(x: torch.Tensor | np.ndarray, key: str) -> np.ndarray:
    arr = _to_numpy(x)
    if arr.ndim == 3 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 2:
        raise MedflareError(f"overlay_image: '{key}' must be (1, H, W) or (H, W), got shape {arr.shape}")
    return arr


def overlay_image(
    image: torch.Tensor | np.ndarray,
    label: torch.Tensor | np.ndarray,
    pred: torch.Tensor | np.ndarray,
    alpha: float = 0.5,
) -> np.ndarray:
    """Image, ground-truth overlay and prediction overlay side by side: (1,H,W) x3 -> uint8 (3, H, 3W).

    ``image`` may also be (3, H, W) RGB or (C, H, W) (first channel shown); ``label``/``pred`` are
    (1, H, W) or (H, W). The image is min-max scaled to 0..255; each foreground class of ``label``/``pred`` (int
    label maps) is blended in its PALETTE colour with opacity ``alpha``. CHW, ready for
    ``SummaryWriter.add_image(tag, panel, dataformats="CHW")``.
    """
    img = _to_numpy(image).astype(np.float32)
    if img.ndim == 3 and img.shape[0] == 3:
        img = img.transpose(1, 2, 0)  # RGB image: (H, W, 3)
    elif img.ndim == 3:
        img = img[0]  # grey (or first channel of a multi-channel image)
    if img.ndim not in (2, 3):
        raise MedflareError(f"overlay_image: 'image' must be (C, H, W) or (H, W), got shape {img.shape}")
    lab, prd = _as_2d(label, "label"), _as_2d(pred, "pred")
    if not img.shape[:2] == lab.shape == prd.shape:
        raise MedflareError(f"overlay_image: shapes differ: image {img.shape}, label {lab.shape}, pred {prd.shape}")
    lo, hi = float(np.nanmin(img)), float(np.nanmax(img))
    scaled = np.nan_to_num(np.zeros_like(img) if hi <= lo else (img - lo) / (hi - lo) * 255.0)
    base = scaled if scaled.ndim == 3 else np.repeat(scaled[..., None], 3, axis=-1)

    def blend(mask: np.ndarray) -> np.ndarray:
        out = base.copy()
        mask = np.rint(mask).astype(np.int64)
        fg = mask > 0
        colours = PALETTE[(mask[fg] - 1) % len(PALETTE)]
        out[fg] = (1 - alpha) * out[fg] + alpha * colours
        return out

    panel = np.concatenate([base, blend(lab), blend(prd)], axis=1)  # (H, 3W, 3)
    return np.clip(np.rint(panel), 0, 255).astype(np.uint8).transpose(2, 0, 1)


def image_grid(images: torch.Tensor | np.ndarray, columns: int = 8, pad: int = 1) -> np.ndarray:
    """(N, C, H, W) images (uint8, or floats in [0, 1]) tiled row by row, ``columns`` per row, ``pad`` white pixels
    between them: uint8 (3, rows*(H+pad)-pad, cols*(W+pad)-pad), CHW like :func:`overlay_image` (grey images repeated
    to RGB, RGB kept, other channel counts shown by their first channel)."""
    arr = _to_numpy(images)
    if arr.ndim != 4 or not len(arr):
        raise MedflareError(f"image_grid: images must be a non-empty (N, C, H, W) array, got shape {arr.shape}")
    if arr.dtype != np.uint8:
        arr = np.rint(np.clip(arr.astype(np.float32), 0.0, 1.0) * 255).astype(np.uint8)
    arr = arr if arr.shape[1] == 3 else np.repeat(arr[:, :1], 3, axis=1)
    n, _, h, w = arr.shape
    cols = max(1, min(columns, n))
    rows = -(-n // cols)
    grid = np.full((3, rows * (h + pad) - pad, cols * (w + pad) - pad), 255, dtype=np.uint8)
    for i in range(n):
        r, c = divmod(i, cols)
        grid[:, r * (h + pad) : r * (h + pad) + h, c * (w + pad) : c * (w + pad) + w] = arr[i]
    return grid
