"""Prototypes and hard negatives (FedVCK Eq. 11-14).

- Eq. 11 (site): the logit prototype of class c is the mean logit vector of the received global model over the
  site's images of class c; the site sends it with the class count n_{c,k}.
- Eq. 12 (server): the global logit prototype is the count-weighted mean over sites.
- Eq. 13 (server): the hard negatives of c are the K classes j != c with the largest p_c[j], the classes the
  model confuses c with. We draw them among the classes that have a feature prototype (Eq. 14), since only
  those can enter Eq. 15; a class no site holds has no prototype and no hard negatives.
- Eq. 14 (server): the feature prototype of c is the mean embedding, by the global model at the start of the
  round, of every kept condensed image of class c from earlier rounds.
"""

from __future__ import annotations

from typing import Sequence

import torch

from medflare import PayloadError


def logit_prototypes(logits: torch.Tensor, labels: torch.Tensor, num_classes: int, classes: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 11: (N, C) logits and (N,) labels -> ((C, C) prototypes, (C,) counts).

    Row c is the mean logit of the images of class c, for c in ``classes`` (default: every class present);
    other rows are zero with count 0 (a class the site does not share).
    """
    labels = labels.long()
    wanted = set(torch.unique(labels).tolist() if classes is None else classes)
    protos = torch.zeros(num_classes, logits.shape[1], dtype=torch.float32)
    counts = torch.zeros(num_classes, dtype=torch.int64)
    for c in sorted(wanted):
        mask = labels == c
        if mask.any():
            protos[c] = logits[mask].float().mean(0).cpu()
            counts[c] = int(mask.sum())
    return protos, counts


def aggregate_prototypes(protos: Sequence[torch.Tensor], counts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 12: sites' (C, C) prototypes and (C,) counts -> global (C, C) prototypes and (C,) total counts.

    p_c = sum_k n_{c,k} p_{c,k} / sum_k n_{c,k}; rows of classes no site holds stay zero (total count 0).
    """
    if not protos or len(protos) != len(counts):
        raise PayloadError(f"aggregate_prototypes: need one count vector per prototype matrix, got {len(protos)} and {len(counts)}")
    shape = tuple(protos[0].shape)
    for i, (p, n) in enumerate(zip(protos, counts)):
        if tuple(p.shape) != shape or tuple(n.shape) != (shape[0],):
            raise PayloadError(f"aggregate_prototypes: site {i} sent prototypes {tuple(p.shape)} and counts {tuple(n.shape)}, expected {shape} and ({shape[0]},)")
        if (n < 0).any():
            raise PayloadError(f"aggregate_prototypes: site {i} sent negative class counts")
    n = torch.stack([torch.as_tensor(c, dtype=torch.float64) for c in counts])  # (K, C)
    p = torch.stack([torch.as_tensor(q, dtype=torch.float64) for q in protos])  # (K, C, C)
    total = n.sum(0)
    summed = (n.unsqueeze(-1) * p).sum(0)
    out = torch.where(total.unsqueeze(-1) > 0, summed / total.clamp_min(1).unsqueeze(-1), torch.zeros_like(summed))
    return out.float(), total.long()


def hard_negatives(global_protos: torch.Tensor, k: int, available: torch.Tensor | None = None) -> dict[int, list[int]]:
    """Eq. 13: {c: the (at most) k classes j != c with the largest p_c[j]} for every class with a prototype.

    ``available`` (C,) bool restricts both the classes c (rows) and the candidates j; default: every class
    whose prototype row is non-zero. Ties break towards the lower class index.
    """
    C = global_protos.shape[0]
    if available is None:
        available = global_protos.abs().sum(1) > 0
    out: dict[int, list[int]] = {}
    for c in range(C):
        if not available[c]:
            continue
        candidates = [j for j in range(C) if j != c and available[j]]
        ranked = sorted(candidates, key=lambda j: (-float(global_protos[c, j]), j))
        out[c] = ranked[:k]
    return out


def feature_prototypes(features: torch.Tensor, labels: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 14: (M, D) embeddings of condensed images and (M,) labels -> ((C, D) class means, (C,) bool has-one)."""
    protos = torch.zeros(num_classes, features.shape[1], dtype=features.dtype, device=features.device)
    present = torch.zeros(num_classes, dtype=torch.bool)
    for c in torch.unique(labels).tolist():
        protos[c] = features[labels == c].mean(0)
        present[c] = True
    return protos, present
