"""Stage 1 of FedIOD: a site trains its teacher T_k on its own data to completion, once (no FLARE).

A site chooses its teacher in the ``fediod`` section of its own ``local/medflare_site.json`` (FedIOD is
model-agnostic: sites may differ in architecture); absent keys fall back to the job's preset (``model``
and ``train``)::

    {"fediod": {"teacher": {"name": "convnet", "args": {"width": 32}},   # in_channels/num_classes filled in
                "teacher_train": {"epochs": 20, "lr": 0.01},             # keys of the preset's "train" section, and
                                                                         # "outliers" (the job's fediod.teacher_outliers)
                "checkpoint_dir": "/secure/fediod_teachers",             # default: $MEDFLARE_CACHE/fediod_teachers
                "retrain": false}}

A classification teacher may be trained with outlier exposure (``outliers`` > 0, :mod:`.outliers`): it learns to
answer uniformly on shuffled-patch mosaics of its own images, so that under label skew it does not vote confidently
on classes it has never seen.

The trained teacher is saved at the site (never sent) as a ``model`` result file (``medflare evaluate``
scores it) under a name derived from the site, its data file and the teacher settings, so a rerun of
stage 2 loads it instead of training again, and changed data or settings train a new one.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from medflare import ConfigError, DataError, ResultFileError
from medflare.checks import check_number
from medflare.common.results import describe, load_result, ModelResult, save_checkpoint
from medflare.common.training import (capped_batch_size, local_work, make_loader, make_loss, make_optimizer, recompute_batchnorm,
                                      train_epochs)
from medflare.data.util import cache_root
from medflare.fediod.config import FedIODConfig
from medflare.fediod.outliers import OutlierExposure
from medflare.nets import build_from_spec

SECTION = "fediod"
SECTION_KEYS = ("teacher", "teacher_train", "checkpoint_dir", "retrain")
#: how stage 1 trains a teacher, in the checkpoint's name: raised when that changes, so a site trains its teacher again
#: instead of loading one trained the old way (2: BatchNorm statistics recomputed over the training set after training)
TEACHER_RECIPE = 2
#: the keys of the preset's ``train`` section a teacher's training reads
TRAIN_KEYS = ("epochs", "batch_size", "lr", "optimizer", "loss", "max_steps", "min_steps", "max_batch_fraction")
#: what a site's ``fediod.teacher_train`` may set: those keys and the weight of outlier exposure
TEACHER_TRAIN_KEYS = (*TRAIN_KEYS, "outliers")


def data_args(name: str, in_channels: int, num_classes: int, image_size: int) -> dict[str, int]:
    """The arguments of network ``name`` that the data fix: input channels, classes (``out_channels`` of a
    UNet, ``num_classes`` of a classifier) and, for the ConvNet, the image side."""
    args = {"in_channels": in_channels, ("out_channels" if name == "unet" else "num_classes"): num_classes}
    if name == "convnet":
        args["image_size"] = image_size
    return args


def teacher_settings(site_config: Mapping[str, Mapping[str, Any]], preset_cfg: Mapping[str, Any], site: str,
                     num_classes: int, in_channels: int, image_size: int) -> tuple[dict[str, Any], dict[str, Any], Path, bool]:
    """(model spec, training settings, checkpoint folder, retrain) of ``site``'s teacher; ConfigError names a bad key."""
    own = dict(site_config.get(SECTION, {}))
    unknown = sorted(set(own) - set(SECTION_KEYS))
    if unknown:
        raise ConfigError(f"site '{site}': unknown key(s) {unknown} in section '{SECTION}' of medflare_site.json (known: {list(SECTION_KEYS)})")
    spec = own.get("teacher") or preset_cfg["model"]
    if not isinstance(spec, Mapping) or "name" not in spec:
        raise ConfigError(f"site '{site}': medflare_site.json '{SECTION}.teacher' must be {{'name': ..., 'args': {{...}}}}, got {spec!r}")
    args = dict(spec.get("args") or {})
    # the data decide these, whatever the site wrote (a mismatch would only fail later, deep in torch)
    args.update(data_args(spec["name"], in_channels, num_classes, image_size))
    train = {k: v for k, v in preset_cfg["train"].items() if k in TRAIN_KEYS}
    outliers = FedIODConfig.from_preset(preset_cfg).teacher_outliers
    if outliers:
        train["outliers"] = outliers
    extra = dict(own.get("teacher_train") or {})
    bad = sorted(set(extra) - set(TEACHER_TRAIN_KEYS))
    if bad:
        raise ConfigError(f"site '{site}': unknown key(s) {bad} in '{SECTION}.teacher_train' (known: {list(TEACHER_TRAIN_KEYS)})")
    train.update(extra)
    if not check_number(f"site '{site}': the teacher's outlier weight", f"{SECTION}.teacher_train.outliers", train.get("outliers", 0), 0.0):
        train.pop("outliers", None)  # 0 = off, the checkpoint name of a teacher trained without it
    folder = Path(own["checkpoint_dir"]).expanduser() if own.get("checkpoint_dir") else cache_root() / "fediod_teachers"
    return {"name": spec["name"], "args": args}, train, folder, bool(own.get("retrain", False))


def checkpoint_file(folder: Path, site: str, source: Path, spec: Mapping[str, Any], train: Mapping[str, Any], seed: int) -> Path:
    """``folder/<site>_<hash>.pt``: the hash covers the data file (path, size, mtime), the teacher spec, its training, the
    seed and :data:`TEACHER_RECIPE`."""
    try:
        stat = os.stat(source)
        data_id = [str(Path(source).resolve()), stat.st_size, stat.st_mtime_ns]
    except OSError:
        data_id = [str(source)]
    key = json.dumps({"data": data_id, "spec": spec, "train": train, "seed": seed, "recipe": TEACHER_RECIPE}, sort_keys=True, default=str)
    return Path(folder) / f"{site}_{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"


def train_teacher(spec: Mapping[str, Any], train: Mapping[str, Any], dataset, task: str, device, seed: int = 0,
                  should_stop: Callable[[], bool] | None = None) -> tuple[torch.nn.Module, float]:
    """Train a fresh ``spec`` network on ``dataset`` for ``train["epochs"]`` epochs (and at least ``train.min_steps`` steps, at a
    batch capped by ``train.max_batch_fraction``), with outlier exposure of weight ``train["outliers"]`` when set
    (classification only), then sets its BatchNorm statistics to the training set's (:func:`recompute_batchnorm`);
    returns (model in eval mode, mean loss of the last epoch's worth of steps, the outlier term included)."""
    outliers = float(train.get("outliers", 0))
    if outliers and task != "classification":
        raise ConfigError(f"fediod.teacher_outliers ({outliers}) is for classification teachers; a {task} teacher "
                          "learns every pixel's class and has no images to call outliers (set it to 0)")
    torch.manual_seed(seed)
    model = build_from_spec(spec).to(device)
    opt = make_optimizer(train["optimizer"], model.parameters(), train["lr"])
    loss_fn = make_loss(train["loss"], task)
    batch = capped_batch_size(int(train["batch_size"]), len(dataset), train.get("max_batch_fraction", 1.0))
    loader = make_loader(dataset, batch, True, seed=seed)
    trained = model
    if outliers:
        trained = OutlierExposure(model, loss_fn, outliers, seed=seed)
        loss_fn = trained.loss
    # the teacher's whole training is its one round of local work: train.epochs epochs and at least train.min_steps steps
    stats = train_epochs(trained, loader, loss_fn, opt, **local_work(train), device=device, should_stop=should_stop)
    if should_stop is None or not should_stop():
        recompute_batchnorm(model, dataset, batch, device)  # the teacher is used in eval mode from here on
    last = stats.losses[-len(loader):]
    return model.eval(), float(sum(last) / len(last)) if last else float("nan")


def save_teacher(path: Path, model: torch.nn.Module, spec: Mapping[str, Any], preset: str, overrides: Mapping[str, Any] | None,
                 site: str, train: Mapping[str, Any]) -> None:
    """Write the teacher as a ``model`` result file (atomic), so ``medflare evaluate --model`` scores it."""
    desc = describe(preset, overrides, kind="model", model=dict(spec), fediod_teacher={"site": site, "train": dict(train)})
    save_checkpoint({"model": {k: v.detach().cpu() for k, v in model.state_dict().items()}, "train_conf": {"medflare": desc}}, path)


def load_teacher(path: Path, spec: Mapping[str, Any], num_classes: int) -> torch.nn.Module:
    """The teacher saved at ``path``; ResultFileError naming the file when it is unreadable, another
    architecture or has the wrong number of outputs."""
    try:
        result = load_result(path)
    except (ResultFileError, DataError, ConfigError) as e:
        raise ResultFileError(f"teacher checkpoint '{path}' does not load: {e}") from e
    if not isinstance(result, ModelResult):
        raise ResultFileError(f"teacher checkpoint '{path}' holds kind '{result.kind}', not a single model")
    if result.description.get("model") != dict(spec):
        raise ResultFileError(f"teacher checkpoint '{path}' holds {result.description.get('model')}, but the site's teacher is {dict(spec)}")
    model = result.model
    outputs = _num_outputs(model)
    if outputs is not None and outputs != num_classes:
        raise ResultFileError(f"teacher checkpoint '{path}' predicts {outputs} classes, the site's data has {num_classes}")
    return model


#: a classification teacher that closes less than this share of the gap between always answering its site's most
#: frequent training class and answering every training image right is reported as not having learnt (:func:`unlearnt_warning`)
MIN_GAIN_OVER_MAJORITY = 0.25


def unlearnt_warning(site: str, accuracy: float, train_counts: torch.Tensor) -> str | None:
    """The warning line when a classification teacher's eval-mode ``accuracy`` on its own training images is barely
    better than always answering their most frequent class ``m`` (``train_counts``: the training labels per class):
    when ``(accuracy - m) / (1 - m)`` is under :data:`MIN_GAIN_OVER_MAJORITY`; None otherwise. Judged on the training
    images, not the validation split, because a small site's validation split can hold classes its training split
    lacks, which no teacher can know. Such a teacher teaches the student about one class for every image of its
    classes: the teacher :func:`recompute_batchnorm` mended scored 0.36 on its training images, whose most frequent
    class is 0.34 of them, and the student then scored 25 % on that site."""
    total = float(train_counts.sum())
    majority = float(train_counts.max()) / total if total > 0 else 1.0
    if majority >= 1.0 or (accuracy - majority) / (1.0 - majority) >= MIN_GAIN_OVER_MAJORITY:
        return None
    return (f"site '{site}': its teacher scores accuracy {accuracy:.4f} on its own training images, barely above always "
            f"answering their most frequent class ({majority:.4f}): it has hardly learnt the site's data, and the student "
            f"learns from it; check its training (the fediod.teacher_train keys of local/medflare_site.json) and set "
            f"fediod.retrain")


def _num_outputs(model: torch.nn.Module) -> int | None:
    head = getattr(model, "classifier", None)
    return int(head.out_features) if isinstance(head, torch.nn.Linear) else None
