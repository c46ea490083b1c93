"""FedST's segmentation objective, Eq. 3: L_Seg = L_LDS + lambda * L_CDS.

Plain torch, no FLARE. Both terms are the same loss (focal + Dice, MONAI's ``FocalLoss`` with softmax and
``DiceLoss``: ``make_loss("dicefocal")``), once on the site's real training images (local domain, LDS) and
once on synthetic images that another domain's generator drew from the site's own label maps (cross
domain, CDS). ``lambda`` weighs how much the segmentation model learns from the other domains' styles.

:class:`CrossDomainTerm` is the ``extra_loss`` hook of :func:`medflare.common.training.train_epochs`: each
optimiser step on a real batch (L_LDS) adds lambda * L_CDS on the next synthetic batch, so the shared
training loop runs Eq. 3 unchanged.
"""

from __future__ import annotations

from typing import Callable, Iterator, Mapping

import torch

from medflare import ConfigError

SegLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def check_lambda(lam: float) -> float:
    """lambda of Eq. 3 as a float >= 0 (0 = FedAvg on real images only); ConfigError otherwise."""
    if not isinstance(lam, (int, float)) or isinstance(lam, bool) or lam < 0:
        raise ConfigError(f"'cds_lambda' (lambda of Eq. 3) must be a number >= 0, got {lam!r}")
    return float(lam)


def segmentation_loss(loss_fn: SegLoss, real_logits: torch.Tensor, real_labels: torch.Tensor,
                      syn_logits: torch.Tensor | None, syn_labels: torch.Tensor | None, lam: float) -> torch.Tensor:
    """Eq. 3 on one real and one synthetic batch: logits (B, K, H, W), labels (B, 1, H, W) -> scalar.

    Without a synthetic batch (``syn_logits`` None) it is L_LDS alone.
    """
    lds = loss_fn(real_logits, real_labels)
    if syn_logits is None or lam == 0:
        return lds
    return lds + lam * loss_fn(syn_logits, syn_labels)


class CrossDomainTerm:
    """``extra_loss(model)`` adding lambda * L_CDS on the next synthetic batch ``{"image", "label"}``.

    ``values`` records each L_CDS (unweighted) for logging.
    """

    def __init__(self, loss_fn: SegLoss, batches: Iterator[Mapping[str, torch.Tensor]], lam: float, device: torch.device | str = "cpu"):
        self.loss_fn, self.batches, self.lam, self.device = loss_fn, batches, check_lambda(lam), device
        self.values: list[float] = []

    def __call__(self, model: torch.nn.Module) -> torch.Tensor:
        batch = next(self.batches)
        value = self.loss_fn(model(batch["image"].to(self.device)), batch["label"].to(self.device))
        self.values.append(float(value.detach()))
        return self.lam * value

    @property
    def mean(self) -> float:
        return float(sum(self.values) / len(self.values)) if self.values else float("nan")
