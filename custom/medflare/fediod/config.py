"""The ``fediod`` section of a preset: every distillation knob, checked once, read by the server and the sites alike.

    "fediod": {
      "generator": {"name": "latent_generator", "args": {"latent_dim": 100, "width": 64}},
      "discriminator": {"name": "patch_critic", "args": {"width": 32, "layers": 2}},
      "batch_size": 64,            # B: generated inputs per step (and real inputs per discriminator step)
      "steps_per_window": 8,       # M: steps whose messages travel together (see controller docstring)
      "windows_per_round": 4,      # windows per FLARE round ("epoch" of the paper: rounds x windows x M steps)
      "tau": 1.0,                  # temperature of Eq. 1 for L_conf and L_unique
      "mimic_tau": 0.0,            # L_mimic: 0 = squared logit distance (Eq. 10, tau -> inf); > 0 = tau^2 KL at tau
      "lambda_conf": 1.0, "lambda_unique": 1.0, "lambda_mimic": 1.0, "lambda_gan": 1.0,
      "lambda_balance": 0.0,       # class balance of the ensemble's predictions (reference code, not the paper)
      "lambda_bn": 0.0,            # realism prior: generated batches' features vs each teacher's BatchNorm running
                                   # statistics (DeepInversion; not the paper; computed at the site; 0 = off)
      "ensemble": "eq8",           # Eq. 8 weights | "labels" (label factor only) | "mean" (1/K); Table 6/7 ablation
      "gan_weighting": "data_size",  # G's GAN terms weighted by pi_k (Eq. 2) | "uniform" (Table 6 "Avg")
      "student_steps": 1,          # student steps per generated batch: 1 = Algorithm 1; each further step trains S on
                                   # a batch drawn from the replay bank (not the paper; no extra messages)
      "replay_size": 0,            # past generated inputs (+ their ensemble logits) the server keeps for those steps
                                   # (medflare.fediod.replay; 0 = the extra steps repeat the current batch)
      "lr_generator": 1e-3, "lr_student": 1e-3, "lr_discriminator": 1e-3, "cosine": true,
      "label_source": "auxiliary-labels",  # segmentation: whose label maps condition G (server-side auxiliary labels)
      "image_size": 0              # side of G's output; 0 = the preset's data.image_size (set it for a site's own data)
    }
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from medflare import ConfigError

ENSEMBLES = ("eq8", "labels", "mean")
GAN_WEIGHTINGS = ("data_size", "uniform")


@dataclass(frozen=True)
class FedIODConfig:
    """Distillation settings (see the module docstring for each key's meaning and default)."""

    generator: dict = field(default_factory=lambda: {"name": "latent_generator", "args": {"latent_dim": 100, "width": 64}})
    discriminator: dict = field(default_factory=lambda: {"name": "patch_critic", "args": {"width": 32, "layers": 2}})
    batch_size: int = 64
    steps_per_window: int = 8
    windows_per_round: int = 4
    tau: float = 1.0
    mimic_tau: float = 0.0
    lambda_conf: float = 1.0
    lambda_unique: float = 1.0
    lambda_mimic: float = 1.0
    lambda_gan: float = 1.0
    lambda_balance: float = 0.0
    lambda_bn: float = 0.0
    ensemble: str = "eq8"
    gan_weighting: str = "data_size"
    student_steps: int = 1
    replay_size: int = 0
    lr_generator: float = 1e-3
    lr_student: float = 1e-3
    lr_discriminator: float = 1e-3
    cosine: bool = True
    label_source: str = "auxiliary-labels"
    image_size: int = 0

    @classmethod
    def from_preset(cls, cfg: Mapping[str, Any]) -> "FedIODConfig":
        """The preset's ``fediod`` section over the defaults; ConfigError names a bad key or value."""
        section = dict(cfg.get("fediod") or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise ConfigError(f"unknown key(s) {unknown} in preset section 'fediod' (known: {sorted(known)})")
        c = cls(**section)
        for key in ("image_size", "replay_size"):
            v = getattr(c, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"preset 'fediod.{key}' must be an int >= 0, got {v!r}")
        for key in ("batch_size", "steps_per_window", "windows_per_round", "student_steps"):
            v = getattr(c, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"preset 'fediod.{key}' must be an int >= 1, got {v!r}")
        for key in ("tau", "lr_generator", "lr_student", "lr_discriminator"):
            if not isinstance(getattr(c, key), (int, float)) or getattr(c, key) <= 0:
                raise ConfigError(f"preset 'fediod.{key}' must be a number > 0, got {getattr(c, key)!r}")
        for key in ("lambda_conf", "lambda_unique", "lambda_mimic", "lambda_gan", "lambda_balance", "lambda_bn", "mimic_tau"):
            if not isinstance(getattr(c, key), (int, float)) or getattr(c, key) < 0:
                raise ConfigError(f"preset 'fediod.{key}' must be a number >= 0, got {getattr(c, key)!r}")
        if c.ensemble not in ENSEMBLES:
            raise ConfigError(f"preset 'fediod.ensemble' must be one of {list(ENSEMBLES)}, got {c.ensemble!r}")
        if c.gan_weighting not in GAN_WEIGHTINGS:
            raise ConfigError(f"preset 'fediod.gan_weighting' must be one of {list(GAN_WEIGHTINGS)}, got {c.gan_weighting!r}")
        return c
