"""What steers FedST's style generator: the label map (structure) and, in FedST-join, the domain vector (style).

Plain torch, no FLARE. Two conditionings, as in the paper's Fig. 3:

- **Label map, Palette style.** The label map is one-hot encoded and scaled to [-1, 1]
  (:func:`encode_labels`) and concatenated to the noisy image along the channel axis, so the denoiser
  sees where every structure is at every step (MONAI's ``DiffusionInferer`` ``mode="concat"``).
  A label value the generator was never trained on is refused by name instead of being silently
  mapped to some channel.
- **Domain vector (FedST-join).** A one-hot vector naming the site whose style to draw. A
  :class:`DomainModulation` maps it to a per-channel scale ``s`` and bias ``b`` for the output ``h`` of
  every residual (convolution) block of the UNet: ``h * (1 + s) + b`` (the reference's StyleMod). Switching
  the vector switches the style of the generated image for the same label map.

Aggregation: each site trains the generator with its own domain vector, so the domain module's column for domain k
receives gradient only at site k. :func:`participation_mean` averages every entry over the sites that changed it, so
that column keeps site k's whole update instead of n_k / n of it per round. That alone does not make the federated
generator switch style: a site trains under one constant domain vector, so over many local steps its style also goes
into the shared layers, which the average takes back to the mean style (measured: with 40-80 local steps per average
the joint generator draws the mean of two inverted styles for either vector). Two remedies, both measured to separate
the styles (benchmarks/RESULTS_fedst.md): averaging every ``diffusion.sync_steps`` (e.g. 5) local steps
(:func:`medflare.fedst.diffusion.exchange_steps`; costly in bytes unless the diffs travel quantized,
``diffusion.exchange_dtype`` int4: the ``fedst`` preset's choice, every 8 steps), or -- ``fedst_tiny``'s, which
follows style at two sites but not at six -- one average per round with ``diffusion.keep_other_domains``, a term that
keeps the generator's predictions for the other domains at the received generator's during local steps
(:func:`medflare.fedst.diffusion.other_domain_term`), so the site's style can only go into its own column. Both
deviate from the paper's plain local training.

An all-zero domain vector names no site: the modulation would then be the mapping's bias alone, a
"style" no site has. :func:`check_domain_vectors` refuses it (ValueError naming the row), as well as
vectors that are neither one-hot nor the uniform vector, so a caller cannot draw an undefined style by mistake. The
uniform vector (:func:`mixture_vectors`, 1 / n everywhere) is allowed: the modulation is linear in the vector, so it
gives every block the mean of the sites' scales and biases, the sites' mixture style -- the reference that domain
guidance (:func:`medflare.fedst.diffusion.domain_guided`) steers away from.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from medflare import DataError


def encode_labels(label: torch.Tensor, num_classes: int, trained: Sequence[int] | None = None, who: str = "the generator") -> torch.Tensor:
    """Integer label maps (B, 1, H, W) -> one-hot channels in {-1, 1}, shape (B, num_classes, H, W).

    ``trained``, when given, lists the classes the generator saw in training; a label map holding any other
    class (or a value outside [0, num_classes)) raises DataError naming the class and ``who``.
    """
    if label.ndim != 4 or label.shape[1] != 1:
        raise DataError(f"{who}: label maps must be shaped (B, 1, H, W), got {tuple(label.shape)}")
    label = label.long()
    present = sorted(int(v) for v in torch.unique(label))
    allowed = set(range(num_classes)) if trained is None else set(int(c) for c in trained) & set(range(num_classes))
    unknown = [c for c in present if c not in allowed]
    if unknown:
        raise DataError(
            f"{who}: the label maps hold class(es) {unknown}, which it was not trained on (trained classes: {sorted(allowed)})"
        )
    return F.one_hot(label[:, 0], num_classes).permute(0, 3, 1, 2).float() * 2.0 - 1.0


def domain_vectors(index: int | Sequence[int], num_domains: int, batch: int | None = None) -> torch.Tensor:
    """One-hot domain vectors (B, num_domains) for domain ``index`` (repeated ``batch`` times) or for each index."""
    if isinstance(index, int):
        index = [index] * (batch or 1)
    idx = torch.as_tensor(list(index), dtype=torch.long)
    if idx.numel() and (idx.min() < 0 or idx.max() >= num_domains):
        raise ValueError(f"domain index out of range [0, {num_domains}): {idx.tolist()}")
    return F.one_hot(idx, num_domains).float()


def mixture_vectors(num_domains: int, batch: int) -> torch.Tensor:
    """Uniform domain vectors (B, num_domains), 1 / num_domains everywhere: the mean of the sites' modulations."""
    return torch.full((batch, num_domains), 1.0 / num_domains)


def check_domain_vectors(domain: torch.Tensor, num_domains: int) -> None:
    """Refuse what is not a batch of one-hot (or uniform: :func:`mixture_vectors`) vectors (B, num_domains); an
    all-zero row names no domain."""
    if domain.ndim != 2 or domain.shape[1] != num_domains:
        raise ValueError(f"domain vectors must be shaped (B, {num_domains}), got {tuple(domain.shape)}")
    zero = (domain == 0).all(dim=1)
    if zero.any():
        raise ValueError(
            f"domain vector row(s) {zero.nonzero().flatten().tolist()} are all zero: an all-zero vector names no site's "
            "style (the modulation would be its bias alone); pass a one-hot vector"
        )
    one_hot = ((domain == 0) | (domain == 1)).all(dim=1) & (domain.sum(dim=1) == 1)
    uniform = torch.isclose(domain, torch.full_like(domain, 1.0 / num_domains)).all(dim=1)
    if not (one_hot | uniform).all():
        raise ValueError(f"domain vector row(s) {(~(one_hot | uniform)).nonzero().flatten().tolist()} are neither one-hot "
                         "nor the uniform mixture vector")


class DomainModulation(nn.Module):
    """Controllable generate module of FedST-join: one-hot domain -> per-channel scale and bias of a feature map.

    Args:
        num_domains: length of the domain vector (the number of sites). Must be >= 1.
        channels: channels of the feature map it modulates.
        init_std: standard deviation of the linear map's initial weights (``diffusion.generator.domain_init_std``,
            whose default is the one home of 0.02).

    ``forward(h, domain)``: h (B, channels, *spatial), domain (B, num_domains) -> ``h * (1 + s) + b`` where
    ``[s, b] = Linear(domain)``. The linear map starts at random weights (std ``init_std``) and zero bias: with the
    setting's default 0.02 an untrained generator starts close to the unmodulated UNet and each domain nudges it differently.
    """

    def __init__(self, num_domains: int, channels: int, init_std: float):
        super().__init__()
        if num_domains < 1 or channels < 1 or init_std < 0:
            raise ValueError(f"DomainModulation needs num_domains >= 1, channels >= 1 and init_std >= 0, got {num_domains}, "
                             f"{channels}, {init_std}")
        self.num_domains = num_domains
        self.proj = nn.Linear(num_domains, 2 * channels)
        nn.init.normal_(self.proj.weight, std=init_std)
        nn.init.zeros_(self.proj.bias)

    def forward(self, h: torch.Tensor, domain: torch.Tensor) -> torch.Tensor:
        scale, bias = self.proj(domain).chunk(2, dim=1)
        shape = (*scale.shape, *([1] * (h.ndim - 2)))
        return h * (1 + scale.view(shape)) + bias.view(shape)


def participation_mean(diffs: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]) -> dict[str, np.ndarray]:
    """FedAvg of weight diffs where each entry is averaged over the sites that changed it (FedST-join's generator).

    diffs: one ``{name: array}`` per site, weights: one non-negative number per site. An entry only one site trains
    -- the column of the domain module that its one-hot domain vector selects -- keeps that site's full update
    instead of being diluted by the sites that cannot train it (plain FedAvg would scale it by n_k / n every round);
    entries every site changes get the ordinary weighted mean. Integer entries take site 0's value.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (len(diffs),) or not len(diffs) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"participation_mean: need one non-negative weight per diff with a positive sum, got {list(weights)}")
    out = {}
    for name in diffs[0]:
        first = np.asarray(diffs[0][name])
        if not np.issubdtype(first.dtype, np.floating):
            out[name] = first.copy()
            continue
        stack = np.stack([np.asarray(d[name], dtype=np.float64) for d in diffs])
        shape = (-1,) + (1,) * first.ndim
        active = (stack != 0) * w.reshape(shape)
        total = active.sum(axis=0)
        out[name] = np.where(total > 0, (stack * active).sum(axis=0) / np.where(total > 0, total, 1.0), 0.0).astype(first.dtype)
    return out
