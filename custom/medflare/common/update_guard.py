"""Screening of a site's contribution before it reaches a model: NaN/Inf anywhere, or an update far larger than its peers'.

One broken or hostile hospital must not end everyone's job: a single NaN in a weight diff makes FedAvg's
mean NaN, every site then trains from a NaN model and the job dies a round later with nothing naming the
cause. The server screens every result here (through :class:`medflare.common.result_guard.UpdateGuard`, a
FLARE result filter) and refuses the ones that fail:

- **finite**: every float array or tensor of the payload (its data and its meta, e.g. SCAFFOLD's control
  diff, which FLARE keeps in meta; every part of a COLLECTION) must be finite. Python scalars are left
  alone, and so are METRICS parts: a metric may be NaN or Inf by definition (HD95 of an empty prediction).
  Integer arrays cannot hold NaN and are not looked at.
- **norm**: for weight payloads (WEIGHTS / WEIGHT_DIFF parts) the Euclidean norm over the float entries must
  not exceed ``max_norm_ratio`` times the median of the *reference* norms (a scaled or exploding update).

The reference of a result is what the server has accepted for the same task and part: the norms accepted
so far this round together with the norms accepted in the previous round of that task. Results arrive one
by one and must be judged on arrival (FLARE aggregates in time), so the first result of a job's first round
has no reference and is only checked for finiteness; from then on a site is compared with at least one
accepted peer. The previous round's norms let the first arrivals of a round be judged too; a legitimate
update shrinks from round to round, so the rule is loose in that direction. A zero median says nothing about
scale (e.g. nobody trained a part) and disables the rule for that result. Refused norms never enter a
reference, so one hostile site cannot raise the bar for the next.

Plain numpy/torch, no FLARE: the filter turns a DXO into :class:`Part` s and calls :meth:`UpdateScreen.screen`.
:func:`nonfinite_paths` and :func:`tree_norm` are also the sites' own checks (``payload.check_finite`` before a
site sends, the baselines' ``update_norm``), so a site and the server judge a payload the same way.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import numpy as np
import torch

from medflare import ConfigError

#: DXO data kinds whose norm is screened (FLARE's DataKind values)
WEIGHT_KINDS = frozenset({"WEIGHTS", "WEIGHT_DIFF"})
#: DXO data kinds whose values are never screened for finiteness (a metric may legitimately be NaN or Inf)
METRIC_KINDS = frozenset({"METRICS"})


@dataclass(frozen=True)
class Part:
    """One DXO of a result (the whole result, or one part of a COLLECTION): its data kind, data and meta."""

    kind: str
    data: Any
    meta: Mapping[str, Any] = field(default_factory=dict)


def _float_leaves(tree: Any, path: str = "") -> Iterator[tuple[str, np.ndarray | torch.Tensor]]:
    """``(path, array)`` for every float numpy array or torch tensor in nested mappings / lists / tuples."""
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from _float_leaves(value, f"{path}.{key}" if path else str(key))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from _float_leaves(value, f"{path}[{i}]")
    elif isinstance(tree, torch.Tensor):
        if tree.is_floating_point() or tree.is_complex():
            yield path, tree
    elif isinstance(tree, np.ndarray):
        if np.issubdtype(tree.dtype, np.floating) or np.issubdtype(tree.dtype, np.complexfloating):
            yield path, tree


def _all_finite(value: np.ndarray | torch.Tensor) -> bool:
    if isinstance(value, torch.Tensor):
        return bool(torch.isfinite(value).all())
    return bool(np.isfinite(value).all())


def nonfinite_paths(tree: Any) -> list[str]:
    """Paths (``key.sub[0]``) of the float arrays / tensors in ``tree`` that hold a NaN or an Inf."""
    return [path for path, value in _float_leaves(tree) if not _all_finite(value)]


def tree_norm(tree: Any) -> float:
    """Euclidean norm over every float array / tensor entry of ``tree`` (float64 accumulation; integers ignored)."""
    total = 0.0
    for _, value in _float_leaves(tree):
        if isinstance(value, torch.Tensor):
            total += float(value.detach().to(torch.float64).abs().pow(2).sum())
        else:
            total += float(np.sum(np.abs(value.astype(np.complex128 if np.iscomplexobj(value) else np.float64)) ** 2))
    return math.sqrt(total)


def nonfinite_parts(parts: Mapping[str, Part]) -> list[str]:
    """``part:path`` of every non-finite float array in the parts' data and meta (METRICS parts skipped)."""
    bad = []
    for name, part in parts.items():
        if part.kind in METRIC_KINDS:
            continue
        for where, tree in (("", part.data), ("meta.", part.meta)):
            bad += [f"{name + ':' if name else ''}{where}{path}" for path in nonfinite_paths(tree)]
    return bad


class NormRule:
    """The median-multiple rule on the norms of one kind of update (one task and part), round by round.

    Args:
        max_ratio: a norm above ``max_ratio`` x the reference median is refused; 0 = rule off.
    """

    def __init__(self, max_ratio: float):
        self.max_ratio = max_ratio
        self.round: Any = None
        self.current: list[float] = []  # accepted this round
        self.previous: list[float] = []  # accepted in the last round that accepted any

    def reference(self, rnd: Any) -> list[float]:
        """The norms a result of round ``rnd`` is compared with (starts a new round when ``rnd`` changes)."""
        if rnd != self.round:
            if self.current:
                self.previous = self.current
            self.round, self.current = rnd, []
        return self.current + self.previous

    def check(self, rnd: Any, norm: float) -> str | None:
        """None when ``norm`` passes (call :meth:`accept` to let it join the reference), else why it is refused."""
        ref = self.reference(rnd)
        if self.max_ratio and ref:
            median = float(np.median(ref))
            if median > 0 and norm > self.max_ratio * median:
                return f"update norm {norm:.4g} > {self.max_ratio:g} x median {median:.4g} of {len(ref)} accepted updates"
        return None

    def accept(self, norm: float) -> None:
        """Let an accepted norm join this round's reference."""
        self.current.append(norm)


class UpdateScreen:
    """Judges each arriving result (see the module docstring); keeps one :class:`NormRule` per task and part.

    Args:
        max_norm_ratio: largest accepted multiple of the reference median norm of a weight payload; 0 turns the
            norm rule off (finiteness is still checked). Default 10.
    """

    def __init__(self, max_norm_ratio: float = 10.0):
        if isinstance(max_norm_ratio, bool) or not isinstance(max_norm_ratio, (int, float)) or not (
                max_norm_ratio == 0 or max_norm_ratio >= 1):
            raise ConfigError(f"UpdateGuard: 'max_norm_ratio' must be 0 (off) or >= 1, got {max_norm_ratio!r}")
        self.max_norm_ratio = float(max_norm_ratio)
        self.rules: dict[tuple[str, str], NormRule] = {}
        self._lock = threading.Lock()

    def screen(self, task: str, rnd: Any, parts: Mapping[str, Part]) -> str | None:
        """None when the result may reach a model, else the reason it may not (naming the part and key).

        ``task`` and ``rnd`` (the round the result answers; None when unknown, then every result of the task counts
        as one round) select the reference norms; ``parts`` are the result's DXOs by name ("" for a plain DXO).
        """
        bad = nonfinite_parts(parts)
        if bad:
            return f"NaN/Inf values in {len(bad)} arrays: {bad[:5]}{' ...' if len(bad) > 5 else ''}"
        weights = {name: tree_norm(part.data) for name, part in parts.items() if part.kind in WEIGHT_KINDS}
        with self._lock:
            rules = {name: self.rules.setdefault((task, name), NormRule(self.max_norm_ratio)) for name in weights}
            for name, norm in weights.items():
                reason = rules[name].check(rnd, norm)
                if reason:
                    return f"{name + ': ' if name else ''}{reason}"
            for name, norm in weights.items():  # only a result accepted as a whole joins the references
                rules[name].accept(norm)
        return None
