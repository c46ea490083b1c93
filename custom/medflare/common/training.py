"""The local training loop every algorithm shares: losses, optimisers and epochs over a site's data.

Plain torch, no FLARE: algorithms add their own terms through ``extra_loss`` (FedProx's proximal term)
and ``after_step`` (SCAFFOLD's control-variate correction) instead of copying the loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
from monai.losses import DiceCELoss, DiceLoss, FocalLoss
from torch.utils.data import DataLoader

from medflare import ConfigError, MedflareError
from medflare.data.loaders import make_loader  # noqa: F401 - the data layer's; the executors, benchmarks and tests import it here
from medflare.presets import AMP_MODES, DEFAULTS, LOSSES, OPTIMIZER_STATES, OPTIMIZERS  # the train section's choices, declared once

#: mixed-precision modes of :func:`train_epochs` (preset key ``train.amp``, :data:`medflare.presets.AMP_MODES`) -> autocast dtype
AMP_DTYPES = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}
assert tuple(AMP_DTYPES) == AMP_MODES


def make_loss(name: str, task: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Loss by name. Segmentation: logits (B,C,H,W) vs labels (B,1,H,W); classification: logits (B,C) vs (B,).

    "dice" is MONAI's soft Dice over softmax classes (background included, as in the FedSM reference),
    "dicece" adds cross-entropy, "dicefocal" adds MONAI's softmax focal loss (gamma 2; FedST's segmentation loss), "ce" is
    cross-entropy alone.
    """
    if name not in LOSSES:
        raise ConfigError(f"unknown loss '{name}' in train.loss (known: {list(LOSSES)})")
    if task == "classification":
        if name != "ce":
            raise ConfigError(f"train.loss '{name}' is a segmentation loss; classification uses 'ce'")
        return torch.nn.CrossEntropyLoss()
    if name == "dice":
        return DiceLoss(to_onehot_y=True, softmax=True)
    if name == "dicece":
        return DiceCELoss(to_onehot_y=True, softmax=True)
    if name == "dicefocal":
        # MONAI's DiceFocalLoss applies a sigmoid focal term; mutually exclusive classes want the softmax one.
        dice, focal = DiceLoss(to_onehot_y=True, softmax=True), FocalLoss(to_onehot_y=True, use_softmax=True)
        return lambda logits, label: dice(logits, label) + focal(logits, label)
    ce = torch.nn.CrossEntropyLoss()
    return lambda logits, label: ce(logits, label[:, 0].long())


def make_optimizer(name: str, params: Iterable[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """Adam (the segmentation default) or SGD with momentum 0.9 (the classification default)."""
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=5e-4)
    raise ConfigError(f"unknown optimizer '{name}' in train.optimizer (known: {list(OPTIMIZERS)})")


def round_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module, train: Mapping[str, Any]) -> torch.optim.Optimizer:
    """The optimiser a round's local training of ``model`` uses (preset key ``train.optimizer_state``): ``optimizer``
    itself with the state of the site's earlier rounds ("kept", the default), or a fresh one ("fresh").

    Why a choice: a round starts from the received model, not from where the site's last round ended, so kept Adam
    moments describe another point. On the report's segmentation sites, with kept moments, FedAvg's global model swings
    between the two contrast polarities every other round and stays on the early plateau at some seeds (class 2 at 0
    Dice); a fresh optimiser left it at every such seed measured and cost 2.4-3.8 points where kept moments converge
    (benchmarks/RESULTS_report.md, "FedAvg's early plateau"), so "kept" stays the baselines' default. It is the kept
    second moment that holds the plateau: zeroing only the first moment each round left it there. FedSM's preset sets
    "fresh" (0.69 Dice better over nineteen seeds, benchmarks/RESULTS_fedsm.md).
    """
    state = train.get("optimizer_state", DEFAULTS["train"]["optimizer_state"])
    if state not in OPTIMIZER_STATES:
        raise ConfigError(f"unknown train.optimizer_state '{state}' (known: {list(OPTIMIZER_STATES)})")
    if state == "kept":
        return optimizer
    return make_optimizer(train["optimizer"], model.parameters(), train["lr"])


def one_line(exc: BaseException) -> str:
    """``exc``'s message as one line; for an error a DataLoader worker raised (torch re-raises it with the
    message ``Caught DataError in DataLoader worker process 0. Original Traceback ...``), the original message,
    so a site's log names the bad file in one line whatever ``train.num_workers`` is."""
    text = str(exc)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if text.startswith("Caught ") and "Original Traceback" in text and lines:
        name = f"{type(exc).__module__}.{type(exc).__qualname__}: "
        last = lines[-1]
        return last[len(name):] if last.startswith(name) else last
    return " ".join(lines) if lines else type(exc).__name__


@dataclass
class TrainStats:
    """What one call of :func:`train_epochs` did: optimiser steps, samples seen and the per-step losses."""

    steps: int = 0
    samples: int = 0
    losses: list[float] = field(default_factory=list)

    @property
    def mean_loss(self) -> float:
        return float(sum(self.losses) / len(self.losses)) if self.losses else math.nan


def train_epochs(
    model: torch.nn.Module,
    loader: DataLoader,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    *,
    epochs: int,
    device: torch.device | str = "cpu",
    max_steps: int = 0,
    min_steps: int = 0,
    extra_loss: Callable[[torch.nn.Module], torch.Tensor] | None = None,
    after_step: Callable[[torch.nn.Module], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    amp: str = "off",
) -> TrainStats:
    """Train ``model`` for ``epochs`` passes over ``loader`` and at least ``min_steps`` optimiser steps (the loader
    cycles until both hold, then stops: ``max(epochs * len(loader), min_steps)`` steps; preset key
    ``train.min_steps``), at most ``max_steps`` steps if > 0.

    ``extra_loss(model)`` is added to the data loss (e.g. FedProx); ``after_step(model)`` runs after each
    optimiser step (e.g. SCAFFOLD); ``should_stop()`` lets FLARE's abort signal end the loop early.
    ``amp`` ("off" | "bf16" | "fp16", preset key ``train.amp``) runs the forward pass and the loss under
    ``torch.autocast`` in that precision (weights and optimiser state stay float32; fp16 scales the loss
    with a GradScaler against underflow). A non-finite loss raises MedflareError instead of silently
    producing a NaN model.
    """
    if amp not in AMP_DTYPES:
        raise ConfigError(f"unknown train.amp '{amp}' (known: {list(AMP_DTYPES)})")
    device_type = torch.device(device).type
    dtype = AMP_DTYPES[amp]
    scaler = torch.amp.GradScaler(device_type, enabled=amp == "fp16")
    stats = TrainStats()
    model.train()
    done = 0
    while done < epochs or stats.steps < min_steps:
        before = stats.steps
        for batch in loader:
            if should_stop is not None and should_stop():
                return stats
            image, label = batch["image"].to(device), batch["label"].to(device)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device_type, dtype=dtype, enabled=dtype is not None):
                loss = loss_fn(model(image), label)
            if extra_loss is not None:
                loss = loss + extra_loss(model)
            if not torch.isfinite(loss):
                raise MedflareError(f"training loss became {loss.item()} at step {stats.steps}; lower train.lr")
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if after_step is not None:
                after_step(model)
            stats.steps += 1
            stats.samples += int(image.shape[0])
            stats.losses.append(float(loss.detach()))
            if (max_steps and stats.steps >= max_steps) or (done >= epochs and stats.steps >= min_steps):
                return stats  # the floor's extra pass stops as soon as the floor is met
        done += 1
        if stats.steps == before:  # an empty loader: no epoch can add a step
            return stats
    return stats


def recompute_batchnorm(model: torch.nn.Module, dataset, batch_size: int, device: torch.device | str = "cpu") -> bool:
    """Set every BatchNorm layer's running statistics to their averages over ``dataset`` ("precise BN": one forward
    pass in train mode without gradients, torch's ``update_bn``); returns whether ``model`` has such layers (False:
    nothing was done, nothing was run).

    Why: a network trained to completion and then used in eval mode keeps the exponential averages of its last few
    dozen batches, taken while its weights still moved, the last of them an epoch's remainder batch. For a FedIOD
    teacher that can undo the training: ``fediod_cls`` at Dir(0.1), site-3 (classes 1 / 4 / 7), seed 3, ends with
    a train-mode loss of 0.05 and 0.36 accuracy on its own training images in eval mode, 0.98 after this pass.
    """
    if not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        return False
    images = (batch["image"] for batch in make_loader(dataset, batch_size, False))
    torch.optim.swa_utils.update_bn(images, model, device=torch.device(device))
    return True


def local_work(train: Mapping[str, Any]) -> dict[str, int]:
    """A round's local work from a preset's ``train`` section, as :func:`train_epochs` keywords: ``epochs`` epochs and
    at least ``min_steps`` steps, at most ``max_steps`` (0 = no cap). Every algorithm's local supervised training
    passes it, so a small site's round does not shrink to one or two steps."""
    return {"epochs": int(train["epochs"]), "min_steps": int(train.get("min_steps", 0) or 0),
            "max_steps": int(train.get("max_steps", 0) or 0)}


def capped_batch_size(batch_size: int, num_train: int, fraction: float) -> int:
    """``batch_size`` capped at ``fraction`` of a site's ``num_train`` training cases (at least 1): preset key
    ``train.max_batch_fraction``, so a 50-case site takes several steps an epoch instead of one."""
    return max(1, min(int(batch_size), int(fraction * num_train)))


def short_round(site: str, steps: int, train: Mapping[str, Any]) -> str | None:
    """The one warning line for a round of fewer than ``train.warn_steps`` optimiser steps (None when it has enough)."""
    floor = int(train.get("warn_steps", 0) or 0)
    if steps >= floor:
        return None
    return (f"site '{site}': this round took {steps} optimisation steps, fewer than train.warn_steps {floor}; raise "
            f"train.min_steps (now {train.get('min_steps', 0)}) or train.max_steps (now {train.get('max_steps', 0)}, 0 = no "
            f"cap) so the round trains, unless an abort cut it short")


def batch_size_for(train: Mapping[str, Any], device: torch.device | str) -> int:
    """The preset's training batch size on ``device``: ``train.gpu_batch_size`` on a GPU when > 0, else ``train.batch_size``."""
    if torch.device(device).type == "cuda" and train.get("gpu_batch_size"):
        return int(train["gpu_batch_size"])
    return int(train["batch_size"])


def pick_device(device: str = "auto") -> torch.device:
    """"auto" -> the first CUDA GPU when present, else CPU; a GPU is used when there, never required."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
