"""Classification metric: top-1 accuracy."""

from __future__ import annotations

import torch

from medflare import MedflareError

__all__ = ["accuracy", "to_class_labels"]


def to_class_labels(logits_or_pred: torch.Tensor) -> torch.Tensor:
    """(B, num_classes) logits -> (B,) argmax labels; (B,) or (B, 1) labels pass through as int64."""
    x = torch.as_tensor(logits_or_pred).detach()
    if x.ndim == 2 and x.shape[1] > 1:
        return x.argmax(dim=1)
    if x.ndim == 2 and x.shape[1] == 1:
        x = x[:, 0]
    if x.ndim != 1:
        raise MedflareError(f"'logits_or_pred' must be (B, num_classes) logits or (B,) labels, got {tuple(x.shape)}")
    return x.long()


def accuracy(logits_or_pred: torch.Tensor, target: torch.Tensor) -> float:
    """Fraction of correct top-1 predictions: logits (B, num_classes) or labels (B,) vs target (B,) -> float.

    nan for an empty batch.
    """
    pred = to_class_labels(logits_or_pred).cpu()
    target = torch.as_tensor(target).detach().cpu().reshape(-1).long()
    if pred.shape != target.shape:
        raise MedflareError(f"'target' has {target.numel()} labels but the prediction has {pred.numel()}")
    if target.numel() == 0:
        return float("nan")
    return float((pred == target).float().mean())
