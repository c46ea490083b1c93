"""Named presets: dataset, model and training settings that a job selects by name.

A job config says ``"preset": "seg_synthetic"`` and may override any key with ``"overrides"``;
paper-scale settings are therefore a preset away, not a code change. Both the server (to build the
initial model) and the clients (to build data, model and optimiser) resolve the same preset, so the
two sides cannot disagree on the architecture.

Keys of a preset:
    data:   passed to :func:`medflare.data.load_site` (``kind`` picks the dataset family; see there).
    model:  ``{"name": ..., "args": {...}}`` passed to :func:`medflare.nets.build_model`.
    train:  local training: ``epochs`` (local epochs per round), ``batch_size``, ``lr``,
            ``optimizer`` ("adam" | "sgd"), ``loss`` ("dice" | "dicece" | "ce"), ``max_steps``
            (cap on local steps per round, 0 = no cap), ``num_workers``.
    eval:   ``metrics`` reported each round (names from :mod:`medflare.metrics`), ``key_metric``.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from medflare import ConfigError, MedflareError

PRESETS: dict[str, dict[str, Any]] = {
    # Laptop default: 64x64 synthetic fundus-like sites, 2 foreground classes (disc rim, cup).
    "seg_synthetic": {
        "data": {"kind": "synthetic_seg", "image_size": 64, "num_classes": 3, "seed": 0, "scale": 1.0},
        "model": {
            "name": "unet",
            "args": {"in_channels": 1, "out_channels": 3, "channels": [8, 16, 32, 64], "strides": [2, 2, 2]},
        },
        # Dice + CE: on 64x64 the small cup class is learned within the default 10 rounds (Dice alone: not).
        "train": {"epochs": 2, "batch_size": 8, "lr": 3e-3, "optimizer": "adam", "loss": "dicece", "max_steps": 0},
        "eval": {"metrics": ["dice", "dice_c1", "dice_c2"], "key_metric": "dice"},
    },
    # Tiny variant for end-to-end tests on a 2-core CPU.
    "seg_synthetic_tiny": {
        "data": {"kind": "synthetic_seg", "image_size": 32, "num_classes": 3, "seed": 0, "scale": 0.25},
        "model": {
            "name": "unet",
            "args": {"in_channels": 1, "out_channels": 3, "channels": [8, 16, 32], "strides": [2, 2]},
        },
        "train": {"epochs": 3, "batch_size": 4, "lr": 1e-2, "optimizer": "adam", "loss": "dicece", "max_steps": 0},
        "eval": {"metrics": ["dice"], "key_metric": "dice"},
    },
    # FedSM paper scale (256x256, reference UNet 16..256 with 2 residual units, batch 1, 100 rounds).
    "seg_paper": {
        "data": {"kind": "synthetic_seg", "image_size": 256, "num_classes": 3, "seed": 0, "scale": 1.0},
        "model": {
            "name": "unet",
            "args": {
                "in_channels": 1,
                "out_channels": 3,
                "channels": [16, 32, 64, 128, 256],
                "strides": [2, 2, 2, 2],
                "num_res_units": 2,
            },
        },
        "train": {"epochs": 1, "batch_size": 1, "lr": 1e-3, "optimizer": "adam", "loss": "dice", "max_steps": 0},
        "eval": {"metrics": ["dice", "dice_c1", "dice_c2", "hd95"], "key_metric": "dice"},
    },
    # Classification: 10 synthetic classes, 28x28, Dirichlet(beta) label skew over 10 sites.
    "cls_synthetic": {
        "data": {
            "kind": "synthetic_cls",
            "image_size": 28,
            "channels": 1,
            "num_classes": 10,
            "num_sites": 10,
            "beta": 0.1,
            "style_shift": True,
            "seed": 0,
            "scale": 1.0,
        },
        "model": {"name": "convnet", "args": {"in_channels": 1, "num_classes": 10, "image_size": 28}},
        "train": {"epochs": 1, "batch_size": 64, "lr": 1e-2, "optimizer": "sgd", "loss": "ce", "max_steps": 0},
        "eval": {"metrics": ["accuracy"], "key_metric": "accuracy"},
    },
    # Classification on a site's own MedMNIST-layout .npz (MEDFLARE_DATA/<site>.npz).
    "cls_medmnist": {
        "data": {"kind": "npz", "num_classes": 10, "channels": 1},
        "model": {"name": "convnet", "args": {"in_channels": 1, "num_classes": 10, "image_size": 28}},
        "train": {"epochs": 1, "batch_size": 64, "lr": 1e-2, "optimizer": "sgd", "loss": "ce", "max_steps": 0},
        "eval": {"metrics": ["accuracy"], "key_metric": "accuracy"},
    },
    # Segmentation on a site's own Decathlon datalist (MEDFLARE_DATA/<site>.json).
    "seg_datalist": {
        "data": {"kind": "datalist", "num_classes": 3},
        "model": {
            "name": "unet",
            "args": {"in_channels": 1, "out_channels": 3, "channels": [16, 32, 64, 128], "strides": [2, 2, 2]},
        },
        "train": {"epochs": 1, "batch_size": 4, "lr": 1e-3, "optimizer": "adam", "loss": "dice", "max_steps": 0},
        "eval": {"metrics": ["dice", "hd95"], "key_metric": "dice"},
    },
}


def _merge(base: dict, overrides: Mapping, where: str) -> dict:
    for key, value in overrides.items():
        if key not in base:
            raise ConfigError(f"unknown config key '{where}{key}' (known: {sorted(base)})")
        if isinstance(base[key], dict) and isinstance(value, Mapping) and key != "args":
            _merge(base[key], value, f"{where}{key}.")
        else:
            base[key] = copy.deepcopy(value)
    return base


def get_preset(name: str, overrides: Mapping | None = None) -> dict[str, Any]:
    """Return a deep copy of preset ``name`` with ``overrides`` merged in (nested dicts merge key by key).

    Raises MedflareError naming the preset or the key when either is unknown; ``model.args`` is replaced
    as a whole because its keys depend on the network.
    """
    if name not in PRESETS:
        raise ConfigError(f"unknown preset '{name}' (known: {sorted(PRESETS)})")
    return _merge(copy.deepcopy(PRESETS[name]), overrides or {}, "")


def _derive(base: str, overrides: Mapping) -> dict[str, Any]:
    return _merge(copy.deepcopy(PRESETS[base]), overrides, "")


# Small classification variant for end-to-end tests: a third of the images, a narrower ConvNet.
PRESETS["cls_synthetic_tiny"] = _derive(
    "cls_synthetic",
    {
        "data": {"scale": 0.34},
        "model": {"args": {"in_channels": 1, "num_classes": 10, "image_size": 28, "width": 32}},
        "train": {"epochs": 2, "batch_size": 32, "lr": 2e-2},
    },
)


# ---- FedST presets ----
# Segmentation as seg_synthetic, trained with focal + Dice (the paper's L_LDS / L_CDS) and scored with Table 1's
# metrics (VI, Dice, MPA); a "diffusion" section configures the label-conditioned generator (keys documented in
# medflare.fedst.diffusion) and "fedst" the recipe defaults. Sizes are picked for a 2-core CPU; a GPU is used
# when present.
def _fedst(base: str, overrides: Mapping, diffusion: Mapping, rounds: int) -> dict[str, Any]:
    preset = _merge(_derive(base, {"train": {"loss": "dicefocal"}, "eval": {"metrics": ["dice", "vi", "mpa"], "key_metric": "dice"}}), overrides, "")
    return {**preset, "diffusion": dict(diffusion), "fedst": {"rounds": rounds}}


# Laptop default: 64x64 sites, a 4-level generator (8..32 channels, 0.26M parameters), rectified flow with 20 Euler
# steps (on these sites it draws images a segmentation model reads as well as real ones in 10-20 steps, where DDIM
# with the same training budget does not; benchmarks/RESULTS_fedst.md).
PRESETS["fedst"] = _fedst(
    "seg_synthetic", {"train": {"epochs": 2, "batch_size": 8, "lr": 3e-3}},
    {"generator": {"channels": [8, 16, 32, 32], "num_res_blocks": 1, "attention_levels": [False, False, False, False],
                   "norm_num_groups": 8, "num_head_channels": 8},
     "scheduler": "rflow", "prediction": "epsilon", "train_timesteps": 1000, "sampler": "ddim", "sample_steps": 20,
     "lr": 2e-3, "domain_lr": 2e-2, "batch_size": 8, "warmup_steps": 800, "steps_per_round": 100, "warmup_rounds": 3,
     "num_synthetic": 0, "sample_batch": 32},
    rounds=8,
)
# End-to-end tests: 32x32, a quarter of the cases, a 3-level generator (8..16 channels, 68K parameters), rectified
# flow with 10 steps.
PRESETS["fedst_tiny"] = _fedst(
    "seg_synthetic_tiny", {"train": {"epochs": 3, "batch_size": 4, "lr": 1e-2}},
    {"generator": {"channels": [8, 16, 16], "num_res_blocks": 1, "attention_levels": [False, False, False],
                   "norm_num_groups": 4, "num_head_channels": 4},
     "scheduler": "rflow", "prediction": "epsilon", "train_timesteps": 1000, "sampler": "ddim", "sample_steps": 10,
     "lr": 2e-3, "domain_lr": 2e-2, "batch_size": 8, "warmup_steps": 160, "steps_per_round": 80, "warmup_rounds": 2,
     "num_synthetic": 0, "sample_batch": 32},
    rounds=3,
)
# Paper scale (Ma et al. 2024, medical task): 384x384, batch 6, Adam 1e-4, 50 rounds, 1 local epoch; the generator is
# Palette's UNet (base 64, multipliers 1-2-4-8, 2 residual blocks, attention at 1/16 resolution -> 24x24 here), 1000
# ancestral DDPM sampling steps, Adam 5e-5. The segmentation UNet stays MONAI's (5 levels, 32..512).
PRESETS["fedst_paper"] = _fedst(
    "seg_paper",
    {"data": {"image_size": 384}, "train": {"epochs": 1, "batch_size": 6, "lr": 1e-4},
     "model": {"args": {"in_channels": 1, "out_channels": 3, "channels": [32, 64, 128, 256, 512], "strides": [2, 2, 2, 2],
                        "num_res_units": 2}}},
    {"generator": {"channels": [64, 128, 256, 512], "num_res_blocks": 2, "attention_levels": [False, False, False, True],
                   "norm_num_groups": 32, "num_head_channels": 32},
     "scheduler": "ddpm", "prediction": "epsilon", "train_timesteps": 1000, "sampler": "ddpm", "sample_steps": 1000,
     "lr": 5e-5, "domain_lr": 5e-4, "batch_size": 6, "warmup_steps": 20000, "steps_per_round": 400, "warmup_rounds": 10,
     "num_synthetic": 0, "sample_batch": 8},
    rounds=50,
)
# CPU benchmark on a shared 2-core machine (benchmarks/fedst_benchmark.py): fedst_tiny's networks at 32x32 on all cases
# of every site (scale 1.0), 8 rounds.
PRESETS["fedst_small"] = {**_derive("fedst_tiny", {"data": {"scale": 1.0}, "train": {"epochs": 2, "batch_size": 8, "lr": 3e-3},
                                                   "diffusion": {"warmup_steps": 400, "steps_per_round": 100, "warmup_rounds": 3}}),
                          "fedst": {"rounds": 8}}
