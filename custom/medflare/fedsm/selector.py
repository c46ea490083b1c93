"""Model selectors for FedSM and the one builder the server, the sites and a saved super model share.

The default selector is :class:`StyleSelector`: the selector's task is to tell *which site an image comes
from*, i.e. its acquisition style (intensity, contrast, noise, blur, bias field), not its anatomy.
Per-channel mean, log-std and log mean |Laplacian| of the image plus mean and log-std of a few random
convolutions' feature maps separate the synthetic sites linearly. In the FedSM job the body is never
trained (random init, seeded by the server): only the linear head is fitted, on the server, from the
sites' feature statistics (:mod:`.calibrate`); training the selector federated stays at chance
(benchmarks/fedsm_selector_sync.py). The paper's VGG-11 (``vgg11_selector`` in :mod:`medflare.nets`)
is still built by name but cannot be calibrated (its head is an MLP).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from medflare import ConfigError
from medflare.nets import build_model


class StyleSelector(nn.Module):
    """Small site classifier: ``depth`` conv3x3-ReLU blocks (stride 2 after the first), then per-channel
    mean, log standard deviation (and, of the image, log mean |Laplacian|) over the image, then a linear layer.
    No normalisation layer: batch or instance norm would remove exactly the intensity statistics the
    selector needs.

    Args:
        in_channels: image channels. Required.
        num_classes: outputs (sites, or sites + 1 for FedSM-extra). Required.
        width: channels of every conv. Default 16.
        depth: number of conv blocks. Default 3.
    """

    def __init__(self, in_channels: int, num_classes: int, width: int = 16, depth: int = 3):
        super().__init__()
        for key, value in (("in_channels", in_channels), ("num_classes", num_classes), ("width", width), ("depth", depth)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"style_selector: '{key}' must be a positive int, got {value!r}")
        layers: list[nn.Module] = []
        channels = in_channels
        for d in range(depth):
            layers += [nn.Conv2d(channels, width, 3, stride=1 if d == 0 else 2, padding=1), nn.ReLU(inplace=True)]
            channels = width
        self.encoder = nn.Sequential(*layers)
        self.classifier = nn.Linear(2 * width + 3 * in_channels, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, 2 * width + 3 * C): mean, log-std and log high-frequency energy (mean |Laplacian|:
        noise and blur) of the image, mean and log-std of the last feature maps.

        The log puts a noise level of 0.02 and one of 0.12 a fixed distance apart whatever their scale, so
        the linear layer separates styles after a few steps instead of growing large weights first.
        """
        f = self.encoder(x)
        lap = 4 * x[..., 1:-1, 1:-1] - x[..., 2:, 1:-1] - x[..., :-2, 1:-1] - x[..., 1:-1, 2:] - x[..., 1:-1, :-2]
        log = lambda t: torch.log(t + 1e-4)  # noqa: E731
        stats = [x.mean((2, 3)), log(x.std((2, 3))), log(lap.abs().mean((2, 3))), f.mean((2, 3)), log(f.std((2, 3)))]
        return torch.cat(stats, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits: (B, C, H, W) -> (B, num_classes)."""
        return self.classifier(self.features(x))


SELECTORS = {"style_selector": StyleSelector}


def build_selector(spec: Mapping[str, Any]) -> nn.Module:
    """``{"name", "args"}`` -> network: FedSM's own selectors by name, else any :func:`medflare.nets.build_model` name."""
    name, args = spec["name"], dict(spec.get("args", {}))
    if name in SELECTORS:
        return SELECTORS[name](**args)
    return build_model(name, **args)
