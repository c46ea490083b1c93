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


# ---- FedIOD presets ----
# Keys besides data/model/train/eval: "fediod" (distillation settings, see medflare.fediod.config). "model" is the
# student and every site's default teacher (a site may choose its own teacher in local/medflare_site.json);
# "train" is stage 1 (each site's teacher, trained to completion).
def _fediod(base: str, overrides: Mapping, fediod: Mapping) -> dict[str, Any]:
    preset = _derive(base, overrides)
    preset["fediod"] = copy.deepcopy(dict(fediod))
    return preset


# CPU-scale distillation (measured, benchmarks/RESULTS_fediod.md): L_mimic as tau^2 KL at tau = 1 (Table 6's tau = 1
# column; Eq. 10's squared logit distance, tau -> inf, lets G's adversarial term outgrow the realism term in short
# runs and the student then predicts one class on real data), the realism term weighted up against the teacher
# terms (a few hundred steps leave the GAN far from realistic images otherwise), the reference code's class
# balance, faster G/D/S learning rates.
_FEDIOD_CLS_GAN = {"generator": {"name": "latent_generator", "args": {"latent_dim": 64, "width": 32}},
                   "discriminator": {"name": "patch_critic", "args": {"width": 16, "layers": 2}},
                   "mimic_tau": 1.0, "lambda_balance": 1.0, "lambda_gan": 5.0, "lambda_conf": 0.2, "lambda_unique": 0.2,
                   "lambda_mimic": 0.5, "lr_generator": 2e-3, "lr_discriminator": 2e-3, "lr_student": 3e-3}
# Laptop default (jobs/fediod): 4 sites of the synthetic classes with Dirichlet(0.5) label skew, 28x28, small ConvNets.
PRESETS["fediod_cls"] = _fediod(
    "cls_synthetic",
    {"data": {"num_sites": 4, "beta": 0.5, "scale": 0.5},
     "model": {"name": "convnet", "args": {"in_channels": 1, "num_classes": 10, "image_size": 28, "width": 32}},
     "train": {"epochs": 20, "batch_size": 32, "lr": 0.02}},
    {**_FEDIOD_CLS_GAN, "batch_size": 64, "steps_per_window": 10, "windows_per_round": 5},
)
# Tiny variant for end-to-end tests on a 2-core CPU: 3 sites, a third of the images, narrow ConvNets.
PRESETS["fediod_cls_tiny"] = _fediod(
    "cls_synthetic",
    {"data": {"num_sites": 3, "beta": 0.1, "scale": 0.3},
     "model": {"name": "convnet", "args": {"in_channels": 1, "num_classes": 10, "image_size": 28, "width": 16}},
     "train": {"epochs": 10, "batch_size": 32, "lr": 0.02}},
    {**_FEDIOD_CLS_GAN, "batch_size": 32, "steps_per_window": 8, "windows_per_round": 5},
)
# FedIOD paper scale (CIFAR setting): K=20 sites, Dir(0.1), 32x32, ResNet-8 (128/256/512) teachers and student,
# 100-d noise, PatchGAN critics of width 128, batch 64; run 300 rounds (the paper's epochs).
PRESETS["fediod_cls_paper"] = _fediod(
    "cls_synthetic",
    {"data": {"num_sites": 20, "beta": 0.1, "image_size": 32, "scale": 1.0},
     "model": {"name": "resnet8", "args": {"in_channels": 1, "num_classes": 10, "widths": [128, 256, 512]}},
     "train": {"epochs": 500, "batch_size": 16, "lr": 0.0025}},
    {"generator": {"name": "latent_generator", "args": {"latent_dim": 100, "width": 128}},
     "discriminator": {"name": "patch_critic", "args": {"width": 128, "layers": 2}},
     "batch_size": 64, "steps_per_window": 10, "windows_per_round": 10},
)
_FEDIOD_SEG_GAN = {"generator": {"name": "label_generator", "args": {"width": 16, "blocks": 3, "downsamplings": 2}},
                   "discriminator": {"name": "patch_critic", "args": {"width": 16, "layers": 2}}}
# Segmentation default (jobs/fediod_seg): the synthetic fundus-like sites at 64x64, UNet teachers and student.
PRESETS["fediod_seg"] = _fediod(
    "seg_synthetic",
    {"train": {"epochs": 20, "batch_size": 8, "lr": 3e-3},
     "eval": {"metrics": ["dice", "sensitivity", "specificity", "hd95"], "key_metric": "dice"}},
    {**_FEDIOD_SEG_GAN, "batch_size": 8, "steps_per_window": 5, "windows_per_round": 4},
)
PRESETS["fediod_seg_tiny"] = _fediod(
    "seg_synthetic_tiny",
    {"train": {"epochs": 8, "batch_size": 4, "lr": 1e-2},
     "eval": {"metrics": ["dice", "sensitivity", "specificity", "hd95"], "key_metric": "dice"}},
    {"generator": {"name": "label_generator", "args": {"width": 8, "blocks": 2, "downsamplings": 2}},
     "discriminator": {"name": "patch_critic", "args": {"width": 8, "layers": 2}},
     "batch_size": 4, "steps_per_window": 4, "windows_per_round": 3},
)
# Paper scale (BraTS setting): 256x256, 9-block ResNet generator of width 64, PatchGAN critics (3 layers, width 64),
# UNet teachers and student, batch 2; run 400 rounds.
PRESETS["fediod_seg_paper"] = _fediod(
    "seg_paper",
    {"train": {"epochs": 50, "batch_size": 16, "lr": 2e-3, "loss": "dicece"},
     "eval": {"metrics": ["dice", "sensitivity", "specificity", "hd95"], "key_metric": "dice"}},
    {"generator": {"name": "label_generator", "args": {"width": 64, "blocks": 9, "downsamplings": 2}},
     "discriminator": {"name": "patch_critic", "args": {"width": 64, "layers": 3}},
     "batch_size": 2, "steps_per_window": 4, "windows_per_round": 25, "lr_generator": 2e-4, "lr_student": 2e-4,
     "lr_discriminator": 2e-4},
)
