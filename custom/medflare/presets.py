"""Named presets: dataset, model and training settings that a job selects by name.

A job config says ``"preset": "seg_synthetic"`` and may override any key with ``"overrides"``;
paper-scale settings are therefore a preset away, not a code change. Both the server (to build the
initial model) and the clients (to build data, model and optimiser) resolve the same preset, so the
two sides cannot disagree on the architecture.

Keys of a preset:
    data:   passed to :func:`medflare.data.load_site` (``kind`` picks the dataset family; see there).
    model:  ``{"name": ..., "args": {...}}`` passed to :func:`medflare.nets.build_model`.
    train:  local supervised training, every algorithm's (:class:`TrainSettings`: each key, its default and check).
    eval:   scoring during a job (:class:`EvalSettings`).
    fedprox, fedsm, fedvck, fediod, fedst, diffusion: an algorithm's own settings (its ``config.py``), present only in
            the presets that set them; a preset without one runs with the section's defaults.

``train``, ``eval`` and the algorithms' sections are typed settings sections (:mod:`medflare.settings`, registered in
:data:`medflare.settings.SECTIONS` by name, not imported here): :func:`get_preset` checks every section a preset holds,
and overrides may set any documented key of one, listed by the preset or not. ``data`` and ``model`` keep their own
rule (their keys depend on the data kind and the network): overrides set only the keys the preset lists.

Batch size per device: ``train.batch_size`` is the CPU (and default) setting; a preset that trains
differently on a GPU says so in ``train.gpu_batch_size``. The paper presets keep the paper's batch size
on every device (the paper's optimisation), and their comments give the GPU setting that fills a GPU.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Mapping, Sequence

from medflare import ConfigError
from medflare.data.limits import LIMIT_DEFAULTS
from medflare.settings import POSITIVE, SECTIONS, Int, Items, Number, OneOf, Section, Text, section, setting, validate

#: a round's local work on small sites (issue 31), chosen from benchmarks/RESULTS_small_sites.md (FedAvg, 6 sites of
#: 57-152 training images, Dirichlet(0.5), 10 rounds, balanced test accuracy; centralised 0.980, 0.998 at these
#: defaults): without them 1-3 steps a round and 0.357 (3 of 4 classes predicted); min_steps 25 at batch cap 0.1: 0.978
#: in 9.1 s, the cheapest row within the issue's 10 points of centralised (25 at 0.25: 0.913 in 18.4 s; 50 at 0.25: 0.980
#: in 36.6 s; 10: 0.47-0.60; one seed a row). A
#: 5000-image site is unchanged (79 steps of 64 either way). ``warn_steps`` 10: a round cut below 10 steps (by
#: ``max_steps`` or an abort) is named in the site's log.
SMALL_SITE_DEFAULTS: dict[str, Any] = {"min_steps": 25, "max_batch_fraction": 0.1, "warn_steps": 10}
#: the same keys switched off (the behaviour before issue 31): the *_tiny presets, which exist for the speed of the
#: end-to-end suite on a 2-core CPU (their sites hold 5-250 cases); tests/e2e/test_small_sites.py runs the defaults
SMALL_SITE_OFF: dict[str, Any] = {"min_steps": 0, "max_batch_fraction": 1.0, "warn_steps": 0}

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
        "train": {"epochs": 3, "batch_size": 4, "lr": 1e-2, "optimizer": "adam", "loss": "dicece", "max_steps": 0,
                  **SMALL_SITE_OFF},
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
        "data": {"kind": "datalist", "num_classes": 3, **LIMIT_DEFAULTS},
        "model": {
            "name": "unet",
            "args": {"in_channels": 1, "out_channels": 3, "channels": [16, 32, 64, 128], "strides": [2, 2, 2]},
        },
        "train": {"epochs": 1, "batch_size": 4, "lr": 1e-3, "optimizer": "adam", "loss": "dice", "max_steps": 0},
        "eval": {"metrics": ["dice", "hd95"], "key_metric": "dice"},
    },
}



#: keys every preset has unless it sets them (merged under the preset by :func:`get_preset`)
DEFAULTS: dict[str, dict[str, Any]] = {
    "train": {"num_workers": 0, "gpu_batch_size": 0, "amp": "off", "optimizer_state": "kept", **SMALL_SITE_DEFAULTS},
    "eval": {"batch_size": 0, "costly_every": 5},
}

LOSSES = ("dice", "dicece", "dicefocal", "ce")
OPTIMIZERS = ("adam", "sgd")
OPTIMIZER_STATES = ("kept", "fresh")
AMP_MODES = ("off", "bf16", "fp16")


@section("train")
class TrainSettings(Section):
    """Local supervised training, read by every algorithm (:func:`medflare.common.training.local_work`).

    Keys (required: every preset names them; the others default as in :data:`DEFAULTS`):
        epochs: local epochs per round, >= 1. Required.
        batch_size: cases per step, >= 1: the CPU (and default) setting. Required.
        lr: learning rate, > 0 (0 trained nothing and ended rc 0; a negative one failed inside torch). Required.
        optimizer: "adam" | "sgd" (SGD with momentum 0.9). Required.
        loss: "dice" | "dicece" | "dicefocal" | "ce" (classification). Required.
        max_steps: cap on local steps per round, 0 = no cap. Required.
        num_workers: data-loader worker processes (a site's ``compute.workers`` wins). Default 0.
        gpu_batch_size: the batch size when the site trains on a GPU, 0 = ``batch_size``. Default 0.
        amp: "off" | "bf16" | "fp16" mixed-precision training (:func:`medflare.common.training.train_epochs`). Default "off".
        optimizer_state: "kept" | "fresh": whether a site's optimiser state (Adam's moments, SGD's momentum) carries from
            one round's local training to the next, as in NVFlare's examples and the FedSM reference, or each round
            starts a fresh optimiser from the received model (:func:`medflare.common.training.round_optimizer`).
            Default "kept". "fresh" took FedAvg off the segmentation model's early plateau at the three seeds where it
            stays there and cost 2.4-3.8 points at three seeds where it does not (benchmarks/RESULTS_report.md,
            "FedAvg's early plateau"), so the baselines keep "kept". FedSM's preset ``fedsm_synthetic`` sets "fresh":
            0.69 above kept moments over 19 seeds (benchmarks/RESULTS_fedsm.md, "A fresh optimiser each round").
        min_steps, max_batch_fraction, warn_steps: a round's local work on small sites (issue 31; defaults in
            :data:`SMALL_SITE_DEFAULTS`, chosen from benchmarks/RESULTS_small_sites.md): a round trains at least
            ``min_steps`` optimiser steps AND at least ``epochs`` epochs, the loader cycling until both hold, still
            capped by ``max_steps`` when > 0 (default 25); a batch never holds more than ``max_batch_fraction``, in
            (0, 1], of the site's training cases, at least 1, applied when the site's data is loaded and named in its
            start-up line (default 0.1); a site logs one warning line for a round of fewer than ``warn_steps`` steps,
            e.g. cut by ``max_steps`` or an abort (default 10).
    """

    epochs: int = setting(rule=Int(1))
    batch_size: int = setting(rule=Int(1))
    lr: float = setting(rule=POSITIVE)
    optimizer: str = setting(rule=OneOf(OPTIMIZERS))
    loss: str = setting(rule=OneOf(LOSSES))
    max_steps: int = setting(rule=Int(0))
    num_workers: int = setting(DEFAULTS["train"]["num_workers"], Int(0))
    gpu_batch_size: int = setting(DEFAULTS["train"]["gpu_batch_size"], Int(0))
    amp: str = setting(DEFAULTS["train"]["amp"], OneOf(AMP_MODES))
    optimizer_state: str = setting(DEFAULTS["train"]["optimizer_state"], OneOf(OPTIMIZER_STATES))
    min_steps: int = setting(SMALL_SITE_DEFAULTS["min_steps"], Int(0))
    max_batch_fraction: float = setting(SMALL_SITE_DEFAULTS["max_batch_fraction"], Number(0.0, 1.0, low_open=True))
    warn_steps: int = setting(SMALL_SITE_DEFAULTS["warn_steps"], Int(0))


@section("eval")
class EvalSettings(Section):
    """Scoring during a job.

    Keys:
        metrics: names from :mod:`medflare.metrics` reported each round. Required.
        key_metric: the metric that picks the best model. Required.
        batch_size: cases per forward pass in validation, 0 = ``train.batch_size`` (it changes no score). Default 0.
        costly_every: rounds between the costly metrics HD95, VI, AJI, object Dice during training, 0 = last round only
            (always in ``medflare evaluate``). Default 5.
    """

    metrics: list = setting(rule=Items(Text(empty=False), min_items=1))
    key_metric: str = setting(rule=Text(empty=False))
    batch_size: int = setting(DEFAULTS["eval"]["batch_size"], Int(0))
    costly_every: int = setting(DEFAULTS["eval"]["costly_every"], Int(0))


def _merge(base: dict, overrides: Mapping, where: str) -> dict:
    """``overrides`` merged into ``base`` in place (nested dicts key by key; ``args`` and lists replaced whole).

    A registered settings section (:data:`medflare.settings.SECTIONS`) takes any key: its class refuses an unknown one
    with the list of valid keys, and a preset need not hold the section to have it overridden. Elsewhere (``data``,
    ``model``, whose keys depend on the data kind and the network) only the keys the preset lists are accepted.
    """
    for key, value in overrides.items():
        path = f"{where}{key}"
        open_section = where.split(".")[0] in SECTIONS
        if not where and key in SECTIONS:
            if not isinstance(value, Mapping):
                raise ConfigError(f"overrides of section '{key}' must be a dict of its keys, got {value!r}")
            base[key] = _merge(copy.deepcopy(dict(base.get(key) or {})), value, f"{path}.")
            continue
        if key not in base and not open_section:
            known = sorted(set(base) | (set(SECTIONS) if not where else set()))
            raise ConfigError(f"unknown config key '{path}' (known: {known})")
        if isinstance(base.get(key), dict) and isinstance(value, Mapping) and key != "args":
            _merge(base[key], value, f"{path}.")
        else:
            base[key] = copy.deepcopy(value)
    return base


def get_preset(name: str, overrides: Mapping | None = None) -> dict[str, Any]:
    """Return a deep copy of preset ``name`` with ``overrides`` merged in (nested dicts merge key by key).

    Every settings section the result holds (``train``, ``eval`` and the algorithms': :data:`medflare.settings.SECTIONS`)
    is validated here, so a bad value stops a job at start with the key named (``lr`` 0 trained nothing, ``lr`` -0.01
    failed inside torch); overrides may set any documented key of a section, and an unknown one is a ConfigError naming
    the section and its valid keys. ``model.args`` is replaced as a whole because its keys depend on the network.
    """
    if name not in PRESETS:
        raise ConfigError(f"unknown preset '{name}' (known: {sorted(PRESETS)})")
    try:
        cfg = _merge(_with_defaults(PRESETS[name]), overrides or {}, "")
        validate(cfg)
    except ConfigError as err:
        raise ConfigError(f"preset '{name}': {err}") from None
    return cfg


def overrides_from_assignments(assignments: Sequence[str]) -> dict[str, Any]:
    """Nested overrides from ``key=value`` strings (``medflare run --set train.lr=0.01 --set fediod.ensemble=mean``).

    The key is a dotted path into the preset; the value is read as JSON when it parses (numbers, true/false, lists,
    objects) and kept as a string otherwise. Later assignments win; ConfigError names a malformed assignment.
    Whether a key exists is checked where the overrides are merged (:func:`get_preset`).
    """
    out: dict[str, Any] = {}
    for text in assignments:
        key, sep, raw = text.partition("=")
        path = key.strip().split(".")
        if not sep or not all(path):
            raise ConfigError(f"--set expects key=value with a dotted key (e.g. train.lr=0.01), got {text!r}")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        node = out
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[path[-1]] = value
    return out


def assignments_from_overrides(overrides: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Inverse of :func:`overrides_from_assignments`: ``{"data": {"scale": 0.25}}`` -> ``["data.scale=0.25"]`` (values
    as JSON), how a command line would say them (e.g. the settings a report's rows ran with)."""
    out: list[str] = []
    for key, value in overrides.items():
        if isinstance(value, Mapping) and value:
            out += assignments_from_overrides(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={json.dumps(value)}")
    return out


def _with_defaults(preset: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of ``preset`` with the :data:`DEFAULTS` keys it does not set."""
    out = copy.deepcopy(dict(preset))
    for name, keys in DEFAULTS.items():
        if isinstance(out.get(name), dict):
            out[name] = {**copy.deepcopy(keys), **out[name]}
    return out


def _derive(base: str, overrides: Mapping) -> dict[str, Any]:
    return _merge(_with_defaults(PRESETS[base]), overrides, "")


# Small classification variant for end-to-end tests: a third of the images, a narrower ConvNet.
PRESETS["cls_synthetic_tiny"] = _derive(
    "cls_synthetic",
    {
        "data": {"scale": 0.34},
        "model": {"args": {"in_channels": 1, "num_classes": 10, "image_size": 28, "width": 32}},
        "train": {"epochs": 2, "batch_size": 32, "lr": 2e-2, **SMALL_SITE_OFF},
    },
)

# FedSM's default (jobs/fedsm, 20 rounds): seg_synthetic with the paper's one local epoch a round, so 20 rounds train
# the local epochs of the baselines' 10 rounds x 2 epochs (in steps: on the report's six sites, whose epochs are 10-15
# steps, the small-site guard's min_steps 25 makes every FedSM round 25 steps, 500 a site, and a baseline round 25-30,
# 250-300 a site; benchmarks/RESULTS_fedsm.md, "Eight seeds against centralised"). Measured (benchmarks/RESULTS_fedsm.md,
# "Closing the gap to centralised", 6 sites): client average 81.25 +- 0.37 over 3 seeds, against 79.07 for 10 x 2
# epochs (seed 0) and centralised 81.77 +- 0.50; the gain is in the SoftPull-personalised models, which meet the global
# model twice as often. Each round's local training starts a fresh optimiser (train.optimizer_state "fresh"), the
# default since session 69 by a rule written before the seeds that decided it (benchmarks/RESULTS_fedsm.md, "A fresh
# optimiser each round"): against the Adam moments kept across rounds, +0.64 [+0.01, +1.27] over seeds 18-25 and
# +0.69 [+0.39, +1.00] over 19 seeds; against centralised -0.11 [-0.59, +0.37] over the same 19 seeds.
PRESETS["fedsm_synthetic"] = _derive("seg_synthetic", {"train": {"epochs": 1, "optimizer_state": "fresh"}})

# ---- hospital data presets ----
# A site's own data as hospitals store it (see docs/hospital_data.md for every key and worked examples).
# Volumes: 3D NIfTI in a Decathlon datalist or an MSD dataset.json (MEDFLARE_DATA/<site>.json), binary
# foreground by default (override data.num_classes, data.labels and model.args.out_channels together).
_VOLUME_DATA = {
    "kind": "volumes",
    "num_classes": 2,
    "labels": "auto",
    "channels": 1,
    "channel_indices": None,
    "orientation": "RAS",
    "spacing": None,
    "intensity": "percentile",
    "percentiles": [0.5, 99.5],
    "window": [-160.0, 240.0],
    "augment": {"flip": 0.5, "rotate": 15.0, "intensity": 0.1, "contrast": 0.2, "prob": 0.3},
    "cache": {"mode": "memory", "rate": 1.0, "dir": None},
    "val_fraction": 0.2,
    "test_fraction": 0.2,
    "seed": 0,
    **LIMIT_DEFAULTS,  # the largest image a site reads, from its header (medflare.data.limits)
}
_VOLUME_EVAL = {"metrics": ["dice", "hd95", "surface_dice_2mm"], "key_metric": "dice"}
# 2D models on slices drawn from the volumes (FedSM's prostate MRI, FedIOD's BraTS).
PRESETS["seg_volumes_2d"] = {
    "data": {**copy.deepcopy(_VOLUME_DATA), "spatial_dims": 2, "image_size": [128, 128], "fit": "resize",
             "slices": {"axis": 2, "select": "all", "ratio": 1.0}},
    "model": {
        "name": "unet",
        "args": {"in_channels": 1, "out_channels": 2, "channels": [16, 32, 64, 128], "strides": [2, 2, 2],
                 "num_res_units": 2},
    },
    "train": {"epochs": 1, "batch_size": 8, "lr": 1e-3, "optimizer": "adam", "loss": "dicece", "max_steps": 0, "amp": "off"},
    "eval": copy.deepcopy(_VOLUME_EVAL),
}
# 3D models on random patches (half of them centred on foreground: data.patch.pos_fraction), scored by
# sliding-window inference over whole volumes.
PRESETS["seg_volumes_3d"] = {
    "data": {**copy.deepcopy(_VOLUME_DATA), "spatial_dims": 3,
             "patch": {"size": [96, 96, 32], "per_volume": 4, "pos_fraction": 0.5, "overlap": 0.25, "sw_batch_size": 4}},
    "model": {
        "name": "unet",
        "args": {"in_channels": 1, "out_channels": 2, "channels": [16, 32, 64, 128], "strides": [2, 2, 2],
                 "num_res_units": 2, "spatial_dims": 3},
    },
    "train": {"epochs": 1, "batch_size": 2, "lr": 1e-3, "optimizer": "adam", "loss": "dicece", "max_steps": 0, "amp": "off"},
    "eval": copy.deepcopy(_VOLUME_EVAL),
}
# 2D photographs of any size and channel count, e.g. colour fundus images (MEDFLARE_DATA/<site>.json, from
# `medflare data --from-folder`), resized to the model's input; masks stored 0/255 become 0/1.
PRESETS["seg_images_2d"] = {
    "data": {
        "kind": "datalist", "num_classes": 2, "labels": "auto", "channels": 3, "channel_indices": None,
        "intensity": "minmax", "percentiles": [0.5, 99.5], "window": [-160.0, 240.0],
        "image_size": [256, 256], "fit": "resize",
        "augment": {"flip": 0.5, "rotate": 15.0, "intensity": 0.1, "contrast": 0.2, "prob": 0.3},
        "cache": {"mode": "memory", "rate": 1.0, "dir": None},
        "val_fraction": 0.2, "test_fraction": 0.2, "seed": 0, **LIMIT_DEFAULTS,
    },
    "model": {
        "name": "unet",
        "args": {"in_channels": 3, "out_channels": 2, "channels": [16, 32, 64, 128, 256], "strides": [2, 2, 2, 2],
                 "num_res_units": 2},
    },
    "train": {"epochs": 1, "batch_size": 8, "lr": 1e-3, "optimizer": "adam", "loss": "dicece", "max_steps": 0, "amp": "off"},
    "eval": {"metrics": ["dice", "hd95"], "key_metric": "dice"},
}

# ---- Speed presets ----
# Batch size per device of the paper preset (FedSM: batch 1). Training keeps the paper's batch 1 on every
# device, because a larger batch is a different optimisation (8x fewer Adam steps per epoch). On a GPU a
# batch-1 step is launch-bound (issue 11, H100: 15.7 ms per step at batch 1, 16.8 ms at batch 8), so
# ``{"train": {"gpu_batch_size": 8}}`` sees about 8x the images per second there: use it when a faster
# epoch matters more than the paper's setting. Validation batches change no score, so they are 8 cases
# everywhere (eval.batch_size); on a 2-core CPU batch 1 and batch 8 inference cost the same per case.
PRESETS["seg_paper"]["eval"]["batch_size"] = 8

def _with_section(name: str):
    """A builder ``(base, overrides, values)`` of presets derived from ``base`` with section ``name`` set to ``values``."""

    def build(base: str, overrides: Mapping, values: Mapping) -> dict[str, Any]:
        return _derive(base, {**overrides, name: values})

    return build


# ---- FedVCK presets ----
# The ``fedvck`` section is read by medflare.fedvck.config.FedVCKConfig (every key documented there and in
# jobs/fedvck/README.md; its defaults fill the keys a preset leaves out; overrides may set any of its keys, as of every
# registered section). ``train`` is unused by FedVCK and kept so that the baselines run on the same preset.
_with_fedvck = _with_section("fedvck")


# Default job on the 2-core CPU: the 10 embedded classification sites, a width-32 ConvNet (as FedAvg is run on it).
PRESETS["fedvck_synthetic"] = _with_fedvck(
    "cls_synthetic",
    {"model": {"args": {"in_channels": 1, "num_classes": 10, "image_size": 28, "width": 32}}},
    {"ipc_percent": 5.0, "min_ipc": 5, "iterations": 20, "real_batch": 16, "image_lr": 0.5, "server_steps": 100, "server_batch": 64,
     "server_lr": 0.03},
)
# End-to-end tests: a third of the images, a width-16 ConvNet, short condensation and update.
PRESETS["fedvck_synthetic_tiny"] = _with_fedvck(
    "cls_synthetic_tiny",
    {"model": {"args": {"in_channels": 1, "num_classes": 10, "image_size": 28, "width": 16}}},
    {"ipc_percent": 5.0, "min_ipc": 3, "iterations": 15, "real_batch": 16, "image_lr": 0.5, "server_steps": 60, "server_batch": 64},
)
# The paper's scale (GPU): ConvNetBN width 128 with the reference's 3-pixel first padding (~320K parameters),
# 28x28 MedMNIST-layout .npz per site (MEDFLARE_DATA), p = 1 %, 5000 condensation steps on 256 real images per
# class, 1000 server epochs per round at batch 256 (reference run.sh, PathMNIST/OrganSMNIST rows). Set
# data.num_classes / model.args.num_classes to the data set's (Path 9, OCT 4, OrganS 11) and p to 1, 2 or 5.
_PAPER_MODEL = {"model": {"args": {"in_channels": 1, "num_classes": 10, "image_size": 28, "width": 128, "first_padding": 3}}}
_PAPER_FEDVCK = {"ipc_percent": 1.0, "min_ipc": 5, "iterations": 5000, "real_batch": 256, "image_lr": 0.2, "server_epochs": 1000,
                 "server_batch": 256, "server_lr": 0.001, "contrastive_weight": 0.1, "temperature": 0.1, "top_k": 5}
PRESETS["cls_medmnist_paper"] = _with_fedvck("cls_medmnist", _PAPER_MODEL, _PAPER_FEDVCK)
# The same scale on the embedded synthetic sites (the benchmark's sites on a GPU).
PRESETS["fedvck_synthetic_paper"] = _with_fedvck("cls_synthetic", _PAPER_MODEL, _PAPER_FEDVCK)

# ---- FedIOD presets ----
# Keys besides data/model/train/eval: "fediod" (distillation settings, see medflare.fediod.config). "model" is the
# student and every site's default teacher (a site may choose its own teacher in local/medflare_site.json);
# "train" is stage 1 (each site's teacher, trained to completion).
_fediod = _with_section("fediod")


# CPU-scale distillation (measured, benchmarks/RESULTS_fediod.md): L_mimic as tau^2 KL at tau = 1 (Table 6's tau = 1
# column; Eq. 10's squared logit distance, tau -> inf, lets G's adversarial term outgrow the realism term in short
# runs and the student then predicts one class on real data), the realism term weighted up against the teacher
# terms (a few hundred steps leave the GAN far from realistic images otherwise), the reference code's class
# balance, faster G/D/S learning rates, and 5 more student steps per generated batch replayed from a server-side bank
# of the last 4096 generated inputs with their ensemble logits (medflare.fediod.replay; no extra messages).
_FEDIOD_CLS_GAN = {"generator": {"name": "latent_generator", "args": {"latent_dim": 64, "width": 32}},
                   "discriminator": {"name": "patch_critic", "args": {"width": 16, "layers": 2}},
                   "mimic_tau": 1.0, "lambda_balance": 1.0, "lambda_gan": 5.0, "lambda_conf": 0.2, "lambda_unique": 0.2,
                   "lambda_mimic": 0.5, "lr_generator": 2e-3, "lr_discriminator": 2e-3, "lr_student": 3e-3,
                   "student_steps": 6, "replay_size": 4096}
# Laptop default (jobs/fediod): 4 sites of the synthetic classes with Dirichlet(0.5) label skew, 28x28, small ConvNets.
# Teachers trained with outlier exposure (teacher_outliers 0.5, not in the paper): on the report's 10 sites, 10 rounds,
# seeds 0-2, the student goes from 77.21 to 84.86 % at Dir(0.5) and from 16.54 to 48.17 % at Dir(0.05); on this
# preset's 4 sites 82.74 against 83.26 (benchmarks/RESULTS_fediod.md, "Outlier exposure at the report's skews").
PRESETS["fediod_cls"] = _fediod(
    "cls_synthetic",
    {"data": {"num_sites": 4, "beta": 0.5, "scale": 0.5},
     "model": {"name": "convnet", "args": {"in_channels": 1, "num_classes": 10, "image_size": 28, "width": 32}},
     "train": {"epochs": 20, "batch_size": 32, "lr": 0.02}},
    {**_FEDIOD_CLS_GAN, "batch_size": 64, "steps_per_window": 10, "windows_per_round": 5, "teacher_outliers": 0.5},
)
# Tiny variant for end-to-end tests on a 2-core CPU: 3 sites with strong label skew (Dir(0.2): each teacher scores
# 0.41-0.54 on the union of the sites' test sets, their label-weighted ensemble 0.84, so a student can pass every
# teacher), narrow ConvNets, 80 steps a round. Besides the replay of _FEDIOD_CLS_GAN, the teachers' BatchNorm-
# statistics prior (lambda_bn, not in the paper) makes G cover every class at this skew; with both the student
# passes the best teacher within 400 steps (measured, benchmarks/RESULTS_fediod.md).
PRESETS["fediod_cls_tiny"] = _fediod(
    "cls_synthetic",
    {"data": {"num_sites": 3, "beta": 0.2, "scale": 0.5},
     "model": {"name": "convnet", "args": {"in_channels": 1, "num_classes": 10, "image_size": 28, "width": 16}},
     "train": {"epochs": 20, "batch_size": 32, "lr": 0.02, **SMALL_SITE_OFF}},
    {**_FEDIOD_CLS_GAN, "batch_size": 32, "steps_per_window": 8, "windows_per_round": 10, "lambda_bn": 10.0},
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
# What makes the segmentation student learn every site's contrast (measured, jobs/fediod_seg/README.md "Why the student
# failed"; none of it is in the paper): a generator with one style code per site whose inputs are each judged by the
# critic of the site they were drawn for (with the paper's G every critic judges every input and G draws one contrast),
# G asked to draw images that this site's teacher segments as the conditioning label map (lambda_label) and the student
# learning that label map besides the ensemble (student_label), the classification CPU presets' loss weights and the
# student's replay of past generated inputs. The saved student's decision offset is chosen on the sites' validation
# splits (calibrate_offsets; it under-segments real images otherwise; jobs/fediod_seg/README.md "The decision offset").
# Perturbing the replayed images' intensities (student_augment) measured no better over four seeds and stays off
# ("Intensity perturbations" there).
_FEDIOD_SEG_FIX = {"mimic_tau": 1.0, "lambda_gan": 5.0, "lambda_conf": 0.2, "lambda_unique": 0.2, "lambda_mimic": 0.5,
                   "lambda_label": 3.0, "student_label": 3.0, "student_steps": 6, "replay_size": 2048,
                   "lr_generator": 2e-3, "lr_discriminator": 2e-3, "lr_student": 3e-3,
                   "calibrate_offsets": [-1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]}
_FEDIOD_SEG_GAN = {"generator": {"name": "label_generator", "args": {"width": 16, "blocks": 3, "downsamplings": 2, "styles": 8}},
                   "discriminator": {"name": "patch_critic", "args": {"width": 16, "layers": 2}}}
# Segmentation default (jobs/fediod_seg): the synthetic fundus-like sites at 64x64, UNet teachers and student.
PRESETS["fediod_seg"] = _fediod(
    "seg_synthetic",
    {"train": {"epochs": 20, "batch_size": 8, "lr": 3e-3},
     "eval": {"metrics": ["dice", "sensitivity", "specificity", "hd95"], "key_metric": "dice"}},
    {**_FEDIOD_SEG_GAN, **_FEDIOD_SEG_FIX, "batch_size": 8, "steps_per_window": 5, "windows_per_round": 4},
)
PRESETS["fediod_seg_tiny"] = _fediod(
    "seg_synthetic_tiny",
    {"train": {"epochs": 8, "batch_size": 4, "lr": 1e-2},
     "eval": {"metrics": ["dice", "sensitivity", "specificity", "hd95"], "key_metric": "dice"}},
    {"generator": {"name": "label_generator", "args": {"width": 8, "blocks": 2, "downsamplings": 2, "styles": 8}},
     "discriminator": {"name": "patch_critic", "args": {"width": 8, "layers": 2}},
     **_FEDIOD_SEG_FIX, "batch_size": 4, "steps_per_window": 4, "windows_per_round": 3},
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

# ---- FedST presets ----
# Segmentation as seg_synthetic, trained with focal + Dice (the paper's L_LDS / L_CDS) and scored with Table 1's
# metrics (VI, Dice, MPA); a "diffusion" section configures the label-conditioned generator (keys documented in
# medflare.fedst.config.DiffusionConfig) and "fedst" the workflow's (segmentation rounds; medflare.fedst.config.FedSTConfig).
# Sizes are picked for a 2-core CPU; a GPU is used when present.
def _fedst(base: str, overrides: Mapping, diffusion: Mapping, rounds: int) -> dict[str, Any]:
    preset = _derive(base, {"train": {"loss": "dicefocal"}, "eval": {"metrics": ["dice", "vi", "mpa"], "key_metric": "dice"}})
    return _merge(preset, {**overrides, "diffusion": diffusion, "fedst": {"rounds": rounds}}, "")


# Laptop default: 64x64 sites, a 4-level generator (8..32 channels, 0.26M parameters), rectified flow with 20 Euler
# steps (on these sites it draws images a segmentation model reads as well as real ones in 10-20 steps, where DDIM
# with the same training budget does not; benchmarks/RESULTS_fedst.md). FedST-join averages its generator every 8 local
# steps (sync_steps 8: 13 exchanges a round of 100 steps) and sends, after a site's first download, 4-bit diffs both
# ways with error feedback (exchange_dtype int4, 0.269 of float16's bytes a transfer): at the report's six sites one
# average per round draws their mixture style for every domain vector, a few a round draw it flat at some seeds, and
# averages every 5-8 steps draw every site's style (issue 32, benchmarks/RESULTS_fedst.md "Six sites", "Is the exchange
# schedule the gap?"). Over seeds 0-5 it scores 78.25 +- 0.33 Dice against FedST-separate's 78.87 +- 0.81
# (paired -0.62) and the previous preset's 77.32 +- 0.84 (three float16 averages a round with domain guidance 0.5;
# paired +0.93, 6 of 6 seeds), at 318.02 MB in all, 4.99x FedST-separate's 63.75 MB (the previous 274.62 MB, 4.3x)
# ("Four-bit diffs every 8 steps at full scale"). No domain guidance: once the generator follows style, guidance
# overshoots the inverted sites' contrast ("Is the exchange schedule the gap?").
PRESETS["fedst"] = _fedst(
    "seg_synthetic", {"train": {"epochs": 2, "batch_size": 8, "lr": 3e-3}},
    {"generator": {"channels": [8, 16, 32, 32], "num_res_blocks": 1, "attention_levels": [False, False, False, False],
                   "norm_num_groups": 8, "num_head_channels": 8},
     "scheduler": "rflow", "prediction": "epsilon", "train_timesteps": 1000, "sampler": "ddim", "sample_steps": 20,
     "lr": 2e-3, "domain_lr": 2e-2, "batch_size": 8, "warmup_steps": 800, "steps_per_round": 100, "sync_steps": 8,
     "exchange_dtype": "int4", "domain_guidance": 0.0,
     "warmup_rounds": 3,
     "num_synthetic": 0, "sample_batch": 32},
    rounds=8,
)
# End-to-end tests: 32x32, a quarter of the cases, a 3-level generator (8..16 channels, 68K parameters), rectified
# flow with 10 steps. Two sites: FedST-join averages once per round with keep_other_domains 5, which follows style at
# two sites (not at six, see above), and sends the generator in float16 (int4 follows style there too, the e2e test's
# second join run, but its Dice at two sites was not measured).
PRESETS["fedst_tiny"] = _fedst(
    "seg_synthetic_tiny", {"train": {"epochs": 3, "batch_size": 4, "lr": 1e-2}},
    {"generator": {"channels": [8, 16, 16], "num_res_blocks": 1, "attention_levels": [False, False, False],
                   "norm_num_groups": 4, "num_head_channels": 4},
     "scheduler": "rflow", "prediction": "epsilon", "train_timesteps": 1000, "sampler": "ddim", "sample_steps": 10,
     "lr": 2e-3, "domain_lr": 2e-2, "batch_size": 8, "warmup_steps": 160, "steps_per_round": 80, "sync_steps": 0, "keep_other_domains": 5.0,
     "exchange_dtype": "float16",
     "warmup_rounds": 2,
     "num_synthetic": 0, "sample_batch": 32},
    rounds=3,
)
# Paper scale (Ma et al. 2024, medical task): 384x384, batch 6, Adam 1e-4, 50 rounds, 1 local epoch (FedST-join's generator
# averaged once per round as in the paper: sync_steps 0, not measured at this scale); the generator is
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
     "lr": 5e-5, "domain_lr": 5e-4, "batch_size": 6, "warmup_steps": 20000, "steps_per_round": 400, "sync_steps": 0, "warmup_rounds": 10,
     "num_synthetic": 0, "sample_batch": 8},
    rounds=50,
)
# CPU benchmark on a shared 2-core machine (benchmarks/fedst_benchmark.py): fedst_tiny's networks at 32x32 on all cases
# of every site (scale 1.0), 8 rounds.
PRESETS["fedst_small"] = _derive("fedst_tiny", {"data": {"scale": 1.0}, "train": {"epochs": 2, "batch_size": 8, "lr": 3e-3},
                                               "diffusion": {"warmup_steps": 400, "steps_per_round": 100, "warmup_rounds": 3},
                                               "fedst": {"rounds": 8}})
