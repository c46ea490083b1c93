"""The segmentation student's decision offset, chosen on the sites' validation splits (not in the paper), no FLARE.

Why: the student learns from generated images only. On real images it is less sure of the foreground than on G's
images, so it under-segments: at ``fediod_seg``'s 30 rounds through FLARE its validation sensitivity is 0.62-0.72
against a specificity of 0.99 (the sites' teachers: 0.81 / 0.99), and lowering its background logit by 1-1.5 raises
its client-average test Dice by 1.0-2.7 points on every seed. FedAvg's global model, trained on real images, has no
such bias (its best offset is 0 or within half a logit of it; jobs/fediod_seg/README.md, "The decision offset").

How: at each validation every site scores the student with its background logit (class 0) lowered by each offset of
``fediod.calibrate_offsets`` on its validation split (the key metric only; a few numbers in the metrics reply it
already sends); the server takes the offset with the best mean over the sites (:func:`best_offset`), saves the
student with that offset folded into the bias of its output layer (:func:`fold_offset`; the saved file is an
ordinary network whose argmax is the calibrated decision) and has the sites validate that student in full. It is
a threshold fitted on validation data, as temperature scaling is for probabilities; the student that goes on
training is not changed.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
import torch

from medflare import ConfigError
from medflare.metrics import evaluate


def lower_background(logits: torch.Tensor, offset: float) -> torch.Tensor:
    """``logits`` ``(B, C, *s)`` with class 0's logit lowered by ``offset`` (a new tensor; > 0 labels more foreground)."""
    if not offset:
        return logits
    shift = torch.zeros(logits.shape[1], dtype=logits.dtype, device=logits.device)
    shift[0] = offset
    return logits - shift.view(1, -1, *([1] * (logits.ndim - 2)))


def split_logits(predict: Callable[[torch.Tensor], torch.Tensor], loader: Iterable[Mapping], device="cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(logits on the CPU, labels)`` of every batch of ``loader`` (one forward pass, no gradients): what
    :func:`scores_at_offsets` scores."""
    with torch.no_grad():
        return [(predict(torch.as_tensor(b["image"]).to(device)).cpu(), b["label"]) for b in loader]


def scores_at_offsets(batches: Sequence[tuple[torch.Tensor, torch.Tensor]], offsets: Sequence[float], key: str,
                      num_classes: int) -> dict[float, float]:
    """``{offset: key metric}`` of logits at each offset, from one forward pass: ``batches`` are ``(logits, labels)`` of a
    whole split (the class means need every case, :mod:`medflare.metrics.site_mean`), scored as ``medflare evaluate``
    scores a model's output."""
    return {float(d): evaluate(None, [{"image": lower_background(z, d), "label": y} for z, y in batches], task="segmentation",
                               num_classes=num_classes, metrics=[key], predict=lambda v: v)["mean"][key]
            for d in offsets}


def offset_metric(key: str, offset: float) -> str:
    """The name a site gives the key metric of the student at ``offset`` in its calibration reply."""
    return f"val_{key}_offset_{float(offset):g}"


def offset_means(per_site: Sequence[Mapping[str, float]], key: str, offsets: Sequence[float]) -> dict[float, float]:
    """``{offset: mean over the sites that scored it}`` from the sites' calibration replies (offsets no site scored, or
    scored NaN everywhere, are left out). Each value is clipped to [0, 1], the range of a score the job maximises (as
    its best-model selection does): a site that lies moves a mean by at most 1/K, and the offset stays one of the
    preset's, so the worst it can do is a poorer threshold, never a broken student."""
    means = {}
    for d in offsets:
        values = [float(m[offset_metric(key, d)]) for m in per_site if offset_metric(key, d) in m]
        values = [min(max(v, 0.0), 1.0) for v in values if np.isfinite(v)]
        if values:
            means[float(d)] = float(np.mean(values))
    return means


def best_offset(means: Mapping[float, float]) -> float:
    """The offset of the best mean; among equal means the one nearest 0 (the uncalibrated student), so a flat or
    empty validation changes nothing."""
    if not means:
        return 0.0
    return float(max(means, key=lambda d: (means[d], -abs(d), -d)))


def output_bias(model: torch.nn.Module, example: torch.Tensor) -> str:
    """The name of ``model``'s parameter that adds one constant per class to its output: the last bias of shape
    ``(classes,)``, checked on ``example`` (a batch of inputs): raising it by 1 at class 0 must raise the output's class-0
    logit by 1 everywhere and change nothing else. ConfigError when no bias does (e.g. a norm after the last layer)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(example)
            classes = out.shape[1]
            candidates = [name for name, p in model.named_parameters() if name.endswith("bias") and tuple(p.shape) == (classes,)]
            for name in reversed(candidates):
                bias = dict(model.named_parameters())[name]
                kept = bias.detach().clone()
                bias[0] += 1.0
                try:
                    moved = model(example) - out
                finally:
                    bias.copy_(kept)  # bit for bit: a run with calibration trains the same student as one without
                expected = torch.zeros_like(moved)
                expected[:, 0] = 1.0
                if torch.allclose(moved, expected, atol=1e-4):
                    return name
    finally:
        model.train(was_training)
    raise ConfigError(f"'fediod.calibrate_offsets' needs a student whose output layer adds a bias per class (the "
                      f"{type(model).__name__} student has none that shifts its logits): set it to [] for this student")


def fold_offset(state: Mapping[str, np.ndarray], bias: str, offset: float) -> dict[str, np.ndarray]:
    """A copy of the state dict ``state`` whose output bias (``bias``, from :func:`output_bias`) has class 0 lowered by
    ``offset``: the network it loads into computes :func:`lower_background` of the original's logits."""
    out = dict(state)
    if offset:
        shifted = np.array(state[bias], copy=True)
        shifted[0] -= offset
        out[bias] = shifted
    return out


def check_offsets(offsets: Sequence[float], task: str) -> None:
    """Decision offsets are a segmentation setting (class 0 = background)."""
    if offsets and task != "segmentation":
        raise ConfigError(f"'fediod.calibrate_offsets' lowers the background class of a segmentation student; this preset's "
                          f"task is {task}: set it to []")
