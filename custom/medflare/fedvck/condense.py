"""Valuable knowledge condensation at a site (FedVCK Eq. 3-10): a small learnable image set matched to the local data.

Each round the site optimises its condensed set S (warm-started from the previous round) so that, class by
class, the encoder features of S match those of real batches drawn by P_w (Eq. 8) in MMD (Eq. 9), with the
synthetic batch normalised by the real batch's BN statistics at every layer (Eq. 4, :mod:`.latent`) and
both batches under the same random differentiable augmentation (:mod:`.augment`). The encoder psi is the
received global model's ``features`` (frozen; the site never changes it).

S lives in the model's input space, images in [0, 1] (the data loaders' range): it starts as N(0, 1) in the
site's standardised pixel space (mean + std * z, the paper's "N(0, 1)" initialisation of standardised
data), and after every step it is projected back onto [0, 1], so the uint8 quantisation of the upload
(the paper's cost analysis: one byte per pixel) loses only the rounding, at most 1/510 per pixel.

Sizes: a class with n_c >= 1 local images gets ipc_c = min(n_c, max(min_ipc, ceil(p/100 * n_c))) condensed
images (the reference's max(5, ceil(p * n_c)), but never more condensed than real images of a class); a
class the site does not have is not condensed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np
import torch
from torch import nn

from medflare import ConfigError, DataError
from medflare.fedvck.augment import DiffAugment
from medflare.fedvck.importance import ImportanceSampler
from medflare.fedvck.latent import bn_statistics
from medflare.fedvck.mmd import classwise_mmd


def condensed_sizes(counts: Mapping[int, int], ipc_percent: float, min_ipc: int) -> dict[int, int]:
    """Images per class of the condensed set: {c: min(n_c, max(min_ipc, ceil(p% * n_c)))} for n_c > 0."""
    if not 0 < ipc_percent <= 100:
        raise ConfigError(f"fedvck.ipc_percent must lie in (0, 100], got {ipc_percent!r}")
    return {int(c): min(int(n), max(int(min_ipc), math.ceil(ipc_percent / 100 * int(n)))) for c, n in sorted(counts.items()) if n > 0}


def quantize(images: torch.Tensor) -> np.ndarray:
    """(M, C, H, W) float images in [0, 1] -> uint8 (values clipped to [0, 1], rounded to the nearest 1/255)."""
    return np.round(images.detach().clamp(0, 1).cpu().numpy() * 255).astype(np.uint8)


def dequantize(images: np.ndarray | torch.Tensor) -> torch.Tensor:
    """uint8 (M, C, H, W) -> float32 in [0, 1]."""
    return torch.as_tensor(np.asarray(images)).float() / 255.0


def stack_dataset(dataset, batch_size: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Every item of a classification dataset as (N, C, H, W) float images and (N,) int64 labels."""
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False)
    images, labels = [], []
    for batch in loader:
        images.append(batch["image"])
        labels.append(batch["label"].view(-1).long())
    if not images:
        raise DataError("the training split is empty")
    return torch.cat(images), torch.cat(labels)


@torch.no_grad()
def predict_logits(model: nn.Module, images: torch.Tensor, device: torch.device | str = "cpu", batch_size: int = 512) -> torch.Tensor:
    """(N, C, H, W) -> (N, num_classes) logits of ``model`` in eval mode, on the CPU."""
    model.eval()
    return torch.cat([model(images[i : i + batch_size].to(device)).float().cpu() for i in range(0, len(images), batch_size)])


class CondensedSet:
    """The learnable set S of one site: images (M, C, H, W) in [0, 1] and their labels (M,), class by class.

    Args:
        sizes: {class: number of condensed images}. Required (non-empty).
        shape: (C, H, W) of one image. Required.
        pixel_mean / pixel_std: the site's pixel statistics; S starts as clamp(mean + std * N(0, 1), 0, 1).
        generator: seeds the initialisation.
    """

    def __init__(self, sizes: Mapping[int, int], shape: tuple[int, int, int], pixel_mean: float, pixel_std: float,
                 generator: torch.Generator | None = None):
        if not sizes:
            raise DataError("no class to condense")
        self.sizes = dict(sizes)
        self.labels = torch.cat([torch.full((n,), c, dtype=torch.int64) for c, n in self.sizes.items()])
        z = torch.randn((len(self.labels), *shape), generator=generator)
        self.images = (pixel_mean + pixel_std * z).clamp(0, 1).requires_grad_(True)

    def to(self, device: torch.device | str) -> "CondensedSet":
        self.images = self.images.detach().to(device).requires_grad_(True)
        self.labels = self.labels.to(device)
        return self

    def quantized(self) -> tuple[np.ndarray, np.ndarray]:
        """What leaves the site: uint8 images (M, C, H, W) and int64 labels (M,)."""
        return quantize(self.images), self.labels.cpu().numpy().astype(np.int64)


@dataclass
class CondenseStats:
    """What one call of :func:`condense` did: steps and the loss (Eq. 9) at the first and last step."""

    steps: int = 0
    first_loss: float = math.nan
    last_loss: float = math.nan
    per_class: dict[int, float] = field(default_factory=dict)


def condense(
    model: nn.Module,
    cset: CondensedSet,
    real_images: torch.Tensor,
    real_labels: torch.Tensor,
    sampler: ImportanceSampler,
    *,
    iterations: int,
    real_batch: int,
    image_lr: float,
    image_momentum: float,
    clip_norm: float,
    kernel: str = "linear",
    latent_constraints: bool = True,
    augment: DiffAugment | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    should_stop: Callable[[], bool] | None = None,
) -> CondenseStats:
    """Optimise ``cset.images`` for ``iterations`` steps of Eq. 9 with ``model.features`` as the frozen encoder psi.

    Per step and per class c of S: ``real_batch`` real images of c drawn by ``sampler`` (P_w), the same random
    augmentation on them and on S_c; the real batch (all classes) is embedded recording its BN statistics and
    S is embedded with them (``latent_constraints``) or with its own; loss = sum_c MMD^2 (``kernel``); one SGD
    step on the pixels (gradient norm clipped to ``clip_norm``), then S is projected onto [0, 1].
    ``real_images`` may stay on the CPU; batches move to ``device``.
    """
    if not hasattr(model, "features"):
        raise ConfigError(f"FedVCK needs an encoder with features(); model {type(model).__name__} has none")
    stats = CondenseStats()
    if iterations <= 0:
        return stats
    was_training = model.training
    model.eval()
    frozen = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    optimizer = torch.optim.SGD([cset.images], lr=image_lr, momentum=image_momentum)
    classes = list(cset.sizes)
    try:
        for step in range(iterations):
            if should_stop is not None and should_stop():
                break
            real_parts, syn_parts, real_lab, syn_lab = [], [], [], []
            for c in classes:
                idx = sampler.sample(c, real_batch, generator)
                real_c = real_images[idx].to(device)
                syn_c = cset.images[cset.labels == c]
                if augment is not None and augment.enabled:
                    params = augment.draw(1, generator)  # Siamese: one transform for the real and the synthetic batch of c
                    real_c, syn_c = augment.apply(real_c, params), augment.apply(syn_c, params)
                real_parts.append(real_c)
                syn_parts.append(syn_c)
                real_lab.append(torch.full((len(real_c),), c, dtype=torch.int64, device=device))
                syn_lab.append(torch.full((len(syn_c),), c, dtype=torch.int64, device=device))
            real, syn = torch.cat(real_parts), torch.cat(syn_parts)
            if latent_constraints:
                with torch.no_grad(), bn_statistics(model, "record") as recorded:
                    real_feat = model.features(real)
                with bn_statistics(model, "replay", recorded):
                    syn_feat = model.features(syn)
            else:
                with torch.no_grad(), bn_statistics(model, "own"):
                    real_feat = model.features(real)
                with bn_statistics(model, "own"):
                    syn_feat = model.features(syn)
            loss, per_class = classwise_mmd(real_feat, torch.cat(real_lab), syn_feat, torch.cat(syn_lab), kernel)
            if not torch.isfinite(loss):
                raise ConfigError(f"the condensation loss became {float(loss)} at step {step}; lower fedvck.image_lr")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([cset.images], max_norm=clip_norm)
            optimizer.step()
            with torch.no_grad():
                cset.images.clamp_(0, 1)
            value = float(loss.detach())
            if stats.steps == 0:
                stats.first_loss = value
            stats.last_loss, stats.per_class = value, per_class
            stats.steps += 1
    finally:
        for p, flag in zip(model.parameters(), frozen):
            p.requires_grad_(flag)
        model.train(was_training)
    return stats
