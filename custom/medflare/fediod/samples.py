"""Generated samples as one TensorBoard image: a grid of G's outputs (segmentation: image | its label map overlaid)."""

from __future__ import annotations

import numpy as np
import torch

from medflare.metrics import image_grid, overlay_image


def sample_grid(images: torch.Tensor, labels: torch.Tensor | None = None, columns: int = 8) -> np.ndarray:
    """``images`` (N, C, H, W) in [0, 1] (first channel or RGB shown), ``labels`` (N, 1, H, W) or None ->
    uint8 (3, rows*H, columns*W') with W' = W, or 2W for an image | label-overlay pair (:func:`image_grid`, no padding)."""
    images = images.detach().cpu().float()
    if labels is None:
        return image_grid(images, columns, pad=0)
    pairs = [overlay_image(img, lab, lab)[:, :, : 2 * img.shape[-1]] for img, lab in zip(images, labels.cpu())]
    return image_grid(np.stack(pairs), columns, pad=0)
