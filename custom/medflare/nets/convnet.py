"""ConvNet with BatchNorm from the dataset-condensation literature (the FedVCK encoder)."""

from __future__ import annotations

import torch
from torch import nn

from medflare import ConfigError
from medflare.checks import check_positive_int

__all__ = ["ConvNet"]


class ConvNet(nn.Module):
    """``depth`` blocks of conv3x3(``width``)-BatchNorm-ReLU-AvgPool2d(2), then one linear classifier.

    This is "ConvNetBN" of Dataset Condensation / Distribution Matching, used by FedVCK both as the
    condensation encoder and as the server model. FedVCK needs the embedding and the logits
    separately, so the model exposes :meth:`features` and :attr:`classifier`
    (``forward(x) == classifier(features(x))``).

    Args:
        in_channels: number of image channels. Required.
        num_classes: number of output classes. Required.
        image_size: side of the (square) input image; fixes the flattened feature size
            ``width * (s // 2**depth) ** 2`` after padding (28 -> 14 -> 7 -> 3: 1152 at width 128).
            Defaults to 28.
        width: channels of every conv layer. Defaults to 128.
        depth: number of conv blocks (each halves the spatial size, flooring). Defaults to 3.
        first_padding: zero padding of the first conv. Defaults to 1 ("same"). The DC/FedVCK
            reference code pads the first conv by 3 for 1-channel images (28 -> 32 px, hence its
            2048-wide embedding, ~318K params); pass 3 to reproduce that.
    """

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        image_size: int = 28,
        width: int = 128,
        depth: int = 3,
        first_padding: int = 1,
    ) -> None:
        super().__init__()
        for key, value in (("in_channels", in_channels), ("num_classes", num_classes), ("width", width), ("depth", depth)):
            check_positive_int("convnet", key, value)
        if not isinstance(first_padding, int) or first_padding < 0:
            raise ConfigError(f"convnet: 'first_padding' must be a non-negative int, got {first_padding!r}")
        size = image_size + 2 * first_padding - 2 if isinstance(image_size, int) else -1
        for _ in range(depth):
            size //= 2
        if not isinstance(image_size, int) or size < 1:
            raise ConfigError(
                f"convnet: 'image_size'={image_size!r} is too small for depth={depth} (feature map would be < 1x1)"
            )
        layers: list[nn.Module] = []
        channels = in_channels
        for d in range(depth):
            layers += [
                nn.Conv2d(channels, width, kernel_size=3, padding=first_padding if d == 0 else 1),
                nn.BatchNorm2d(width),
                nn.ReLU(inplace=True),
                nn.AvgPool2d(kernel_size=2, stride=2),
            ]
            channels = width
        self.encoder = nn.Sequential(*layers)
        self.image_size = image_size
        self.feature_dim = width * size * size
        self.classifier = nn.Linear(self.feature_dim, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Embedding before the classifier: (B, in_channels, S, S) -> (B, feature_dim)."""
        return torch.flatten(self.encoder(x), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits: (B, in_channels, S, S) -> (B, num_classes); S must equal ``image_size``."""
        return self.classifier(self.features(x))
