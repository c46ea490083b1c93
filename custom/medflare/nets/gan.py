"""Generators and patch critics from MONAI's GAN parts (FedIOD's G and D_k), built by name like every network.

- :class:`LatentGenerator` (classification): MONAI's ``Generator`` (linear layer to a start map, then
  transposed convolutions) mapping noise ``w`` of ``latent_dim`` to an image in [0, 1] (sigmoid), the
  data range of every medflare dataset. The paper's CIFAR G maps 100-d noise to 32x32.
- :class:`LabelGenerator` (segmentation): the label-to-image "ResNet" generator of pix2pix / AsynDGAN
  (7x7 conv, ``downsamplings`` stride-2 convs, ``blocks`` residual units, as many transposed convs, 7x7
  conv), built from MONAI ``Convolution`` / ``ResidualUnit`` blocks. Input: the one-hot label map plus
  ``noise_channels`` of Gaussian noise; output an image in [0, 1]. The paper's G has 9 blocks. With ``styles``
  > 0 each input also carries a style code (which site's imaging style to draw; not in the paper).
- :class:`PatchCritic`: MONAI's ``PatchDiscriminator`` (pix2pix PatchGAN) returning the final logits map
  ``(B, 1, h, w)``; instance norm instead of batch norm, so a score depends on its own input only, which
  keeps every per-input gradient a site releases a function of that input alone (per-sample clipping).
  For segmentation it is conditional: it sees the one-hot label map stacked on the image.

:func:`medflare.nets.factory.build_from_spec` builds them from ``{"name", "args"}`` with ``role="generator"``
(``latent_generator``, ``label_generator``) or ``role="discriminator"`` (``patch_critic``).
"""

from __future__ import annotations

import torch
from torch import nn

from medflare import ConfigError
from medflare.checks import check_positive_int


class LatentGenerator(nn.Module):
    """Noise -> image generator for classification (MONAI ``Generator`` + sigmoid).

    Args:
        latent_dim: length of the noise vector ``w``. Default 100 (paper).
        image_size: side of the square output; must be divisible by 4. Default 28.
        out_channels: image channels. Default 1.
        width: channels of the start map; the two upsampling stages have ``width`` and ``width // 2``. Default 64.
        num_res_units: residual units after each upsampling (MONAI). Default 0.
    """

    def __init__(self, latent_dim: int = 100, image_size: int = 28, out_channels: int = 1, width: int = 64, num_res_units: int = 0):
        super().__init__()
        from monai.networks.nets import Generator

        for key, value in (("latent_dim", latent_dim), ("image_size", image_size), ("out_channels", out_channels), ("width", width)):
            check_positive_int("latent_generator", key, value)
        if image_size % 4:
            raise ConfigError(f"latent_generator: 'image_size' must be divisible by 4, got {image_size}")
        self.latent_dim = latent_dim
        self.net = Generator(
            latent_shape=(latent_dim,), start_shape=(width, image_size // 4, image_size // 4),
            channels=(width, max(width // 2, 1), out_channels), strides=(2, 2, 1),
            num_res_units=num_res_units, norm="BATCH", act="RELU",
        )

    def latent(self, batch: int, generator: torch.Generator | None = None, device=None) -> torch.Tensor:
        """A batch of noise vectors ``w``: ``(batch, latent_dim)`` standard normal."""
        return torch.randn(batch, self.latent_dim, generator=generator, device=device)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        """``(B, latent_dim) -> (B, out_channels, image_size, image_size)`` in [0, 1]."""
        return torch.sigmoid(self.net(w))


#: the label generator's ways to double the resolution (its ``upsample`` argument)
UPSAMPLING = ("deconv", "resize")


class LabelGenerator(nn.Module):
    """Label map (+ noise) -> image generator for segmentation (pix2pix/AsynDGAN ResNet generator, MONAI blocks).

    Args:
        num_classes: classes of the label map (one-hot input channels). Default 3.
        out_channels: image channels. Default 1.
        width: channels of the first conv (doubled at each downsampling). Default 64 (paper: 64).
        blocks: residual units at the bottleneck. Default 9 (paper).
        downsamplings: stride-2 convolutions (and as many transposed ones). Default 2.
        noise_channels: channels of N(0, 1) noise stacked on the label map, so one label map gives varied
            images. Default 1.
        styles: style codes (0 = none, the paper's G). With ``styles`` = S the one-hot label map is given once per
            code, zero in every copy but the input's own code's (``C * S`` channels): a code switches the first
            convolution's filters per class. A constant code channel would not do: the instance norm after the first
            convolution removes a constant. FedIOD's server draws one site per input and its code, and that site's critic
            alone judges the input (:mod:`medflare.fediod.distill`), so each code learns one site's style. Default 0.
        upsample: how the decoder doubles the resolution: "deconv" (stride-2 transposed convolutions, the paper's G) or
            "resize" (nearest-neighbour resize then a 3x3 convolution, MONAI ``UpSample`` "nontrainable"): a stride-2
            transposed convolution of kernel 3 overlaps its outputs unevenly and draws a checkerboard, which short runs
            do not train away (Odena et al., Distill 2016). At ``fediod_seg`` "resize" removed the checkerboard from G's
            samples without changing the student's Dice (jobs/fediod_seg/README.md). Default "deconv".
    """

    def __init__(self, num_classes: int = 3, out_channels: int = 1, width: int = 64, blocks: int = 9, downsamplings: int = 2,
                 noise_channels: int = 1, styles: int = 0, upsample: str = "deconv"):
        super().__init__()
        from monai.networks.blocks import Convolution, ResidualUnit, UpSample

        for key, value in (("num_classes", num_classes), ("out_channels", out_channels), ("width", width)):
            check_positive_int("label_generator", key, value)
        for key, value in (("blocks", blocks), ("downsamplings", downsamplings), ("noise_channels", noise_channels), ("styles", styles)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"label_generator: '{key}' must be an int >= 0, got {value!r}")
        if upsample not in UPSAMPLING:
            raise ConfigError(f"label_generator: 'upsample' must be one of {list(UPSAMPLING)}, got {upsample!r}")
        self.num_classes, self.noise_channels, self.downsamplings, self.styles = num_classes, noise_channels, downsamplings, styles
        conv = dict(spatial_dims=2, norm="INSTANCE", act="RELU")
        label_channels = num_classes * max(styles, 1)
        layers: list[nn.Module] = [Convolution(in_channels=label_channels + noise_channels, out_channels=width, kernel_size=7, **conv)]
        ch = width
        for _ in range(downsamplings):
            layers.append(Convolution(in_channels=ch, out_channels=ch * 2, strides=2, kernel_size=3, **conv))
            ch *= 2
        layers += [ResidualUnit(in_channels=ch, out_channels=ch, subunits=2, kernel_size=3, **conv) for _ in range(blocks)]
        for _ in range(downsamplings):
            if upsample == "resize":
                layers += [UpSample(2, scale_factor=2, mode="nontrainable", interp_mode="nearest", align_corners=None),
                           Convolution(in_channels=ch, out_channels=ch // 2, kernel_size=3, **conv)]
            else:
                layers.append(Convolution(in_channels=ch, out_channels=ch // 2, strides=2, kernel_size=3, is_transposed=True, **conv))
            ch //= 2
        layers.append(Convolution(spatial_dims=2, in_channels=ch, out_channels=out_channels, kernel_size=7, conv_only=True))
        self.net = nn.Sequential(*layers)

    def condition(self, labels: torch.Tensor, generator: torch.Generator | None = None, style: torch.Tensor | None = None) -> torch.Tensor:
        """Generator input from label maps ``(B, 1, H, W)`` int and, with ``styles``, style codes ``style`` ``(B,)`` int in
        [0, styles): one-hot classes (one copy per code, see the class docstring) + noise channels
        ``(B, C * max(styles, 1) + noise, H, W)``."""
        onehot = one_hot(labels, self.num_classes)
        if self.styles:
            if style is None or tuple(style.shape) != (labels.shape[0],) or int(style.min()) < 0 or int(style.max()) >= self.styles:
                raise ConfigError(f"label_generator with {self.styles} styles needs one style code in [0, {self.styles}) per label map")
            code = nn.functional.one_hot(style.long(), self.styles).float().to(labels.device)  # (B, S)
            onehot = (code[:, :, None, None, None] * onehot[:, None]).flatten(1, 2)  # (B, S * C, H, W)
        noise = torch.randn(labels.shape[0], self.noise_channels, *labels.shape[2:], generator=generator, device=labels.device)
        return torch.cat([onehot, noise], dim=1)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        """``(B, num_classes * max(styles, 1) + noise_channels, H, W) -> (B, out_channels, H, W)`` in [0, 1]; H, W
        divisible by ``2 ** downsamplings``."""
        side = 2 ** self.downsamplings
        if w.shape[-1] % side or w.shape[-2] % side:
            raise ConfigError(f"label_generator: image sides {tuple(w.shape[-2:])} must be divisible by {side} (2 ** downsamplings)")
        return torch.sigmoid(self.net(w))


def one_hot(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """``(B, 1, *s)`` integer label map -> ``(B, num_classes, *s)`` float one-hot."""
    return nn.functional.one_hot(labels[:, 0].long(), num_classes).movedim(-1, 1).float()


class PatchCritic(nn.Module):
    """MONAI ``PatchDiscriminator`` (PatchGAN) returning its final logits map ``(B, 1, h, w)``.

    Args:
        in_channels: image channels (+ label classes for a conditional critic). Default 1.
        width: channels of the first conv (doubled per layer). Default 64 (paper: 128 for CIFAR, 64 for pix2pix).
        layers: strided conv layers (MONAI ``num_layers_d``). Default 2 (28-32 px); 3 for 256 px (pix2pix).
        norm: MONAI norm name. Default "INSTANCE" (per-input scores; see the module docstring).
    """

    def __init__(self, in_channels: int = 1, width: int = 64, layers: int = 2, norm: str = "INSTANCE"):
        super().__init__()
        from monai.networks.nets import PatchDiscriminator

        for key, value in (("in_channels", in_channels), ("width", width), ("layers", layers)):
            check_positive_int("patch_critic", key, value)
        self.net = PatchDiscriminator(spatial_dims=2, channels=width, in_channels=in_channels, num_layers_d=layers, norm=norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, in_channels, H, W) -> (B, 1, h, w)`` patch logits (real vs generated)."""
        return self.net(x)[-1]
