"""What a person looks at in TensorBoard to judge the generator: a real image, a synthetic one, its label map."""

from __future__ import annotations

import numpy as np
import torch

from medflare.metrics import overlay_image


def synthetic_panel(real: torch.Tensor, synthetic: torch.Tensor, label: torch.Tensor) -> np.ndarray:
    """real (C,H,W) | synthetic (C,H,W) | synthetic with its conditioning label map (1,H,W) overlaid -> uint8 (3, H, 3W).

    ``real`` is one of the site's own images (its own style), ``synthetic`` was drawn from the site's label map
    ``label`` in another site's style: the structures should sit where the label says, the look be the other site's.
    """
    width = label.shape[-1]
    left = overlay_image(real, label, label)[:, :, :width]
    right = overlay_image(synthetic, label, label)[:, :, : 2 * width]
    return np.concatenate([left, right], axis=2)
