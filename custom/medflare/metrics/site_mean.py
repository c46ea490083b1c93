"""One home for reducing per-case, per-class scores to a site's mean (every job, the CLI and the benchmarks).

The rule, and why:
    * A foreground class that no LABEL of the site's cases holds is left out of the site's class average,
      whatever the model predicts, and reported as absent (its per-class mean is nan, shown as "-"). Nothing can
      be learnt about such a class at that site (a 3-class preset on binary brain masks, a label map missing a
      class). The rule before issue 32 also kept such a class when any PREDICTION held it: the key metric then
      jumped with a few stray pixels (the class counted with Dice 1 in every empty-empty case and 0 where a pixel
      strayed), and best-model selection picked the round whose stray pixels paid best: on binary masks under a
      3-class preset the FedAvg model after 6 rounds scored 0.940 against its class-1 Dice of 0.927 and beat the
      better model after 7 rounds (0.931; jobs/fedavg/README.md, "Which model is the best").
    * A class that some label of the site holds keeps the per-case conventions of
      :mod:`medflare.metrics.segmentation` in every case, also where that case has it in neither map: Dice 1 for
      empty-empty (MONAI's ``ignore_empty=False``) and 0 for a prediction where the label is empty, nan for
      HD95/sensitivity where undefined. MONAI's ``ignore_empty=True`` (a case whose label lacks the class does not
      count for it) was measured to pick the same rounds where every case holds every present class, and is not
      used: it stops charging a model for painting the class in cases that have none.
    * The site mean of a metric is the nan-mean over cases of each case's nan-mean over the kept classes (a
      case averages its classes first, so a site whose labels hold every class scores as it always did);
      ``nan_count`` counts the cases whose value is nan.

A site's training-time validation, FedSM's model scores and ``medflare evaluate`` all reduce through
:func:`site_mean`, so the key metric that selects models is the number the evaluation reports.
Plain torch, no FLARE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SiteMean", "label_classes", "site_mean", "unseen_classes_warning"]


@dataclass(frozen=True)
class SiteMean:
    """A metric of one site reduced over classes and cases (see the module docstring).

    ``per_case``: (N,) each case's mean over the kept classes; ``mean``/``nan_count``: over cases;
    ``per_class``: {foreground class k (1-based): mean over cases, nan when absent}; ``absent``: the
    classes left out (in no label of any case).
    """

    per_case: torch.Tensor
    mean: float
    nan_count: int
    per_class: dict[int, float]
    absent: list[int]


def label_classes(target: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Per case and foreground class of (B, 1, ...) label maps: whether the label holds the class, (B, num_classes-1) bool on the CPU."""
    return torch.stack([(target == k).flatten(1).any(1) for k in range(1, num_classes)], 1).cpu()


def site_mean(values: torch.Tensor, present: torch.Tensor | None = None) -> SiteMean:
    """Reduce per-case, per-class ``values`` (N, K) of one site, class k+1 in column k, by the module's rule.

    ``present`` (N, K) bool says where a case's label holds the class (:func:`label_classes`); a class in no
    case's label is left out. None counts every class as present (e.g. an already per-case metric, K = 1).
    """
    values = torch.as_tensor(values, dtype=torch.float64).cpu()
    if values.ndim == 1:
        values = values[:, None]
    present = torch.ones_like(values, dtype=torch.bool) if present is None else torch.as_tensor(present).bool().cpu()
    if present.shape != values.shape:
        raise ValueError(f"site_mean: 'present' shape {tuple(present.shape)} differs from 'values' shape {tuple(values.shape)}")
    kept = present.any(0) if values.shape[0] else torch.zeros(values.shape[1], dtype=torch.bool)
    per_case = torch.nanmean(values[:, kept], 1) if bool(kept.any()) else torch.full((values.shape[0],), float("nan"), dtype=torch.float64)
    nans = int(torch.isnan(per_case).sum())
    mean = float(torch.nanmean(per_case)) if nans < per_case.numel() else float("nan")
    column = torch.nanmean(values, 0) if values.shape[0] else torch.full((values.shape[1],), float("nan"), dtype=torch.float64)
    per_class = {k + 1: (float(column[k]) if kept[k] else float("nan")) for k in range(values.shape[1])}
    return SiteMean(per_case, mean, nans, per_class, [k + 1 for k in range(values.shape[1]) if not kept[k]])


def unseen_classes_warning(site: str, num_classes: int, unseen: list[int], num_cases: int, split: str | None = None) -> str | None:
    """The one warning line (CLI and site validation) when a preset's foreground classes never occur in a site's labels, else None."""
    if not unseen:
        return None
    where = f" ({split} split)" if split else ""
    return (f"warning: site '{site}'{where}: the preset has num_classes={num_classes} but class(es) {', '.join(map(str, unseen))} "
            f"never occur in its labels ({num_cases} cases); check data.num_classes (they are left out of the class means "
            "and shown as '-')")
