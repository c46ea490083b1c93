"""Building FedIOD's parts from a preset the same way at the server, at a site, in a benchmark and in a test.

The FLARE executor and controller, the in-process benchmark and the gradient test all call these, so a
federated run and a single-process run on the same seed start from identical networks and batches.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from medflare import ConfigError
from medflare.data.util import stable_seed
from medflare.fediod.config import FedIODConfig
from medflare.fediod.networks import (StudentGenerator, build_discriminator, build_generator, discriminator_spec,
                                      generator_spec)
from medflare.fediod.privacy import PrivacySettings
from medflare.fediod.site import SiteDistiller, real_batches
from medflare.fediod.teacher import data_args
from medflare.nets import build_from_spec


def data_shape(cfg: Mapping[str, Any]) -> tuple[str, int, int, int]:
    """(task, image channels, image side, classes) the server needs without seeing any data."""
    from medflare.data.site import KINDS

    data = cfg["data"]
    task = KINDS.get(data.get("kind"))
    if task is None:
        raise ConfigError(f"unknown data kind {data.get('kind')!r} in the preset")
    fcfg = FedIODConfig.from_preset(cfg)
    size = fcfg.image_size or data.get("image_size")
    if not size:
        raise ConfigError("the preset names no image size: set 'data.image_size' or 'fediod.image_size' (the generator's output side)")
    if "num_classes" not in data:
        raise ConfigError("the preset names no 'data.num_classes' (the student's outputs)")
    return task, int(data.get("channels", 1)), int(size), int(data["num_classes"])


def server_specs(cfg: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(student spec, generator spec) with the data's arguments filled in."""
    task, channels, size, classes = data_shape(cfg)
    fcfg = FedIODConfig.from_preset(cfg)
    student = {"name": cfg["model"]["name"], "args": {**cfg["model"].get("args", {}), **data_args(cfg["model"]["name"], channels, classes, size)}}
    return student, generator_spec(fcfg.generator, task, size, channels, classes)


def server_networks(cfg: Mapping[str, Any], seed: int = 0) -> StudentGenerator:
    """The initial student and generator from ``seed`` (what the persistor starts from)."""
    student, generator = server_specs(cfg)
    torch.manual_seed(seed)
    return StudentGenerator(build_from_spec(student), build_generator(generator))


def site_discriminator(cfg: Mapping[str, Any], site: str, seed: int) -> torch.nn.Module:
    """D_k of ``site``, initialised from (seed, site name) so reruns and the single-process replay agree."""
    task, channels, _, classes = data_shape(cfg)
    spec = discriminator_spec(FedIODConfig.from_preset(cfg).discriminator, task, channels, classes)
    torch.manual_seed(stable_seed("fediod-discriminator", seed, site) % (2**31))
    return build_discriminator(spec)


def site_distiller(cfg: Mapping[str, Any], site: str, teacher: torch.nn.Module, train_set, privacy: PrivacySettings | None,
                   seed: int, device="cpu") -> SiteDistiller:
    """Site ``site``'s stage-2 state: its teacher, a fresh D_k, its real batches (seeded by (seed, site)), its DP."""
    task, _, _, classes = data_shape(cfg)
    fcfg = FedIODConfig.from_preset(cfg)
    disc = site_discriminator(cfg, site, seed)
    site_seed = stable_seed("fediod-site", seed, site) % (2**31)
    return SiteDistiller(teacher, disc, real_batches(train_set, fcfg.batch_size, site_seed), fcfg, task, classes,
                         privacy=privacy, device=device, seed=site_seed)


def label_counts(dataset, task: str, num_classes: int) -> torch.Tensor:
    """Per-class label counts of a site's training set (pixels per class for segmentation): ``(C,)`` float64."""
    counts = torch.zeros(num_classes, dtype=torch.float64)
    for i in range(len(dataset)):
        label = torch.as_tensor(dataset[i]["label"]).long().reshape(-1)
        if label.numel() and (int(label.min()) < 0 or int(label.max()) >= num_classes):
            raise ConfigError(f"a training label lies outside 0..{num_classes - 1} (data.num_classes={num_classes})")
        counts += torch.bincount(label, minlength=num_classes).double()
    return counts
