"""Model-guided knowledge selection (FedVCK Eq. 5-8): condense more from the images the global model gets wrong.

Each round, every local training image x_i gets an importance from the prediction error of the
self-ensemble of the current and the previous global model (Eq. 7)::

    err_i = CE(y_i, alpha * softmax(M_t(x_i)) + (1 - alpha) * softmax(M_{t-1}(x_i)))
    w_i   = sigmoid(err_i - b)                                                  (Eq. 5)
    P_w(x_i) = w_i / sum_{j: y_j = y_i} w_j                                     (Eq. 8, within the class)

and each condensation step draws its real batch of class c from P_w (with replacement), so the expectation
in the condensation loss becomes the P_w-weighted one of Eq. 10.

Choices where the paper is silent: the ensemble mixes the two models' *probabilities* (the usual meaning of
an ensemble; CE of the mixture), and P_w is normalised within each class because the real batches of Eq. 9
are drawn per class (normalising over all images, as Eq. 8 is printed, gives the same within-class
proportions). The reference code samples by softmax(w) instead of w / sum(w); we follow the paper.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from medflare import ConfigError


def ensemble_error(logits_now: torch.Tensor, logits_prev: torch.Tensor, labels: torch.Tensor, alpha: float) -> torch.Tensor:
    """Eq. 7 per image: (N, C), (N, C), (N,) -> (N,) cross-entropy of the probability mixture."""
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"fedvck.alpha must lie in [0, 1], got {alpha}")
    probs = alpha * F.softmax(logits_now, dim=1) + (1 - alpha) * F.softmax(logits_prev, dim=1)
    picked = probs.gather(1, labels.view(-1, 1).long()).squeeze(1)
    return -torch.log(picked.clamp_min(torch.finfo(probs.dtype).tiny))


def importance_weights(err: torch.Tensor, b: float) -> torch.Tensor:
    """Eq. 5: w = 1 / (1 + exp(-err + b)) per image."""
    return torch.sigmoid(err - b)


def class_probabilities(weights: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Eq. 8 within each class: (N,), (N,) -> (N,) with sum over each class = 1."""
    probs = torch.zeros_like(weights, dtype=torch.float64)
    for c in torch.unique(labels).tolist():
        mask = labels == c
        w = weights[mask].double()
        probs[mask] = w / w.sum() if w.sum() > 0 else torch.full_like(w, 1.0 / len(w))
    return probs


class ImportanceSampler:
    """Draws real batches per class by P_w (or uniformly), for the condensation steps of one round.

    Args:
        labels: (N,) class of every local training image.
        weights: (N,) importance w of Eq. 5, or None for uniform sampling (the "w/o P_w" ablation).
    """

    def __init__(self, labels: torch.Tensor, weights: torch.Tensor | None = None):
        self.labels = labels.long().cpu()
        weights = torch.ones(len(self.labels)) if weights is None else weights.detach().cpu()
        self.probs = class_probabilities(weights, self.labels)
        self.index = {int(c): torch.nonzero(self.labels == c).flatten() for c in torch.unique(self.labels).tolist()}

    def sample(self, c: int, k: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``k`` indices (into the N images) of class ``c`` drawn i.i.d. from P_w restricted to the class."""
        idx = self.index[int(c)]
        draw = torch.multinomial(self.probs[idx].float(), k, replacement=True, generator=generator)
        return idx[draw]
