"""FedSM-extra (paper Sec. 3.1.2): Eq. 1 labels and the federated training of the selector head on them.

Eq. 1: ``y_s = one_hot(argmin_k L(y, h_k))`` over {global (k = 0), personalised models (k = 1..K)}; the paper
writes ``L(h, h_k)`` with h standing for the ground truth. In the extra rounds the segmentation models no
longer change, so a site computes its labels once; the head (a linear layer on the selector's
standardised features, K + 1 outputs) is trained like the paper's selector, by cross-entropy against these
labels, one step per extra round:

- each site returns one full-batch gradient-descent step with learning rate 1 on its own cases
  (:func:`head_gradient_step`, a WEIGHT_DIFF, so a site's privacy filters see it);
- the server averages the steps n_k-weighted, which is exactly minus the gradient of the mean
  cross-entropy over all sites' cases, and applies Adam to it on the server (:class:`HeadAdam`; FedOpt,
  Reddi et al. 2021, the paper's ref. [40]).

This is centralised full-batch Adam on the union of the sites' labelled features, whatever the label skew
between sites; the reference instead syncs each site's Adam moments through the server, which ships
optimiser state that privacy filters were not built for. Plain torch, no FLARE.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from medflare import MedflareError, PayloadError

HEAD_KEYS = ("head.weight", "head.bias")


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


def head_gradient_step(weight: torch.Tensor, bias: torch.Tensor, inputs: torch.Tensor, labels: torch.Tensor) -> dict[str, np.ndarray]:
    """Minus the gradient of the mean cross-entropy of ``inputs @ weight.T + bias`` against ``labels``.

    weight (C, d), bias (C,), inputs (N, d), labels (N,) in 0..C-1 -> ``{"head.weight", "head.bias"}`` float32
    arrays: the update of one full-batch gradient step with learning rate 1.
    """
    if inputs.ndim != 2 or labels.shape != (inputs.shape[0],) or inputs.shape[0] < 1:
        raise MedflareError(f"head_gradient_step: need inputs (N, d) and labels (N,), got {tuple(inputs.shape)} and {tuple(labels.shape)}")
    w = weight.detach().float().clone().requires_grad_(True)
    b = bias.detach().float().clone().requires_grad_(True)
    with torch.enable_grad():
        loss = nn.functional.cross_entropy(inputs.float() @ w.T + b, labels.long())
        gw, gb = torch.autograd.grad(loss, (w, b))
    return {"head.weight": (-gw).numpy(), "head.bias": (-gb).numpy()}


class HeadAdam:
    """Server-side Adam on the head from the sites' averaged steps (see the module docstring).

    Args:
        head: the selector's ``nn.Linear`` head, updated in place.
        lr: Adam learning rate. Default 0.05 (standardised inputs, a linear head).
    """

    def __init__(self, head: nn.Linear, lr: float = 0.05):
        if not lr > 0:
            raise MedflareError(f"HeadAdam: 'lr' must be > 0, got {lr}")
        self.head = head
        self.opt = torch.optim.Adam([head.weight, head.bias], lr=lr)

    def step(self, steps: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]) -> None:
        """Apply Adam to minus the ``weights``-weighted mean of the sites' steps (:func:`head_gradient_step` outputs)."""
        if not steps:
            return
        for s in steps:
            missing = [k for k in HEAD_KEYS if k not in s]
            if missing:
                raise PayloadError(f"a FedSM-extra head update lacks {missing}")
        w = torch.as_tensor(weights, dtype=torch.float64)
        w = w / w.sum()
        for param, key in zip((self.head.weight, self.head.bias), HEAD_KEYS):
            mean = sum(wi * torch.as_tensor(np.asarray(s[key]), dtype=torch.float64) for wi, s in zip(w, steps))
            if mean.shape != param.shape:
                raise PayloadError(f"a FedSM-extra head update '{key}' has shape {tuple(mean.shape)}, expected {tuple(param.shape)}")
            param.grad = (-mean).to(param.dtype)
        with torch.no_grad():
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
