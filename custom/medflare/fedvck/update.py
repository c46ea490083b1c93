"""The server's global-model update on the condensed sets (FedVCK Eq. 12-16), one round at a time.

Given the condensed images the server keeps (the last ``keep_rounds`` rounds of every site), the sites'
logit prototypes and class counts of this round, and the global model as it starts the round:

1. global logit prototypes (Eq. 12) and feature prototypes of the condensed images of *earlier* rounds,
   embedded by the model at the start of the round (Eq. 14); hard negatives among the classes that have a
   feature prototype (Eq. 13);
2. ``server_steps`` SGD steps (momentum, weight decay; lr / 10 after half the steps, as the reference's
   StepLR) on L_ce + beta * L_rc (Eq. 15-16) over random batches of the kept images, each image under its
   own random differentiable augmentation; the projector h is trained with the model and kept across rounds.

Round 0 has no earlier condensed images, so no feature prototypes and no L_rc (as in the reference).
The reference computes L_rc on the un-augmented batch in a second forward pass; we take the features of the
augmented batch from the one forward pass that feeds L_ce (half the cost on a CPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from medflare import MedflareError
from medflare.fedvck.augment import DiffAugment
from medflare.fedvck.contrastive import Projector, relation_mask, relational_contrastive_loss
from medflare.fedvck.prototypes import feature_prototypes, hard_negatives


@dataclass
class UpdateStats:
    """Mean losses of one round's update and the relation sets it used."""

    steps: int = 0
    ce: float = math.nan
    rc: float = math.nan
    total: float = math.nan
    hard_negatives: dict[int, list[int]] = field(default_factory=dict)


@torch.no_grad()
def embed(model: nn.Module, images: torch.Tensor, device: torch.device | str = "cpu", batch_size: int = 512) -> torch.Tensor:
    """``model.features`` of (M, C, H, W) images in eval mode -> (M, D) on ``device``."""
    model.eval()
    return torch.cat([model.features(images[i : i + batch_size].to(device)) for i in range(0, len(images), batch_size)])


def relation_for_round(
    model: nn.Module, earlier_images: torch.Tensor, earlier_labels: torch.Tensor, global_logit_protos: torch.Tensor,
    class_counts: torch.Tensor, num_classes: int, top_k: int, device: torch.device | str = "cpu",
) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[int, list[int]]]:
    """Eq. 13-14 at the start of a round: (feature prototypes (C, D), relation mask (C, C), hard negatives),
    or (None, None, {}) when there are no earlier condensed images."""
    if not len(earlier_images):
        return None, None, {}
    protos, present = feature_prototypes(embed(model, earlier_images, device), earlier_labels.to(device), num_classes)
    available = present & (class_counts > 0)
    negs = hard_negatives(global_logit_protos, top_k, available)
    return protos, relation_mask(negs, num_classes), negs


def train_global(
    model: nn.Module,
    projector: Projector,
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    momentum: float,
    weight_decay: float,
    contrastive_weight: float = 0.0,
    temperature: float = 0.1,
    protos: torch.Tensor | None = None,
    relation: torch.Tensor | None = None,
    augment: DiffAugment | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    should_stop: Callable[[], bool] | None = None,
) -> UpdateStats:
    """``steps`` SGD steps of Eq. 16 on (M, C, H, W) ``images`` in [0, 1] with (M,) ``labels``; trains ``model``
    and (when L_rc is on) ``projector`` in place. L_rc needs ``protos`` and ``relation`` and weight > 0."""
    stats = UpdateStats()
    if steps <= 0 or not len(images):
        return stats
    use_rc = contrastive_weight > 0 and protos is not None and relation is not None
    params = list(model.parameters()) + (list(projector.parameters()) if use_rc else [])
    optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=max(1, steps // 2), gamma=0.1)
    model.train()
    projector.train()
    sums = {"ce": 0.0, "rc": 0.0, "total": 0.0}
    order = torch.randperm(len(images), generator=generator)
    pos = 0
    for step in range(steps):
        if should_stop is not None and should_stop():
            break
        if pos + batch_size > len(order) and pos > 0:
            order, pos = torch.randperm(len(images), generator=generator), 0
        idx = order[pos : pos + batch_size]
        pos += batch_size
        x, y = images[idx].to(device), labels[idx].to(device)
        if augment is not None and augment.enabled:
            x = augment.apply(x, augment.draw(len(x), generator))
        feats = model.features(x)
        ce = F.cross_entropy(model.classifier(feats), y)
        rc = relational_contrastive_loss(projector(feats), y, protos, relation, temperature) if use_rc and len(x) > 1 else ce.new_zeros(())
        loss = ce + contrastive_weight * rc
        if not torch.isfinite(loss):
            raise MedflareError(f"the server's update loss became {float(loss)} at step {step}; lower fedvck.server_lr")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        sums["ce"] += float(ce.detach())
        sums["rc"] += float(rc.detach())
        sums["total"] += float(loss.detach())
        stats.steps += 1
    if stats.steps:
        stats.ce, stats.rc, stats.total = (sums[k] / stats.steps for k in ("ce", "rc", "total"))
    model.eval()
    return stats


def kept_images(rounds: Mapping[int, list[tuple[torch.Tensor, torch.Tensor]]], keep_rounds: int, before: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The condensed images and labels of the last ``keep_rounds`` rounds (0 = all), optionally only rounds < ``before``.

    ``rounds`` maps a round to its list of (images (M, C, H, W) float, labels (M,)) of every site.
    """
    chosen = sorted(r for r in rounds if before is None or r < before)
    if keep_rounds:
        chosen = chosen[-keep_rounds:]
    parts = [p for r in chosen for p in rounds[r] if len(p[1])]
    if not parts:
        return torch.zeros(0), torch.zeros(0, dtype=torch.int64)
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
