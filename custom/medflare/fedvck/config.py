"""FedVCK's algorithm settings: the ``fedvck`` section of a preset, read the same way by server and sites.

Both sides resolve the job's preset (with its overrides), so condensation (site) and global-model update
(server) settings cannot disagree, and a paper-scale run is a preset away (``cls_medmnist_paper``). A preset
without a ``fedvck`` section runs with the defaults below. Every value is checked once, by the section's rules
(:mod:`medflare.settings`), with a :class:`medflare.ConfigError` naming the key (``fedvck.<key>``).
"""

from __future__ import annotations

import math

from medflare import ConfigError
from medflare.settings import NON_NEGATIVE, POSITIVE, Bool, Check, Int, Number, OneOf, Section, section, setting

SECTION = "fedvck"
#: the MMD kernels of :mod:`.mmd`
KERNELS = ("linear", "gaussian")
#: the differentiable augmentation ops of :mod:`.augment`
OPS = ("color", "crop", "cutout", "flip", "scale", "rotate")


def check_strategy(strategy: str, key: str = "augment") -> tuple[str, ...]:
    """The ops of a "_"-joined strategy ("" = none); ConfigError naming ``key`` for an unknown op."""
    if not isinstance(strategy, str):
        raise ConfigError(f"{key} must be a string of '_'-joined ops, got {strategy!r}")
    ops = tuple(op for op in strategy.split("_") if op)
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ConfigError(f"{key}: unknown augmentation op(s) {unknown} in '{strategy}' (known: {list(OPS)})")
    return ops


def _strategy(key: str, value: str) -> str:
    check_strategy(value, key)
    return value


#: an augmentation strategy (kept as the string)
STRATEGY = Check(_strategy)
FRACTION = Number(0.0, 1.0)


@section(SECTION)
class FedVCKConfig(Section):
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

    ipc_percent: float = setting(5.0, Number(0.0, 100.0, low_open=True))
    min_ipc: int = setting(5, Int(1))
    iterations: int = setting(100, Int(0))
    real_batch: int = setting(64, Int(1))
    image_lr: float = setting(0.5, POSITIVE)
    image_momentum: float = setting(0.5, FRACTION)
    clip_norm: float = setting(10.0, POSITIVE)
    kernel: str = setting("linear", OneOf(KERNELS))
    latent_constraints: bool = setting(True, Bool())
    importance: bool = setting(True, Bool())
    alpha: float = setting(0.5, FRACTION)
    b: float = setting(0.7, Number())
    augment: str = setting("color_crop_cutout_scale_rotate", STRATEGY)
    server_steps: int = setting(300, Int(0))
    server_epochs: int = setting(0, Int(0))
    server_batch: int = setting(128, Int(1))
    server_lr: float = setting(0.01, POSITIVE)
    server_momentum: float = setting(0.9, FRACTION)
    server_weight_decay: float = setting(1e-6, NON_NEGATIVE)
    server_augment: str = setting("color_crop_cutout_scale_rotate", STRATEGY)
    contrastive_weight: float = setting(0.1, NON_NEGATIVE)
    temperature: float = setting(0.1, POSITIVE)
    top_k: int = setting(5, Int(1))
    projector_dim: int = setting(128, Int(1))
    keep_rounds: int = setting(10, Int(0))

    def update_steps(self, num_images: int) -> int:
        """SGD steps of the server's update on ``num_images`` kept condensed images."""
        if self.server_epochs > 0:
            return self.server_epochs * math.ceil(num_images / self.server_batch)
        return self.server_steps
