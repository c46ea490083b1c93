"""Differential privacy a FedIOD site applies to what it releases, and its accounting (no FLARE).

What is protected, and how (the argument of GS-WGAN, Chen et al. 2020, which the paper follows):
the privacy unit is one record of the site's training data. Per exchange the site releases, for each of
``n`` generated inputs, one vector computed from its teacher T_k and discriminator D_k: the gradient of
its loss terms with respect to that input (always protected once DP is on) and, optionally, its outputs
(teacher logits and discriminator factor). :func:`clip_and_noise` clips each vector to L2 norm ``C`` and
adds ``N(0, sigma^2 C^2)`` to every coordinate (the Gaussian mechanism).

T_k is trained on *all* of the site's records, so one record may change T_k (and D_k) arbitrarily: each
clipped vector may then move by up to ``2C`` and the ``n`` vectors of one release by ``2C sqrt(n)``. A
release is therefore a Gaussian mechanism of noise multiplier ``sigma / (2 sqrt(n))`` relative to its
sensitivity, with no amplification by subsampling (sample rate 1: the teacher depends on every record).
This is GS-WGAN's per-step bound ``(alpha, 2 n alpha / sigma^2)``-RDP. :class:`SiteAccountant` composes
the releases with opacus' RDP accountant and converts to ``(epsilon, delta)``.

The paper's epsilons (3.5-10 after 300 epochs, Table 5) assume amplification by subsampling the real data
each step; that does not hold for a teacher trained on every record, so we do not claim it: with the
honest bound, a useful epsilon needs a large ``sigma`` or few released vectors (see jobs/fediod/README.md).

A site's settings come from the ``privacy`` section of its own ``local/medflare_site.json``
(:meth:`PrivacySettings.from_site_config`), never from the job.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from medflare import ConfigError
from medflare.common.site_config import SITE_CONFIG, setting

#: keys of the ``privacy`` section of ``local/medflare_site.json`` that FedIOD reads
KEYS = {
    "fediod_noise_multiplier": "sigma: noise std per coordinate in units of the clip norm (0 = no noise). Default 0.",
    "fediod_clip_norm": "C: per-sample L2 clip of every released input gradient (0 = no clipping). Default 0; "
                        "required > 0 when the noise multiplier is > 0.",
    "fediod_noise_outputs": "also clip and noise the released outputs (teacher logits + discriminator factor), "
                            "so that epsilon covers everything the site sends. Default false.",
    "fediod_output_clip_norm": "per-sample L2 clip of the released outputs when they are noised. Default 10.",
    "fediod_delta": "delta of the (epsilon, delta) guarantee. Default 1e-5 (paper).",
    "fediod_epsilon_budget": "the site stops answering before a release would take epsilon above this "
                             "(null = no budget). Default null.",
}


@dataclass(frozen=True)
class PrivacySettings:
    """A site's DP settings (see :data:`KEYS`)."""

    noise_multiplier: float = 0.0
    clip_norm: float = 0.0
    noise_outputs: bool = False
    output_clip_norm: float = 10.0
    delta: float = 1e-5
    epsilon_budget: float | None = None

    @property
    def enabled(self) -> bool:
        """True when the site adds noise (then every release is accounted)."""
        return self.noise_multiplier > 0

    @property
    def scope(self) -> str:
        """What the reported epsilon covers."""
        if not self.enabled:
            return "none"
        return "gradients+outputs" if self.noise_outputs else "gradients"

    @classmethod
    def from_site_config(cls, config: Mapping[str, Mapping[str, Any]], site: str = "") -> "PrivacySettings":
        """Read the ``fediod_*`` keys of the site's ``privacy`` section; ConfigError names a bad key."""
        nonneg = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0  # noqa: E731
        pos = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0  # noqa: E731
        s = cls(
            noise_multiplier=float(setting(config, "privacy", "fediod_noise_multiplier", 0.0, nonneg, site)),
            clip_norm=float(setting(config, "privacy", "fediod_clip_norm", 0.0, nonneg, site)),
            noise_outputs=bool(setting(config, "privacy", "fediod_noise_outputs", False, lambda v: isinstance(v, bool), site)),
            output_clip_norm=float(setting(config, "privacy", "fediod_output_clip_norm", 10.0, pos, site)),
            delta=float(setting(config, "privacy", "fediod_delta", 1e-5, lambda v: pos(v) and v < 1, site)),
            epsilon_budget=setting(config, "privacy", "fediod_epsilon_budget", None, lambda v: v is None or pos(v), site),
        )
        if s.enabled and s.clip_norm <= 0:
            raise ConfigError(f"site '{site}': {SITE_CONFIG} 'privacy.fediod_noise_multiplier' is {s.noise_multiplier} but "
                              "'privacy.fediod_clip_norm' is not set: noise without a clip norm bounds nothing")
        return s


def clip_rows(v: torch.Tensor, clip_norm: float) -> torch.Tensor:
    """Scale each row ``v[i]`` (any trailing shape) to L2 norm at most ``clip_norm`` (0 = unchanged)."""
    if clip_norm <= 0:
        return v
    norms = v.reshape(v.shape[0], -1).norm(dim=1).clamp_min(1e-12)
    scale = (clip_norm / norms).clamp(max=1.0)
    return v * scale.view(-1, *([1] * (v.ndim - 1)))


def clip_and_noise(v: torch.Tensor, clip_norm: float, noise_multiplier: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Gaussian mechanism per sample: clip each row of ``v`` to ``clip_norm``, add ``N(0, (noise_multiplier *
    clip_norm)^2)`` to every coordinate. ``v``: ``(n, ...)``; same shape out."""
    out = clip_rows(v, clip_norm)
    if noise_multiplier > 0:
        noise = torch.randn(out.shape, generator=generator, dtype=out.dtype, device="cpu").to(out.device)
        out = out + noise * (noise_multiplier * clip_norm)
    return out


def release_noise_multiplier(noise_multiplier: float, vectors: int) -> float:
    """Noise multiplier of one release of ``vectors`` clipped vectors relative to its L2 sensitivity ``2C sqrt(n)``."""
    return noise_multiplier / (2.0 * math.sqrt(vectors))


def noised_counts(counts: torch.Tensor, per_record: float, noise_multiplier: float,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Per-class label counts ``(C,)`` released by the Gaussian mechanism: noise of std ``noise_multiplier * per_record``
    (the L2 sensitivity: one training record moves its class counts by at most ``per_record``, 1 for a label, the
    pixels of one label map for segmentation), rounded and floored at 0 (post-processing, no privacy cost). The caller
    records the release with its accountant (noise multiplier ``noise_multiplier`` relative to the sensitivity)."""
    noise = torch.randn(counts.shape, generator=generator, dtype=torch.float64) * (noise_multiplier * per_record)
    return (counts.double() + noise).round().clamp_min(0)


class SiteAccountant:
    """(epsilon, delta) of a site's releases, by opacus' RDP accountant (composition of Gaussian mechanisms).

    Args:
        delta: the delta of the reported guarantee.
        budget: the epsilon a site allows (None = no budget).
    """

    def __init__(self, delta: float = 1e-5, budget: float | None = None):
        from opacus.accountants import RDPAccountant

        self.delta = float(delta)
        self.budget = None if budget is None else float(budget)
        self._rdp = RDPAccountant()

    def spend(self, noise_multiplier: float, sample_rate: float = 1.0, steps: int = 1) -> None:
        """Record ``steps`` mechanisms of (noise multiplier, sample rate) relative to their sensitivity."""
        for _ in range(steps):
            self._rdp.step(noise_multiplier=float(noise_multiplier), sample_rate=float(sample_rate))

    def epsilon(self) -> float:
        """Epsilon spent so far at ``delta`` (0 before the first release)."""
        return float(self._rdp.get_epsilon(delta=self.delta)) if self._rdp.history else 0.0

    def epsilon_after(self, releases: list[tuple[float, float]]) -> float:
        """Epsilon if the ``[(noise multiplier, sample rate)]`` releases were added now (nothing is recorded)."""
        trial = SiteAccountant(self.delta)
        trial._rdp.history = copy.deepcopy(self._rdp.history)
        for sigma, q in releases:
            trial.spend(sigma, q)
        return trial.epsilon()

    def allows(self, releases: list[tuple[float, float]]) -> tuple[bool, float]:
        """(within budget, epsilon after the releases)."""
        eps = self.epsilon_after(releases)
        return (self.budget is None or eps <= self.budget), eps
