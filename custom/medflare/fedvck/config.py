"""FedVCK's algorithm settings: the ``fedvck`` section of a preset, read the same way by server and sites.

Both sides resolve the job's preset (with its overrides), so condensation (site) and global-model update
(server) settings cannot disagree, and a paper-scale run is a preset away (``cls_medmnist_paper``). A preset
without a ``fedvck`` section runs with the defaults below. Every value is checked here, once, with a
:class:`medflare.ConfigError` naming the key (``fedvck.<key>``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from medflare import ConfigError
from medflare.fedvck.augment import check_strategy
from medflare.fedvck.mmd import KERNELS

SECTION = "fedvck"


@dataclass(frozen=True)
class FedVCKConfig:
    """Every FedVCK knob (paper symbol and reference-code value in brackets).

    Condensation at a site (Eq. 3-9):
        ipc_percent: p, the condensed set's size as a percentage of the site's images of each class, in (0, 100]
            (paper: p in {1, 2, 5}). Default 5.
        min_ipc: fewest condensed images of a class the site holds (reference: 5). A class with fewer real
            images than this gets one condensed image per real image. Default 5.
        iterations: condensation steps per round, warm-started from the previous round's set (reference:
            5000-10000). Default 100.
        real_batch: real images per class per step, drawn by P_w (Eq. 8) with replacement (reference: 256).
            Default 64.
        image_lr / image_momentum: SGD on the condensed images (reference: 0.1-1.0 / 0.5). Defaults 0.5, 0.5.
        clip_norm: gradient-norm clip of the image update (reference: 10-30). Default 10.
        kernel: "linear" (mean embedding, Eq. 2; the reference default) or "gaussian" (sum of RBF kernels of 5
            bandwidths around the median-like mean squared distance, Eq. 3 / M3D). Default "linear".
        latent_constraints: Eq. 4, the synthetic batch is normalised with the BN statistics recorded from the
            real batch at every BN layer; False = each batch with its own statistics (vanilla DM; ablation).
            Default True.
        importance: Eq. 5-8, real batches drawn by P_w from the self-ensemble's errors; False = uniform
            (ablation "w/o P_w"). Default True.
        alpha: weight of the current model M_t in the self-ensemble of Eq. 7 (reference: 1 - lamda = 0.5).
            Default 0.5.
        b: offset of Eq. 5 (reference: 0-0.7). Default 0.7.
        augment: differentiable Siamese augmentation (DSA) ops, "_"-joined, one drawn per step and applied
            identically to the real and the synthetic batch; "" = none (see :mod:`.augment`). Default
            "color_crop_cutout_scale_rotate".

    Global-model update at the server (Eq. 12-16):
        server_steps: SGD steps on the kept condensed sets per round. Default 300.
        server_epochs: when > 0, the round's steps are ``server_epochs`` passes over the kept condensed sets
            instead (reference: 1000 epochs); 0 = ``server_steps``. Default 0.
        server_batch: condensed images per step (reference: 256). Default 128.
        server_lr / server_momentum / server_weight_decay: SGD of the global model and projector; the lr is
            divided by 10 halfway through each round, as the reference's StepLR (reference: 1e-3-1e-2, 0.9,
            1e-6). Defaults 0.01, 0.9, 1e-6.
        server_augment: DSA ops applied per image in the server update ("" = none). Default as ``augment``.
        contrastive_weight: beta, the weight of L_rc in Eq. 16 (Eq. 16 as printed: 1; reference: 0.05-0.1);
            0 = no L_rc (ablation "w/o L_rc"). Default 0.1.
        temperature: tau of Eq. 15 (reference: 0.1). Default 0.1.
        top_k: K hard-negative classes per class, Eq. 13 (paper: 5 best of 3-9). Default 5.
        projector_dim: hidden width of the projector h (Linear-BN-ReLU-Linear; reference: 128). Default 128.
        keep_rounds: rounds of condensed sets the server trains on (reference: max(10, R/2)); 0 = all. Default 10.
    """

    ipc_percent: float = 5.0
    min_ipc: int = 5
    iterations: int = 100
    real_batch: int = 64
    image_lr: float = 0.5
    image_momentum: float = 0.5
    clip_norm: float = 10.0
    kernel: str = "linear"
    latent_constraints: bool = True
    importance: bool = True
    alpha: float = 0.5
    b: float = 0.7
    augment: str = "color_crop_cutout_scale_rotate"
    server_steps: int = 300
    server_epochs: int = 0
    server_batch: int = 128
    server_lr: float = 0.01
    server_momentum: float = 0.9
    server_weight_decay: float = 1e-6
    server_augment: str = "color_crop_cutout_scale_rotate"
    contrastive_weight: float = 0.1
    temperature: float = 0.1
    top_k: int = 5
    projector_dim: int = 128
    keep_rounds: int = 10

    def __post_init__(self) -> None:
        def bad(key: str, why: str, value: Any) -> ConfigError:
            return ConfigError(f"{SECTION}.{key} {why}, got {value!r}")

        def number(key: str, low: float, high: float = math.inf, low_open: bool = False) -> None:
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise bad(key, "must be a number", v)
            if v < low or (low_open and v == low) or v > high:
                raise bad(key, f"must lie in {'(' if low_open else '['}{low}, {high}]", v)

        def integer(key: str, low: int) -> None:
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise bad(key, f"must be an int >= {low}", v)

        number("ipc_percent", 0.0, 100.0, low_open=True)
        for key, low in (("min_ipc", 1), ("iterations", 0), ("real_batch", 1), ("server_steps", 0), ("server_epochs", 0), ("server_batch", 1),
                         ("top_k", 1), ("projector_dim", 1), ("keep_rounds", 0)):
            integer(key, low)
        for key in ("image_lr", "clip_norm", "server_lr", "temperature"):
            number(key, 0.0, low_open=True)
        for key in ("image_momentum", "server_momentum", "alpha"):
            number(key, 0.0, 1.0)
        for key in ("server_weight_decay", "contrastive_weight"):
            number(key, 0.0)
        number("b", -math.inf)
        if self.kernel not in KERNELS:
            raise bad("kernel", f"is not a known kernel (known: {list(KERNELS)})", self.kernel)
        for key in ("latent_constraints", "importance"):
            if not isinstance(getattr(self, key), bool):
                raise bad(key, "must be true or false", getattr(self, key))
        for key in ("augment", "server_augment"):
            check_strategy(getattr(self, key), f"{SECTION}.{key}")

    def update_steps(self, num_images: int) -> int:
        """SGD steps of the server's update on ``num_images`` kept condensed images."""
        if self.server_epochs > 0:
            return self.server_epochs * math.ceil(num_images / self.server_batch)
        return self.server_steps

    @classmethod
    def from_preset(cls, cfg: Mapping[str, Any]) -> "FedVCKConfig":
        """The ``fedvck`` section of a resolved preset (defaults for missing keys; unknown keys refused)."""
        section = cfg.get(SECTION) or {}
        if not isinstance(section, Mapping):
            raise ConfigError(f"preset section '{SECTION}' must be a dict, got {section!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise ConfigError(f"unknown key(s) {[f'{SECTION}.{k}' for k in unknown]} (known: {sorted(known)})")
        return cls(**dict(section))

    def as_dict(self) -> dict[str, Any]:
        """The settings as a plain dict (for the saved result and the logs)."""
        return dataclasses.asdict(self)
