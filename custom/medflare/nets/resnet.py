"""Small ResNets for classification: CIFAR-style ResNet-8 (FedIOD) and MONAI's ResNet-18 with a CIFAR stem."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
import torch.nn.functional as F

from medflare import ConfigError
from medflare.checks import check_bool, check_positive_int as _check_positive

__all__ = ["BasicBlock", "ResNet8", "ResNet18"]


class BasicBlock(nn.Module):
    """Two conv3x3-BN layers with an identity (or 1x1 conv-BN projection) shortcut, then ReLU.

    Args:
        in_planes: input channels.
        planes: output channels.
        stride: stride of the first conv (and of the projection). Defaults to 1.
    """

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_planes, H, W) -> (B, planes, H/stride, W/stride)."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet8(nn.Module):
    """CIFAR-style ResNet-8: conv3x3-BN-ReLU, three stages of one BasicBlock (strides 1, 2, 2),
    global average pool, linear classifier. The FedIOD / MosaicKD teacher and student.

    Works for any input size (global pooling). Exposes :meth:`features` (the pooled embedding) and
    :attr:`classifier`, so ``forward(x) == classifier(features(x))``.

    Args:
        in_channels: number of image channels. Required.
        num_classes: number of output classes. Required.
        widths: channels of the three stages; the stem has ``widths[0]``. Defaults to (128, 256, 512)
            as in the FedIOD reference (~4.9M params); (16, 32, 64) gives the ~78K-param
            "resnet8" of the knowledge-distillation literature.
    """

    def __init__(self, in_channels: int, num_classes: int, widths: Sequence[int] = (128, 256, 512)) -> None:
        super().__init__()
        _check_positive("resnet8", "in_channels", in_channels)
        _check_positive("resnet8", "num_classes", num_classes)
        if not isinstance(widths, Sequence) or isinstance(widths, str) or len(widths) != 3:
            raise ConfigError(f"resnet8: 'widths' must be a list of 3 positive ints, got {widths!r}")
        for w in widths:
            _check_positive("resnet8", "widths", w)
        widths = [int(w) for w in widths]
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU(inplace=True)
        )
        self.layer1 = BasicBlock(widths[0], widths[0], stride=1)
        self.layer2 = BasicBlock(widths[0], widths[1], stride=2)
        self.layer3 = BasicBlock(widths[1], widths[2], stride=2)
        self.feature_dim = widths[2]
        self.classifier = nn.Linear(widths[2], num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Pooled embedding: (B, in_channels, H, W) -> (B, widths[2])."""
        out = self.layer3(self.layer2(self.layer1(self.stem(x))))
        return torch.flatten(F.adaptive_avg_pool2d(out, 1), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits: (B, in_channels, H, W) -> (B, num_classes)."""
        return self.classifier(self.features(x))


class ResNet18(nn.Module):
    """MONAI's 2D ResNet-18 encoder (:func:`monai.networks.nets.resnet18`) plus a linear classifier.

    By default the stem is CIFAR-style (conv3x3 stride 1, no max-pool). MONAI's default stem
    (conv7x7 then a stride-2 max-pool) halves a 28 px image before the first stage and leaves a 2x2
    map at the last one; the CIFAR stem keeps 28 -> 4x4, as CIFAR ResNets do for 32 px. The residual
    stages are MONAI's unchanged (BatchNorm, 1x1 projection shortcuts). Exposes :meth:`features` and
    :attr:`classifier` like the other classifiers (~11.2M params).

    Args:
        in_channels: number of image channels. Required.
        num_classes: number of output classes. Required.
        cifar_stem: use the conv3x3/no-max-pool stem (True) or MONAI's default conv7x7 + max-pool
            stem (False). Defaults to True.
    """

    def __init__(self, in_channels: int, num_classes: int, cifar_stem: bool = True) -> None:
        super().__init__()
        from monai.networks.nets import resnet18

        _check_positive("resnet18", "in_channels", in_channels)
        _check_positive("resnet18", "num_classes", num_classes)
        check_bool("resnet18", "cifar_stem", cifar_stem)
        stem = {"conv1_t_size": 3, "conv1_t_stride": 1, "no_max_pool": True} if cifar_stem else {}
        self.encoder = resnet18(spatial_dims=2, n_input_channels=in_channels, num_classes=num_classes, feed_forward=False, **stem)
        self.feature_dim = 512
        self.classifier = nn.Linear(512, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Pooled embedding: (B, in_channels, H, W) -> (B, 512)."""
        return self.encoder(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits: (B, in_channels, H, W) -> (B, num_classes)."""
        return self.classifier(self.encoder(x))
