"""Relational supervised contrastive learning with prototypes (FedVCK Eq. 15-16) and its projector head.

Eq. 15, for a condensed image s_i of class c_i with projected, L2-normalised embedding z_i = h(psi(s_i)) and
L2-normalised feature prototypes f_c (Eq. 14)::

    L_rc(i) = -log( exp(z_i . f_{c_i} / tau) / sum_{c in {c_i} U HN(c_i)} exp(z_i . f_c / tau) )

and Eq. 16 adds it to the cross-entropy: L_update = L_ce + beta * L_rc (mean over the batch).

Deviations, both as the reference code does it: the denominator includes the positive class c_i (Eq. 15 as
printed sums over HN(c_i) only, which makes the loss unbounded below rather than a log-probability; the
reference forces c_i into the relation set), and Eq. 16 weighs L_rc by beta (``contrastive_weight``, 0.05-0.1
in the reference's runs; Eq. 16 as printed has beta = 1). Cosine similarities (both sides normalised) as in
the reference. Images whose class has no prototype or no hard negatives do not enter L_rc.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn


class Projector(nn.Module):
    """The learnable projector h of Eq. 15: Linear(dim, hidden) - BatchNorm - ReLU - Linear(hidden, dim) (SimSiam-style).

    Args:
        dim: embedding width of the encoder (input and output). Required.
        hidden: hidden width. Default 128 (reference).
    """

    def __init__(self, dim: int, hidden: int = 128):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, dim) -> (B, dim)."""
        return self.net(x)


def relation_mask(hard_negs: Mapping[int, Sequence[int]], num_classes: int) -> torch.Tensor:
    """(C, C) bool: row c marks {c} U HN(c), the classes of Eq. 15's denominator; all-False for a class without HN."""
    mask = torch.zeros(num_classes, num_classes, dtype=torch.bool)
    for c, negs in hard_negs.items():
        if negs:
            mask[c, c] = True
            mask[c, list(negs)] = True
    return mask


def relational_contrastive_loss(z: torch.Tensor, labels: torch.Tensor, protos: torch.Tensor, relation: torch.Tensor, temperature: float) -> torch.Tensor:
    """Eq. 15 averaged over the images that have a relation set: (B, D) projected embeddings, (B,) labels,
    (C, D) feature prototypes, (C, C) relation mask -> scalar (0 when no image qualifies)."""
    rows = relation.to(z.device)[labels]  # (B, C)
    valid = rows.any(1)
    if not valid.any():
        return z.sum() * 0.0
    sim = F.normalize(z, dim=1) @ F.normalize(protos.to(z), dim=1).t() / temperature  # (B, C)
    sim = sim[valid].masked_fill(~rows[valid], float("-inf"))
    pos = sim.gather(1, labels[valid].view(-1, 1)).squeeze(1)
    return (torch.logsumexp(sim, dim=1) - pos).mean()
