"""The one network builder by name: a preset's or a saved result's ``{"name": ..., "args": {...}}`` builds the network
(task models, FedIOD's generators and critics, and what an algorithm registers)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from medflare import ConfigError
from medflare.checks import check_dropout, check_positive_int
from medflare.nets.convnet import ConvNet
from medflare.nets.gan import LabelGenerator, LatentGenerator, PatchCritic
from medflare.nets.resnet import ResNet8, ResNet18

__all__ = ["MODEL_NAMES", "build_from_spec", "build_model", "count_parameters", "build_unet", "register"]


def build_unet(
    in_channels: int,
    out_channels: int,
    channels: Sequence[int],
    strides: Sequence[int],
    num_res_units: int = 1,
    norm: str = "instance",
    dropout: float = 0.0,
    spatial_dims: int = 2,
) -> nn.Module:
    """MONAI ``UNet`` for segmentation; outputs (B, out_channels, H, W) logits (softmax classes, 0 = background).

    Instance norm by default (no BatchNorm), as in the FedSM reference: BN running statistics are a
    poor fit for non-IID sites and batch size 1. H and W must be divisible by ``prod(strides)``.

    Args:
        in_channels: image channels. out_channels: number of classes including background.
        channels: feature channels per level, e.g. [16, 32, 64, 128, 256].
        strides: one stride per down-sampling, ``len(channels) - 1`` entries, e.g. [2, 2, 2, 2].
        num_res_units: residual units per level (default 1). norm: MONAI norm name (default "instance").
        dropout: dropout probability (default 0). spatial_dims: 2 or 3 (default 2).
    """
    from monai.networks.nets import UNet

    for key, value in (("in_channels", in_channels), ("out_channels", out_channels)):
        check_positive_int("unet", key, value)
    if not isinstance(channels, Sequence) or len(channels) < 2 or not all(isinstance(c, int) and c > 0 for c in channels):
        raise ConfigError(f"unet: 'channels' must be a list of >= 2 positive ints, got {channels!r}")
    if not isinstance(strides, Sequence) or len(strides) != len(channels) - 1 or not all(
        isinstance(s, int) and s > 0 for s in strides
    ):
        raise ConfigError(
            f"unet: 'strides' must be a list of len(channels) - 1 = {len(channels) - 1} positive ints, got {strides!r}"
        )
    if not isinstance(num_res_units, int) or num_res_units < 0:
        raise ConfigError(f"unet: 'num_res_units' must be a non-negative int, got {num_res_units!r}")
    if spatial_dims not in (2, 3):
        raise ConfigError(f"unet: 'spatial_dims' must be 2 or 3, got {spatial_dims!r}")
    check_dropout("unet", dropout)
    try:
        return UNet(
            spatial_dims=spatial_dims,
            in_channels=in_channels,
            out_channels=out_channels,
            channels=list(channels),
            strides=list(strides),
            num_res_units=num_res_units,
            norm=norm,
            dropout=dropout,
        )
    except (KeyError, ValueError, TypeError) as e:
        raise ConfigError(f"unet: bad 'norm'={norm!r}: {e}") from e


#: role -> network name -> builder: the one table every ``{"name", "args"}`` spec is built from. "model": the task
#: networks a preset's ``model`` names; "generator" / "discriminator": the GAN parts of :mod:`medflare.nets.gan`
#: (FedIOD); an algorithm adds a network of its own under a role of its own with :func:`register` (FedSM's
#: "selector").
_BUILDERS: dict[str, dict[str, Callable[..., nn.Module]]] = {
    "model": {"unet": build_unet, "convnet": ConvNet, "resnet8": ResNet8, "resnet18": ResNet18},
    "generator": {"latent_generator": LatentGenerator, "label_generator": LabelGenerator},
    "discriminator": {"patch_critic": PatchCritic},
}

#: Names accepted by :func:`build_model` (role "model").
MODEL_NAMES: tuple[str, ...] = tuple(_BUILDERS["model"])


def register(role: str, name: str, builder: Callable[..., nn.Module]) -> None:
    """Make ``builder`` the network ``name`` of ``role`` (an algorithm's own network, registered when its module loads);
    registering the same builder again is a no-op, another builder under a taken name a ConfigError."""
    table = _BUILDERS.setdefault(role, {})
    if table.get(name, builder) is not builder:
        raise ConfigError(f"network name '{name}' of role '{role}' is taken by {table[name]!r}")
    table[name] = builder


def _build(role: str, name: str, args: Mapping[str, Any]) -> nn.Module:
    table = _BUILDERS.get(role, {})
    if name not in table:
        raise ConfigError(f"unknown {role} name '{name}' (known: {sorted(table) if role != 'model' else list(MODEL_NAMES)})")
    builder = table[name]
    params = inspect.signature(builder).parameters
    unknown = sorted(set(args) - set(params))
    if unknown:
        raise ConfigError(f"{role} '{name}': unknown argument(s) {unknown} (accepted: {list(params)})")
    missing = [k for k, p in params.items() if p.default is inspect.Parameter.empty and k not in args]
    if missing:
        raise ConfigError(f"{role} '{name}': missing required argument(s) {missing}")
    return builder(**args)


def build_model(name: str, **args: Any) -> nn.Module:
    """Build network ``name`` from config ``args`` (the ``model`` entry of a preset).

    Raises MedflareError naming the model, a missing or unknown argument, or a bad value, so a wrong
    job config fails with a readable message at start-up rather than deep in torch.
    """
    return _build("model", name, args)


def build_from_spec(spec: Mapping[str, Any], role: str = "model") -> nn.Module:
    """Build the network a preset or a saved result describes: ``{"name": ..., "args": {...}}``, one of ``role``'s
    names ("model", "generator", "discriminator", or a role an algorithm registered)."""
    if not isinstance(spec, Mapping) or "name" not in spec:
        raise ConfigError(f"a {role} spec must be a dict with 'name' (and 'args'), got {spec!r}")
    return _build(role, spec["name"], dict(spec.get("args") or {}))


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameters of ``model`` (all of them, or only those with requires_grad)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
