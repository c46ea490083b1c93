"""VGG-11 model selector of FedSM, with a small head so that it fits on a laptop."""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from medflare import ConfigError
from medflare.common.checks import check_bool, check_dropout, check_positive_int

__all__ = ["VGG11_CFG", "SafeMaxPool2d", "VGG11Selector"]

#: VGG configuration "A" (VGG-11): conv widths, "M" = 2x2 max-pool.
VGG11_CFG: tuple[int | str, ...] = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


class SafeMaxPool2d(nn.Module):
    """2x2/stride-2 max-pool that passes its input through when a side is already < 2 px.

    Lets a five-pool VGG run on 28 px images (28 -> 14 -> 7 -> 3 -> 1 -> 1) instead of failing.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, C, H//2, W//2), or x itself when min(H, W) < 2."""
        if min(x.shape[-2:]) < 2:
            return x
        return F.max_pool2d(x, kernel_size=2, stride=2)


class VGG11Selector(nn.Module):
    """FedSM model selector: VGG-11 (config A) conv stack, adaptive average pool to 1x1, small MLP head.

    The selector classifies which site an image comes from. The FedSM reference uses torchvision's
    VGG-11 with a 7x7 pool and a 4096-wide head: 128.8M params (about 0.5 GB of fp32 weights, plus
    the same again for each Adam moment that FedSM ships to the server), which runs a 24 GB machine
    out of memory with a handful of simulated sites. Here the conv widths are scaled by ``width``,
    the features are pooled to 1x1 (any image size works; pools that would go below 1x1 are skipped),
    and the head is ``Linear(c, head_width)-ReLU-Dropout-Linear(head_width, num_classes)``: about
    0.6M params at the defaults.

    Args:
        in_channels: number of image channels. Required.
        num_classes: number of outputs (for FedSM: the number of sites). Required.
        width: multiplier of the VGG-11 conv widths (64..512); 1.0 is the reference. Defaults to 0.25.
        head_width: hidden width of the classifier head (reference: 4096). Defaults to 128.
        batch_norm: BatchNorm after every conv. Defaults to False, like the reference.
        dropout: dropout probability in the head. Defaults to 0.5 (torchvision's VGG).
    """

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        width: float = 0.25,
        head_width: int = 128,
        batch_norm: bool = False,
        dropout: float = 0.5,
    ) -> None:
        super().__init__()
        for key, value in (("in_channels", in_channels), ("num_classes", num_classes), ("head_width", head_width)):
            check_positive_int("vgg11_selector", key, value)
        if not isinstance(width, (int, float)) or isinstance(width, bool) or not 0 < width <= 4:
            raise ConfigError(f"vgg11_selector: 'width' must be a number in (0, 4], got {width!r}")
        check_bool("vgg11_selector", "batch_norm", batch_norm)
        check_dropout("vgg11_selector", dropout)
        layers: list[nn.Module] = []
        channels = in_channels
        for item in VGG11_CFG:
            if item == "M":
                layers.append(SafeMaxPool2d())
                continue
            out = max(1, int(round(int(item) * width)))
            layers.append(nn.Conv2d(channels, out, kernel_size=3, padding=1))
            if batch_norm:
                layers.append(nn.BatchNorm2d(out))
            layers.append(nn.ReLU(inplace=True))
            channels = out
        self.encoder = nn.Sequential(*layers)
        self.feature_dim = channels
        self.classifier = nn.Sequential(
            nn.Linear(channels, head_width), nn.ReLU(inplace=True), nn.Dropout(dropout), nn.Linear(head_width, num_classes)
        )

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Pooled embedding: (B, in_channels, H, W) -> (B, feature_dim)."""
        return torch.flatten(F.adaptive_avg_pool2d(self.encoder(x), 1), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits: (B, in_channels, H, W) -> (B, num_classes)."""
        return self.classifier(self.features(x))
