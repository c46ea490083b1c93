"""Latent distribution constraints (FedVCK Eq. 4): embed the synthetic batch with the real batch's BN statistics.

While a batch of real images passes the encoder, every BatchNorm layer records the batch mean and (biased)
variance it normalises with; the synthetic batch is then normalised at every BN layer with those recorded,
fixed statistics instead of its own. So the synthetic images must reproduce the real data's intermediate
feature distributions layer by layer to match the final features, not only the last embedding (no extra
loss term, unlike DeepInversion). Neither pass touches the network's running statistics or its mode:
the encoder is the received global model, which a site never changes.

``mode="own"`` normalises each batch with its own statistics (train-mode BN without running-stat updates):
vanilla distribution matching, the ablation "w/o latent constraints".

The reference code approximates Eq. 4 by a train-mode pass of the real batch (which moves the running
statistics 10 % towards the real batch) and an eval-mode pass of the synthetic batch (running statistics);
here the synthetic batch uses exactly the real batch's statistics, as Eq. 4 states.
"""

from __future__ import annotations

import contextlib
import types
from typing import Iterator

import torch
from torch import nn

from medflare import ConfigError
from medflare.nets.batchnorm import batch_statistics, bn_layers

MODES = ("record", "replay", "own")


class BNStatistics:
    """The per-layer (mean, var) recorded from one real batch; ``layers[i]`` belongs to ``bn_layers(model)[i]``."""

    def __init__(self) -> None:
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []


@contextlib.contextmanager
def bn_statistics(model: nn.Module, mode: str, stats: BNStatistics | None = None) -> Iterator[BNStatistics]:
    """Within the block every BN layer of ``model`` normalises by ``mode``:

    - "record": with the current batch's statistics, stored (detached) in the yielded ``BNStatistics``;
    - "replay": with the statistics of ``stats`` (recorded earlier, one forward pass, same layers);
    - "own": with the current batch's statistics, nothing stored.

    The layers' affine weights apply as usual (gradients flow to the input); running statistics, the
    ``training`` flag and ``num_batches_tracked`` are left as they were.
    """
    if mode not in MODES:
        raise ConfigError(f"bn_statistics: unknown mode '{mode}' (known: {list(MODES)})")
    layers = bn_layers(model)
    if mode == "replay" and (stats is None or len(stats.layers) != len(layers)):
        have = None if stats is None else len(stats.layers)
        raise ConfigError(f"bn_statistics: replay needs statistics of {len(layers)} BN layers, got {have}")
    out = stats if mode == "replay" else BNStatistics()
    originals = []
    calls = [0]

    def forward(bn: nn.modules.batchnorm._BatchNorm, x: torch.Tensor) -> torch.Tensor:
        i = calls[0] % len(layers)  # replay: each further forward pass reuses the same statistics
        calls[0] += 1
        if mode == "record" and calls[0] > len(layers):
            raise ConfigError("bn_statistics: record the statistics of one forward pass per block")
        if mode == "replay":
            mean, var = out.layers[i]
        else:
            mean, var = batch_statistics(x)
            if mode == "record":
                out.layers.append((mean.detach(), var.detach()))
        shape = [1, -1] + [1] * (x.ndim - 2)
        y = (x - mean.view(shape)) / torch.sqrt(var.view(shape) + bn.eps)
        return y * bn.weight.view(shape) + bn.bias.view(shape) if bn.affine else y

    try:
        for bn in layers:
            originals.append(bn.forward)
            bn.forward = types.MethodType(forward, bn)
        yield out
    finally:
        for bn, original in zip(layers, originals):
            bn.forward = original
