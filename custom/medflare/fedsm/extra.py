"""FedSM-extra selector labels (paper Eq. 1): for each case, the model with the lowest loss wins.

``y_s = one_hot(argmin_k L(y, h_k))`` over {global (k = 0), personalised models (k = 1..K)}; the paper
writes ``L(h, h_k)`` with h standing for the ground truth. Plain torch, no FLARE.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from medflare import MedflareError


def extra_labels(losses: torch.Tensor) -> torch.Tensor:
    """(M, B) per-case losses of M = K + 1 models (row 0 = global) -> (B,) long labels in 0..K (ties: lowest index)."""
    if losses.ndim != 2 or losses.shape[0] < 2:
        raise MedflareError(f"extra_labels: losses must be (K + 1, B) with K >= 1, got shape {tuple(losses.shape)}")
    return losses.argmin(dim=0)


@torch.no_grad()
def per_case_losses(
    models: Sequence[torch.nn.Module],
    image: torch.Tensor,
    label: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Loss of every model on every case: image (B, C, H, W), label (B, 1, H, W) -> (M, B).

    ``loss_fn`` is the segmentation training loss (mean over its batch), applied one case at a time.
    """
    rows = []
    for model in models:
        model.eval()
        logits = model(image)
        rows.append(torch.stack([loss_fn(logits[b : b + 1], label[b : b + 1]) for b in range(image.shape[0])]))
    return torch.stack(rows)
