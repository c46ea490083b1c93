"""Generated samples as one TensorBoard image: a grid of G's outputs (segmentation: image | its label map overlaid)."""

from __future__ import annotations

import math

import numpy as np
import torch

from medflare.metrics import overlay_image


def sample_grid(images: torch.Tensor, labels: torch.Tensor | None = None, columns: int = 8) -> np.ndarray:
    """``images`` (N, C, H, W) in [0, 1] (first channel or RGB shown), ``labels`` (N, 1, H, W) or None ->
    uint8 (3, rows*H, columns*W') with W' = W, or 2W for an image | label-overlay pair."""
    tiles = []
    for i in range(images.shape[0]):
        img = images[i].detach().cpu().float()
        if labels is not None:
            tiles.append(overlay_image(img, labels[i].cpu(), labels[i].cpu())[:, :, : 2 * img.shape[-1]])
        else:
            rgb = img[:3] if img.shape[0] == 3 else img[:1].expand(3, -1, -1)
            tiles.append((rgb.clamp(0, 1) * 255).round().to(torch.uint8).numpy())
    columns = max(1, min(columns, len(tiles)))
    rows = math.ceil(len(tiles) / columns)
    c, h, w = tiles[0].shape
    grid = np.zeros((c, rows * h, columns * w), dtype=np.uint8)
    for i, tile in enumerate(tiles):
        r, col = divmod(i, columns)
        grid[:, r * h:(r + 1) * h, col * w:(col + 1) * w] = tile
    return grid
