"""What a trained network's BatchNorm layers know about its training data, read without touching the network.

A BatchNorm layer's running mean and variance are the per-channel statistics of the features the network saw in
training. Two algorithms use them: FedVCK (Eq. 4) normalises synthetic images with a real batch's statistics
(:mod:`medflare.fedvck.latent`), and FedIOD's optional realism prior compares a generated batch's statistics with
a frozen teacher's running statistics (:func:`forward_with_bn_prior`).
"""

from __future__ import annotations

import torch
from torch import nn


def bn_layers(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """Every BatchNorm layer of ``model`` in forward-registration order."""
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def prior_layers(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The BatchNorm layers :func:`forward_with_bn_prior` reads: those that keep running statistics."""
    return [bn for bn in bn_layers(model) if bn.track_running_stats]


def batch_statistics(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and biased variance of a ``(B, C, *spatial)`` batch, as a BatchNorm layer computes them."""
    dims = [0, *range(2, x.ndim)]
    return x.mean(dim=dims), x.var(dim=dims, unbiased=False)


def forward_with_bn_prior(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(model(x), R)`` with the batch-statistics prior of DeepInversion (Yin et al., CVPR 2020, Eq. 3)

        R(x) = sum_l || mu_l(x) - running_mean_l ||_2 + || var_l(x) - running_var_l ||_2

    over the model's BatchNorm layers l, ``mu_l(x)`` / ``var_l(x)`` being the statistics of the batch's
    features at the layer's input. R is small when the batch's features are distributed like those the
    network was trained on, and differentiable in ``x``. The model is used as it is (eval mode: its
    outputs use the running statistics); its statistics and mode are not changed. A network without
    :func:`prior_layers` gives ``R = 0``. R couples the inputs of the batch (each input's gradient depends
    on the others).
    """
    terms: list[torch.Tensor] = []

    def hook(bn: nn.modules.batchnorm._BatchNorm, inputs: tuple[torch.Tensor, ...], _output: torch.Tensor) -> None:
        mean, var = batch_statistics(inputs[0])
        terms.append(torch.linalg.vector_norm(mean - bn.running_mean) + torch.linalg.vector_norm(var - bn.running_var))

    handles = [bn.register_forward_hook(hook) for bn in prior_layers(model)]
    try:
        out = model(x)
    finally:
        for h in handles:
            h.remove()
    prior = torch.stack(terms).sum() if terms else x.new_zeros(())
    return out, prior


__all__ = ["batch_statistics", "bn_layers", "forward_with_bn_prior", "prior_layers"]
