"""One evaluation entry point for every job: run a model (or any predictor) over a loader, score each case."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from medflare import MedflareError
from medflare.metrics.classification import to_class_labels
from medflare.metrics.instance import aggregated_jaccard_index, object_dice, to_instances
from medflare.metrics.segmentation import (
    check_label_maps,
    mean_pixel_accuracy,
    nanmean_with_count,
    per_class_scores,
    surface_tolerance,
    variation_of_information,
)
from medflare.metrics.site_mean import label_classes, site_mean

__all__ = ["COSTLY_METRICS", "SEGMENTATION_METRICS", "CLASSIFICATION_METRICS", "TASKS", "evaluate", "logits_to_label_map",
           "metrics_for_round"]

#: Per-foreground-class metrics; "<name>" is the mean over classes, "<name>_c<k>" is class k >= 1.
_PER_CLASS: tuple[str, ...] = ("dice", "hd95", "sensitivity", "specificity")
SEGMENTATION_METRICS: tuple[str, ...] = (*_PER_CLASS, "mpa", "vi", "aji", "object_dice")
CLASSIFICATION_METRICS: tuple[str, ...] = ("accuracy",)
TASKS = {"segmentation": "segmentation", "seg": "segmentation", "classification": "classification", "cls": "classification"}
_CLASS_RE = re.compile(rf"^({'|'.join(_PER_CLASS)}|surface_dice_[0-9.]+mm)_c(\d+)$")
#: metrics that cost far more than a forward pass (distance transforms, connected components, per-case
#: CPU work): computed at a cadence during training (:func:`metrics_for_round`), always in a final evaluation;
#: the surface Dice metrics ("surface_dice_<t>mm") count as costly too
COSTLY_METRICS: tuple[str, ...] = ("hd95", "vi", "aji", "object_dice")


def _costly(name: str) -> bool:
    m = _CLASS_RE.match(name)
    base = m.group(1) if m else name
    return base in COSTLY_METRICS or surface_tolerance(base) is not None


def metrics_for_round(metrics: Sequence[str], round_num: int, total_rounds: int | None, costly_every: int) -> list[str]:
    """The metrics to compute in training round ``round_num`` (0-based) of ``total_rounds``.

    Cheap metrics every round; costly ones (:data:`COSTLY_METRICS` and surface Dice, also per class, e.g. "hd95_c1") in
    rounds that are a multiple of ``costly_every`` (round 0 included) and in the last round; with
    ``costly_every`` 0, in the last round only. Unknown ``total_rounds`` counts no round as the last.
    """
    if not isinstance(costly_every, int) or isinstance(costly_every, bool) or costly_every < 0:
        raise MedflareError(f"'eval.costly_every' must be an int >= 0, got {costly_every!r}")
    last = total_rounds is not None and round_num >= total_rounds - 1
    due = last or (costly_every > 0 and round_num % costly_every == 0)
    return [name for name in metrics if due or not _costly(name)]


def _known(task: str) -> str:
    base = SEGMENTATION_METRICS if task == "segmentation" else CLASSIFICATION_METRICS
    extra = ", surface_dice_<t>mm" + "".join(f", {name}_c1" for name in _PER_CLASS) + ", ..." if task == "segmentation" else ""
    return ", ".join(base) + extra


def _check_metrics(metrics: Sequence[str], task: str, num_classes: int) -> None:
    if isinstance(metrics, str):
        raise MedflareError(f"'metrics' must be a list of names, got the string {metrics!r}")
    for name in metrics:
        if task == "classification":
            ok = name in CLASSIFICATION_METRICS
        else:
            m = _CLASS_RE.match(name)
            if m and not 1 <= int(m.group(2)) < num_classes:
                raise MedflareError(
                    f"metric '{name}': class {m.group(2)} is not a foreground class of num_classes={num_classes} "
                    f"(foreground classes are 1..{num_classes - 1})"
                )
            ok = name in SEGMENTATION_METRICS or m is not None or surface_tolerance(name) is not None
        if not ok:
            raise MedflareError(f"unknown metric '{name}' for task '{task}' (known: {_known(task)})")


def logits_to_label_map(output: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Network output -> label map (B, 1, *spatial) int64.

    (B, num_classes, *spatial) logits -> argmax over channels (softmax classes, 0 = background);
    (B, 1, *spatial) is taken as a label map already (e.g. from a FedSM super model).
    """
    if not isinstance(output, torch.Tensor) or output.ndim < 3:
        raise MedflareError(f"segmentation output must be a (B, C, H, W[, D]) tensor, got {type(output).__name__}")
    if output.shape[1] == 1:
        return output.round().long()
    if output.shape[1] != num_classes:
        raise MedflareError(
            f"segmentation output has {output.shape[1]} channels but num_classes={num_classes} "
            "(expected logits with one channel per class, or a 1-channel label map)"
        )
    return output.argmax(dim=1, keepdim=True)


def _case_names(batch: Mapping[str, Any], size: int, start: int) -> list[str]:
    names = batch.get("name") if isinstance(batch, Mapping) else None
    if names is None:
        return [f"case_{start + i:04d}" for i in range(size)]
    if isinstance(names, str):
        names = [names]
    return [str(n) for n in names]


def _segmentation_scores(pred: torch.Tensor, target: torch.Tensor, num_classes: int, metrics: Sequence[str],
                         spacing=None) -> tuple[list[dict[str, float]], dict[str, torch.Tensor], torch.Tensor]:
    """Scores of one batch of checked label maps (B,1,...): B dicts of the metrics that are not per class,
    ``{base: (B, num_classes-1)}`` per-class values (on the CPU) and :func:`label_classes` of the batch.

    The per-class metrics are reduced to per-case and site means only once the whole site is scored
    (:func:`medflare.metrics.site_mean.site_mean`: whether a class counts depends on every case). The per-class
    metrics and MPA are computed for the whole batch where the label maps are (the model's device) and copied to
    the CPU once per batch; VI and the instance metrics are per-case CPU work.
    """
    batch = pred.shape[0]
    rows: list[dict[str, float]] = [{} for _ in range(batch)]
    device = pred.device
    bases = _class_bases(metrics)
    per_class = per_class_scores(pred, target, num_classes, bases, device=device, spacing=spacing) if bases else {}
    per_class = {name: values.cpu() for name, values in per_class.items()}
    mpa = mean_pixel_accuracy(pred, target, num_classes, device=device).tolist() if "mpa" in metrics else None
    on_cpu = [m for m in metrics if m in ("vi", "aji", "object_dice")]
    pred_cpu, target_cpu = (pred.cpu(), target.cpu()) if on_cpu else (None, None)
    vi = variation_of_information(pred_cpu, target_cpu).tolist() if "vi" in metrics else None
    instance_metrics = {"aji": aggregated_jaccard_index, "object_dice": object_dice}
    for b in range(batch):
        instances = None  # connected components of the union foreground, computed once per case
        for name in metrics:
            if name == "mpa":
                rows[b][name] = float(mpa[b])
            elif name == "vi":
                rows[b][name] = float(vi[b])
            elif name in instance_metrics:  # instance metrics on connected components of the union foreground
                if instances is None:
                    instances = to_instances(pred_cpu[b, 0].numpy()), to_instances(target_cpu[b, 0].numpy())
                rows[b][name] = instance_metrics[name](*instances)
    return rows, per_class, label_classes(target, num_classes)


def _class_bases(metrics: Sequence[str]) -> list[str]:
    """The per-class metrics (dice, hd95, ...) behind ``metrics``, whether asked as a class mean or for one class."""
    bases = {m.group(1) if (m := _CLASS_RE.match(name)) else name for name in metrics}
    return sorted(b for b in bases if b in _PER_CLASS or surface_tolerance(b) is not None)


def _reduce_classes(metrics: Sequence[str], per_case: list[dict[str, Any]], values: Mapping[str, list[torch.Tensor]],
                    present: list[torch.Tensor]) -> dict[str, dict[int, float]]:
    """Fill each case's per-class metrics by the site rule (:func:`site_mean`); returns ``{base: {class: site mean}}``."""
    if not present:
        return {}
    where = torch.cat(present)
    out = {}
    for base, parts in values.items():
        table = torch.cat(parts)
        reduced = site_mean(table, where)
        out[base] = reduced.per_class
        for name in metrics:
            m = _CLASS_RE.match(name)
            if name == base:
                column = reduced.per_case
            elif m and m.group(1) == base:
                k = int(m.group(2))
                column = table[:, k - 1] if k not in reduced.absent else torch.full((len(per_case),), float("nan"))
            else:
                continue
            for row, value in zip(per_case, column.tolist()):
                row[name] = float(value)
    return out


def evaluate(
    model: torch.nn.Module | None,
    loader: Iterable[Mapping[str, Any]],
    *,
    task: str,
    num_classes: int,
    metrics: Sequence[str] = ("dice",),
    device: str | torch.device = "cpu",
    predict: Callable[[torch.Tensor], torch.Tensor] | None = None,
    spacing: Sequence[float] | None = None,
    keep_class_values: bool = False,
) -> dict[str, Any]:
    """Score ``model`` (or ``predict``) on every case of ``loader``; the one evaluation used by all jobs.

    The loader yields dicts ``{"image": (B,C,H,W) float, "label": (B,1,H,W) int (segmentation) or (B,)
    int (classification), "name": list[str] (optional)}``. Segmentation prediction is the argmax of
    the model's (B, num_classes, H, W) logits; ``predict`` (images -> logits or a (B,1,H,W) label
    map) replaces ``model(images)``, e.g. for a FedSM super model. Images are moved to ``device``;
    the model must already live there. Each batch is scored as a whole where the prediction is (so
    on the GPU when the model runs there; see :mod:`medflare.metrics.segmentation`), and the scores are
    the same as one case at a time. The model is put in eval mode under ``torch.no_grad()`` and its
    training mode restored afterwards.

    Metric names: segmentation "dice", "hd95", "surface_dice_<t>mm" (normalised surface Dice at tolerance
    t), "sensitivity", "specificity" (mean over foreground classes) and their per-class "<name>_c<k>",
    "mpa", "vi", "aji", "object_dice" (instances = connected components of the union foreground);
    classification "accuracy".

    Distances are in mm when the voxel size is known: ``spacing`` (one size per spatial axis, for every
    case) or else the batch's ``"spacing"`` entry ((B, dims), as volume datasets give it); in pixels otherwise.
    Unknown names, tasks or shapes raise MedflareError.

    Class means follow :mod:`medflare.metrics.site_mean`: a foreground class in no label of any case of
    ``loader`` is left out of "<name>" (every case), whatever the predictions, and its "<name>_c<k>" is nan; a
    class some label holds keeps the per-case empty-mask conventions. So score a whole site in one call: the rule needs every case.
    A label value outside [0, num_classes) raises DataError naming the case.

    Returns:
        ``{"mean": {name: float}, "per_case": [{"name": case, name: float, ...}, ...],
        "nan_count": {name: int}, "num_cases": int}``; means are nan-means over cases, and
        ``nan_count`` says how many cases were nan (e.g. HD95 with an empty mask). Segmentation adds
        ``"per_class": {base: {k: site mean of class k, nan when absent}}`` for every per-class metric asked
        (e.g. "dice" or "dice_c1" -> base "dice") and ``"unseen_classes"`` (in no label, so left out of the class
        means: the preset may have more classes than the data); with ``keep_class_values`` also ``"class_values":
        {base: (N, num_classes-1) tensor}`` and ``"present"`` ((N, num_classes-1) bool: the case's label holds the
        class) for callers that reduce mixtures of models themselves (FedSM).
    """
    if task not in TASKS:
        raise MedflareError(f"unknown task '{task}' (known: {sorted(TASKS)})")
    task = TASKS[task]
    if not isinstance(num_classes, int) or num_classes < 2:
        raise MedflareError(f"'num_classes' must be an int >= 2, got {num_classes!r}")
    metrics = list(metrics)
    _check_metrics(metrics, task, num_classes)
    if model is None and predict is None:
        raise MedflareError("evaluate needs a 'model' or a 'predict' callable")
    forward = predict if predict is not None else model
    was_training = model.training if model is not None else None
    per_case: list[dict[str, Any]] = []
    class_values: dict[str, list[torch.Tensor]] = {}  # segmentation: {base metric: [(B, num_classes-1) per batch]}
    present: list[torch.Tensor] = []  # per batch (B, num_classes-1): class in the case's label
    try:
        if model is not None:
            model.eval()
        with torch.no_grad():
            for batch in loader:
                if not isinstance(batch, Mapping) or "image" not in batch or "label" not in batch:
                    raise MedflareError("evaluate: each loader batch must be a dict with 'image' and 'label'")
                images = torch.as_tensor(batch["image"]).to(device)
                label = torch.as_tensor(batch["label"])
                output = forward(images)
                if task == "segmentation":
                    if label.ndim == images.ndim - 1:
                        label = label.unsqueeze(1)
                    names = _case_names(batch, label.shape[0], len(per_case))
                    pred = logits_to_label_map(output, num_classes)
                    pred, label = check_label_maps(pred, label, num_classes, device=pred.device, case_names=names)
                    case_spacing = spacing if spacing is not None else batch.get("spacing")
                    rows, batch_values, batch_present = _segmentation_scores(pred, label, num_classes, metrics, case_spacing)
                    for base, v in batch_values.items():
                        class_values.setdefault(base, []).append(v)
                    present.append(batch_present)
                else:
                    pred = to_class_labels(output).cpu()
                    label = label.reshape(-1).long().cpu()
                    if pred.shape != label.shape:
                        raise MedflareError(f"evaluate: 'label' has {label.numel()} entries but the batch has {pred.numel()} predictions")
                    rows = [{"accuracy": float(p == t), "label": t, "pred": p} for p, t in zip(pred.tolist(), label.tolist())]
                    names = _case_names(batch, len(rows), len(per_case))
                for name, row in zip(names, rows):
                    per_case.append({"name": name, **row})
    finally:
        if model is not None and was_training:
            model.train()
    per_class = _reduce_classes(metrics, per_case, class_values, present)
    if task == "segmentation":  # each case's metrics in the order asked
        per_case = [{"name": row["name"], **{name: row[name] for name in metrics}} for row in per_case]
    mean: dict[str, float] = {}
    nan_count: dict[str, int] = {}
    for name in metrics:
        mean[name], nan_count[name] = nanmean_with_count([row[name] for row in per_case])
    out = {"mean": mean, "per_case": per_case, "nan_count": nan_count, "num_cases": len(per_case)}
    if task == "segmentation":
        where = torch.cat(present) if present else torch.zeros(0, num_classes - 1, dtype=torch.bool)
        out["per_class"] = per_class
        out["unseen_classes"] = [k + 1 for k in range(num_classes - 1) if not bool(where[:, k].any())]
        if keep_class_values:
            out["class_values"] = {base: torch.cat(parts) for base, parts in class_values.items()}
            out["present"] = where
    return out
