"""FedIOD's networks from a preset, built the same way at the server, at a site, in a benchmark and in a test.

The preset names only the architecture of the generator G and the discriminators D_k (``fediod.generator``,
``fediod.discriminator``); :func:`generator_spec` / :func:`discriminator_spec` fill in the data's image size,
channels and classes, and :func:`medflare.nets.build_from_spec` builds them (:mod:`medflare.nets.gan`).
:class:`StudentGenerator` holds the server's student S and G in one module, so FLARE's PT persistor saves them as
one state dict (``student.*``, ``generator.*``); :func:`server_networks` is the persistor's initial pair and
:func:`site_discriminator` a site's D_k, seeded by (seed, site name) so a federated run and the single-process
replay start from identical networks. Each takes the resolved preset and its ``fediod`` section as the typed
:class:`~medflare.fediod.config.FedIODConfig` the caller built once (``FedIODConfig.from_preset(cfg)``).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from medflare import ConfigError
from medflare.data.util import stable_seed
from medflare.fediod.config import FedIODConfig
from medflare.fediod.teacher import data_args
from medflare.nets import build_from_spec


def generator_spec(spec: Mapping[str, Any], task: str, image_size: int, channels: int, num_classes: int) -> dict[str, Any]:
    """``spec`` with the data's image size / channels / classes filled in (a preset names only the architecture)."""
    args = dict(spec.get("args") or {})
    if spec.get("name") == "latent_generator":
        args.update(image_size=image_size, out_channels=channels)
    else:
        args.update(num_classes=num_classes, out_channels=channels)
    if (spec.get("name") == "label_generator") != (task == "segmentation"):
        raise ConfigError(f"generator '{spec.get('name')}' does not fit a {task} task (classification: latent_generator, "
                          "segmentation: label_generator)")
    return {"name": spec["name"], "args": args}


def discriminator_spec(spec: Mapping[str, Any], channels: int, num_classes: int, with_labels: bool) -> dict[str, Any]:
    """``spec`` with ``in_channels`` filled in: image channels, plus the classes when the critic also takes the label map
    (:meth:`~medflare.fediod.config.FedIODConfig.critic_takes_labels`)."""
    args = dict(spec.get("args") or {})
    args["in_channels"] = channels + (num_classes if with_labels else 0)
    return {"name": spec["name"], "args": args}


class StudentGenerator(nn.Module):
    """The server's student S and generator G as one module (state dict keys ``student.*``, ``generator.*``)."""

    def __init__(self, student: nn.Module, generator: nn.Module):
        super().__init__()
        self.student = student
        self.generator = generator


def data_shape(cfg: Mapping[str, Any], fcfg: FedIODConfig) -> tuple[str, int, int, int]:
    """(task, image channels, image side, classes) the server needs without seeing any data."""
    from medflare.data.site import KINDS

    data = cfg["data"]
    task = KINDS.get(data.get("kind"))
    if task is None:
        raise ConfigError(f"unknown data kind {data.get('kind')!r} in the preset")
    size = fcfg.image_size or data.get("image_size")
    if not size:
        raise ConfigError("the preset names no image size: set 'data.image_size' or 'fediod.image_size' (the generator's output side)")
    if "num_classes" not in data:
        raise ConfigError("the preset names no 'data.num_classes' (the student's outputs)")
    return task, int(data.get("channels", 1)), int(size), int(data["num_classes"])


def server_specs(cfg: Mapping[str, Any], fcfg: FedIODConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """(student spec, generator spec) with the data's arguments filled in."""
    task, channels, size, classes = data_shape(cfg, fcfg)
    student = {"name": cfg["model"]["name"], "args": {**cfg["model"].get("args", {}), **data_args(cfg["model"]["name"], channels, classes, size)}}
    return student, generator_spec(fcfg.generator, task, size, channels, classes)


def server_networks(cfg: Mapping[str, Any], fcfg: FedIODConfig, seed: int = 0) -> StudentGenerator:
    """The initial student and generator from ``seed`` (what the persistor starts from)."""
    student, generator = server_specs(cfg, fcfg)
    torch.manual_seed(seed)
    return StudentGenerator(build_from_spec(student), build_from_spec(generator, role="generator"))


def site_discriminator(cfg: Mapping[str, Any], fcfg: FedIODConfig, site: str, seed: int) -> torch.nn.Module:
    """D_k of ``site``, initialised from (seed, site name) so reruns and the single-process replay agree."""
    task, channels, _, classes = data_shape(cfg, fcfg)
    spec = discriminator_spec(fcfg.discriminator, channels, classes, fcfg.critic_takes_labels(task))
    torch.manual_seed(stable_seed("fediod-discriminator", seed, site) % (2**31))
    return build_from_spec(spec, role="discriminator")
