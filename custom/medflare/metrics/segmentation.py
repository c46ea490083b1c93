"""Semantic segmentation metrics on label maps, per case, built on MONAI's metric functions.

Every function takes ``pred`` and ``target`` integer label maps of shape (B, 1, H, W) or
(B, 1, H, W, D) with values in [0, num_classes), 0 = background, and returns per-case values.
Distances (HD95, surface Dice) are in the units of ``spacing``: pixel/voxel sizes in mm, one per
spatial axis, for the whole batch or one row per case (``(B, dims)``); without it, in pixels.

Conventions for empty masks (per case and foreground class; documented here once):
    * Dice: both empty -> 1 (nothing to find, nothing found); exactly one empty -> 0.
    * HD95: pred or target empty -> nan (a distance to nothing is undefined).
    * surface Dice: both empty -> 1, exactly one empty -> 0 (as Dice).
    * sensitivity: target empty -> nan (no positives); specificity: target all foreground -> nan.
    * mean pixel accuracy: classes absent from the target are left out of the mean.
Aggregates over cases use ``nanmean`` and report how many values were nan
(see :func:`nanmean_with_count` and :func:`medflare.metrics.evaluate`).

Where it runs: the functions return CPU tensors. :func:`per_class_scores` and
:func:`mean_pixel_accuracy` take ``device``: :func:`medflare.metrics.evaluate` scores each batch where the
model ran (a GPU when there is one), with MONAI's metric classes on the whole batch (``DiceMetric`` on
the label maps, ``HausdorffDistanceMetric`` and ``ConfusionMatrixMetric`` on their one-hot encoding).
MONAI's HD95 runs its distance transforms on the GPU when cuCIM/CuPy are installed, else on the CPU.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

from medflare import DataError, MedflareError

__all__ = [
    "check_label_maps",
    "dice",
    "hd95",
    "surface_dice",
    "sensitivity",
    "specificity",
    "mean_pixel_accuracy",
    "variation_of_information",
    "nanmean_with_count",
]


def check_label_maps(
    pred: torch.Tensor, target: torch.Tensor, num_classes: int | None = None, device: str | torch.device = "cpu",
    case_names: Sequence[str] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate two (B, 1, *spatial) label maps and return them as int64 tensors on ``device`` (default CPU).

    Raises MedflareError naming ``pred``/``target``/``num_classes`` on a wrong shape or value range; with
    ``case_names`` (one per case), a ``target`` value outside [0, num_classes) is a DataError naming the case (the
    data's or the preset's fault, not the caller's).
    """
    pred, target = torch.as_tensor(pred), torch.as_tensor(target)
    if pred.shape != target.shape:
        raise MedflareError(f"'pred' shape {tuple(pred.shape)} differs from 'target' shape {tuple(target.shape)}")
    if pred.ndim not in (4, 5) or pred.shape[1] != 1:
        raise MedflareError(f"'pred'/'target' must be label maps (B, 1, H, W[, D]), got shape {tuple(pred.shape)}")
    for key, t in (("pred", pred), ("target", target)):
        if t.is_floating_point() and not torch.equal(t, t.round()):
            raise MedflareError(f"'{key}' must hold integer class labels (got non-integer floats)")
    pred, target = pred.detach().to(device).long(), target.detach().to(device).long()
    if num_classes is not None:
        if not isinstance(num_classes, int) or num_classes < 2:
            raise MedflareError(f"'num_classes' must be an int >= 2 (background + foreground), got {num_classes!r}")
        for key, t in (("pred", pred), ("target", target)):
            if t.numel():
                lo, hi = torch.aminmax(t)
                if lo < 0 or hi >= num_classes:
                    if key == "target" and case_names is not None:
                        _name_bad_case(t, num_classes, case_names)
                    raise MedflareError(
                        f"'{key}' has labels in [{int(lo)}, {int(hi)}], outside [0, num_classes={num_classes})"
                    )
    return pred, target


def _name_bad_case(target: torch.Tensor, num_classes: int, case_names: Sequence[str]) -> None:
    """Raise the DataError naming the first case of ``target`` with a label outside [0, num_classes)."""
    flat = target.flatten(1)
    lo, hi = flat.amin(1), flat.amax(1)
    i = int(torch.nonzero((lo < 0) | (hi >= num_classes)).flatten()[0])
    raise DataError(f"case '{case_names[i]}': label values in [{int(lo[i])}, {int(hi[i])}], outside [0, num_classes={num_classes}) "
                    "of the preset (data.num_classes)")


def _one_hot(pred: torch.Tensor, target: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One-hot (B, num_classes, *spatial) of two checked label maps, on their device."""
    from monai.networks.utils import one_hot

    return one_hot(pred, num_classes), one_hot(target, num_classes)


def dice(pred: torch.Tensor, target: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Dice 2|P∩T|/(|P|+|T|) per case and foreground class: label maps (B,1,...) -> (B, num_classes-1).

    MONAI ``DiceMetric`` with ``include_background=False, ignore_empty=False``: both empty -> 1,
    one empty -> 0, so the value is never nan.
    """
    return per_class_scores(pred, target, num_classes, ["dice"])["dice"]


def _dice_labels(pred: torch.Tensor, target: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Dice on the label maps themselves (no one-hot copy), per case and foreground class."""
    from monai.metrics import DiceMetric

    metric = DiceMetric(include_background=False, reduction="none", ignore_empty=False, num_classes=num_classes)
    return metric(pred, target).float()


def hd95(pred: torch.Tensor, target: torch.Tensor, num_classes: int, spacing=None) -> torch.Tensor:
    """95th-percentile symmetric Hausdorff distance: (B,1,...) -> (B, num_classes-1), in mm with ``spacing``.

    MONAI ``HausdorffDistanceMetric(percentile=95)``; nan where pred or target of a class is empty.
    ``spacing``: voxel size per spatial axis, for all cases or one row per case (default: pixels).
    """
    return per_class_scores(pred, target, num_classes, ["hd95"], spacing=spacing)["hd95"]


def _spacing(spacing, batch: int, dims: int):
    """``spacing`` as MONAI's metrics take it: None, or one list of ``dims`` floats per case."""
    if spacing is None:
        return None
    s = torch.as_tensor(spacing, dtype=torch.float64).cpu()
    if s.ndim == 1:
        s = s.expand(batch, -1)
    if s.shape != (batch, dims):
        raise MedflareError(f"'spacing' must hold {dims} voxel sizes (for the batch or per case), got shape {tuple(s.shape)}")
    return s.tolist()


def _empty(p: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, C-1) masks: prediction empty, target empty (per foreground class)."""
    return p[:, 1:].flatten(2).sum(-1) == 0, t[:, 1:].flatten(2).sum(-1) == 0


def _hd95_one_hot(p: torch.Tensor, t: torch.Tensor, spacing=None) -> torch.Tensor:
    from monai.metrics import HausdorffDistanceMetric

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MONAI warns on every empty mask; nan is our documented answer
        metric = HausdorffDistanceMetric(include_background=False, percentile=95, reduction="none")
        out = metric(p, t, spacing=_spacing(spacing, p.shape[0], p.ndim - 2)).float()
    empty_p, empty_t = _empty(p, t)
    out = out.to(empty_p.device)
    out[empty_p | empty_t] = float("nan")
    out[torch.isinf(out)] = float("nan")
    return out


def surface_dice(pred: torch.Tensor, target: torch.Tensor, num_classes: int, tolerance: float, spacing=None) -> torch.Tensor:
    """Normalised surface Dice at ``tolerance`` (mm with ``spacing``, else pixels): (B,1,...) -> (B, num_classes-1).

    The fraction of both boundaries lying within ``tolerance`` of the other (Nikolov et al. 2021), MONAI
    ``compute_surface_dice``; both empty -> 1, one empty -> 0.
    """
    return per_class_scores(pred, target, num_classes, [f"surface_dice_{tolerance}mm"], spacing=spacing)[f"surface_dice_{tolerance}mm"]


def _surface_dice_one_hot(p: torch.Tensor, t: torch.Tensor, tolerance: float, spacing=None) -> torch.Tensor:
    from monai.metrics import compute_surface_dice

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = compute_surface_dice(p, t, class_thresholds=[float(tolerance)] * (p.shape[1] - 1), include_background=False,
                                   spacing=_spacing(spacing, p.shape[0], p.ndim - 2)).float()
    empty_p, empty_t = _empty(p, t)
    out[empty_p & empty_t] = 1.0
    out[empty_p ^ empty_t] = 0.0
    return out


def _confusion_one_hot(p: torch.Tensor, t: torch.Tensor, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """Confusion-matrix metrics ``names`` (e.g. "sensitivity") from one shared confusion matrix."""
    from monai.metrics import ConfusionMatrixMetric, compute_confusion_matrix_metric

    cm = ConfusionMatrixMetric(include_background=False, metric_name=list(names), reduction="none")(p, t)  # (B, C-1, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {name: compute_confusion_matrix_metric(name, cm).float() for name in names}


def per_class_scores(
    pred: torch.Tensor, target: torch.Tensor, num_classes: int, names: Sequence[str], device: str | torch.device = "cpu",
    spacing=None,
) -> dict[str, torch.Tensor]:
    """Several of dice/hd95/surface_dice_<t>mm/sensitivity/specificity of a batch at once: {name: (B, num_classes-1)} on ``device``.

    Same values as calling each function, but the label maps are checked once, one-hot encoded once (only
    when a metric needs it: Dice does not), and sensitivity and specificity share one confusion matrix.
    ``spacing``: see :func:`hd95`.
    """
    surface = {name: tol for name in names if (tol := surface_tolerance(name)) is not None}
    unknown = set(names) - {"dice", "hd95", "sensitivity", "specificity"} - set(surface)
    if unknown:
        raise MedflareError(f"per_class_scores: unknown metric(s) {sorted(unknown)}")
    pred, target = check_label_maps(pred, target, num_classes, device)
    out: dict[str, torch.Tensor] = {}
    if "dice" in names:
        out["dice"] = _dice_labels(pred, target, num_classes)
    confusion = [n for n in ("sensitivity", "specificity") if n in names]
    if "hd95" in names or confusion or surface:
        p, t = _one_hot(pred, target, num_classes)
        if "hd95" in names:
            out["hd95"] = _hd95_one_hot(p, t, spacing)
        for name, tolerance in surface.items():
            out[name] = _surface_dice_one_hot(p, t, tolerance, spacing)
        if confusion:
            out.update(_confusion_one_hot(p, t, confusion))
    return out


def surface_tolerance(name: str) -> float | None:
    """The tolerance of a metric named ``surface_dice_<t>mm`` (e.g. ``surface_dice_2mm`` -> 2.0), else None."""
    if name.startswith("surface_dice_") and name.endswith("mm"):
        try:
            value = float(name[len("surface_dice_"):-2])
        except ValueError:
            return None
        return value if value >= 0 else None
    return None


def sensitivity(pred: torch.Tensor, target: torch.Tensor, num_classes: int) -> torch.Tensor:
    """TP/(TP+FN) per case and foreground class: (B,1,...) -> (B, num_classes-1); nan if the class is absent."""
    return per_class_scores(pred, target, num_classes, ["sensitivity"])["sensitivity"]


def specificity(pred: torch.Tensor, target: torch.Tensor, num_classes: int) -> torch.Tensor:
    """TN/(TN+FP) per case and foreground class: (B,1,...) -> (B, num_classes-1); nan if the class fills the image."""
    return per_class_scores(pred, target, num_classes, ["specificity"])["specificity"]


def mean_pixel_accuracy(
    pred: torch.Tensor, target: torch.Tensor, num_classes: int, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """Mean pixel accuracy (Long et al. 2015, the MPA of FedST): (B,1,...) -> (B,) on ``device``.

    Per case, the mean over classes present in the target (background included) of the fraction
    of that class's pixels predicted as that class, ``n_cc / t_c``; computed for the whole batch at once.
    """
    pred, target = check_label_maps(pred, target, num_classes, device)
    p, t = _one_hot(pred, target, num_classes)
    hits = (p * t).flatten(2).sum(-1).double()  # (B, C): n_cc
    counts = t.flatten(2).sum(-1).double()  # (B, C): t_c
    per_class = torch.where(counts > 0, hits / counts.clamp(min=1), torch.full_like(hits, float("nan")))
    return torch.nanmean(per_class, dim=1).float()


def variation_of_information(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Variation of information H(T|P) + H(P|T) in bits (Meilă 2007): (B,1,...) -> (B,); lower is better.

    Uses :func:`skimage.metrics.variation_of_information`, which works in log base 2, on the label
    maps as partitions (the label values themselves do not matter, only which pixels share one).
    """
    from skimage.metrics import variation_of_information as _vi

    pred, target = check_label_maps(pred, target)
    return torch.tensor(
        [float(np.sum(_vi(t.numpy(), p.numpy()))) for p, t in zip(pred[:, 0], target[:, 0])], dtype=torch.float32
    )


def nanmean_with_count(values: torch.Tensor | np.ndarray | list[float]) -> tuple[float, int]:
    """Mean over the non-nan entries of ``values`` (any shape) and the number of nan entries.

    The mean is nan when every entry is nan (or there are none).
    """
    arr = np.asarray(torch.as_tensor(values, dtype=torch.float64).cpu(), dtype=np.float64).ravel()
    nans = int(np.isnan(arr).sum())
    return (float(np.nanmean(arr)) if nans < arr.size else float("nan")), nans
