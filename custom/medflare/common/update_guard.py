"""Screening of a site's contribution before it reaches a model: NaN/Inf anywhere, or an update far larger than its peers'.

One broken or hostile hospital must not end everyone's job: a single NaN in a weight diff makes FedAvg's
mean NaN, every site then trains from a NaN model and the job dies a round later with nothing naming the
cause. The server screens every result here (through :class:`medflare.common.result_guard.UpdateGuard`, a
FLARE result filter) and refuses the ones that fail:

- **finite**: every float array or tensor of the payload (its data and its meta, e.g. SCAFFOLD's control
  diff, which FLARE keeps in meta; every part of a COLLECTION) must be finite. Python scalars are left
  alone, and so are METRICS parts: a metric may be NaN or Inf by definition (HD95 of an empty prediction).
  Integer arrays cannot hold NaN and are not looked at.
- **structure**: every WEIGHTS / WEIGHT_DIFF part must match the weights the server sent with the task (see
  :func:`structure_mismatch`): no key the server did not send, the same shape and dtype for every key, and no
  key left out of a model the part updates. One site's wrong shape or extra key used to end the whole job in
  FLARE's aggregation (a broadcast ValueError / KeyError, FATAL_SYSTEM_ERROR), and a missing key was averaged
  over the others silently. SCAFFOLD's control diff is held to the first two only: controls exist for trainable
  parameters, not BatchNorm buffers (:class:`Part` ``subset``). When the server sent no weights with the task (a
  site uploading a model of its own, FedST-separate's generators) there is nothing to compare with and the rule does
  not apply.
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
from medflare.common.quantize import decoded_structure, is_encoded

#: DXO data kinds whose norm is screened (FLARE's DataKind values)
WEIGHT_KINDS = frozenset({"WEIGHTS", "WEIGHT_DIFF"})
#: DXO data kinds whose values are never screened for finiteness (a metric may legitimately be NaN or Inf)
METRIC_KINDS = frozenset({"METRICS"})

#: ``{key: (shape, dtype)}`` of the arrays of weight payloads (what the server sent, what a site returns)
Structure = Mapping[str, tuple[tuple[int, ...], np.dtype]]


@dataclass(frozen=True)
class Part:
    """One DXO of a result (the whole result, or one part of a COLLECTION): its data kind, data and meta. ``subset``: a
    weight part that may leave out keys of what the server sent (SCAFFOLD's control diff covers the trainable
    parameters only, not BatchNorm buffers or frozen layers, as FLARE's ``PTScaffoldHelper`` keeps controls)."""

    kind: str
    data: Any
    meta: Mapping[str, Any] = field(default_factory=dict)
    subset: bool = False


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


def _dtype(value: Any) -> np.dtype:
    """numpy's dtype of an array, tensor or scalar (a tensor's torch dtype mapped to numpy's; object if it has none)."""
    if isinstance(value, torch.Tensor):
        try:
            return torch.empty((), dtype=value.dtype).numpy().dtype
        except TypeError:  # bfloat16 and other dtypes numpy lacks
            return np.dtype(object)
    try:
        return np.asarray(value).dtype
    except Exception:  # noqa: BLE001 - anything numpy cannot hold is not a weight
        return np.dtype(object)


def weight_structure(parts: Mapping[str, Part]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """``{key: (shape, dtype)}`` of the entries of every WEIGHTS / WEIGHT_DIFF part (their union, by flat key)."""
    out = {}
    for part in parts.values():
        if part.kind in WEIGHT_KINDS and isinstance(part.data, Mapping):
            if is_encoded(part.data):  # a quantized diff: the entries it decodes to (medflare.common.quantize)
                out.update(decoded_structure(part.data))
            else:
                out.update({str(k): (tuple(np.shape(v)), _dtype(v)) for k, v in part.data.items()})
    return out


def _group(key: str) -> str:
    """The model a flat key belongs to: its first dotted segment (``global`` of ``global.conv.weight``)."""
    return key.partition(".")[0]


def _groups(structure: Structure) -> dict[str, dict]:
    """``structure`` by :func:`_group`, each group's keys without the group's prefix (a flattened payload's models)."""
    out: dict[str, dict] = {}
    for key, spec in structure.items():
        group, _, rest = key.partition(".")
        if rest:
            out.setdefault(group, {})[rest] = spec
    return out


def _same_dtype(got: np.dtype, expected: np.dtype) -> bool:
    """Equal dtypes; or an integer entry (a counter) that came back as a float: FLARE's PercentilePrivacy divides every
    entry of a diff by the step count, which makes an int64 counter float64 at an honest site; or the reverse: FLARE's
    weighted average makes the global model's counters float64, and an honest site's model keeps them int64."""
    return got == expected or {got.kind, expected.kind} in ({"i", "f"}, {"u", "f"})


def structure_mismatch(sent: Structure, data: Mapping[str, Any], allow_missing: bool = False) -> str | None:
    """None when the weight payload ``data`` fits the weights the server ``sent``, else why not (naming the keys).

    ``data``'s keys are looked up among the sent keys, or, when they are not all there, among the keys of one sent
    model (a flattened multi-model payload's ``<model>.`` group, e.g. FedSM's selector head step, whose keys are
    ``head.*`` of the sent ``select.*``). Refused: a key found in neither (extra), a shape or dtype unlike the sent
    one (a ``(1,)`` array for a bias), and a key left out of a model the payload updates, a model being the keys that
    share a first dotted segment (a missing key would be averaged over the other sites only, or end the job in the
    workflow's own aggregation). A payload may leave out whole models (FedSM's sites update the global and their own
    model, not the selector they were sent). A site's privacy filter that removes single tensors (FLARE's
    ``ExcludeVars``) therefore gets its results refused, loudly, instead of silently averaged. ``allow_missing``: the
    last rule is off (a payload that covers part of the model by design, e.g. SCAFFOLD's control diff).
    """
    if not isinstance(data, Mapping):
        return f"a weight payload must be a dict of arrays, got {type(data).__name__}"
    keys = {str(k) for k in data}
    space: Structure = sent
    if not keys <= set(sent):
        space = next((sub for sub in _groups(sent).values() if keys <= set(sub)), sent)
    extra = sorted(keys - set(space))
    if extra:
        return f"{len(extra)} keys the server did not send: {extra[:5]}{' ...' if len(extra) > 5 else ''}"
    for key in sorted(keys):
        shape, dtype = tuple(np.shape(data[key])), _dtype(data[key])
        want_shape, want_dtype = space[key]
        if shape != want_shape or not _same_dtype(dtype, want_dtype):
            return f"key '{key}' is {shape} {dtype}, the server sent {want_shape} {want_dtype}"
    touched = {_group(k) for k in keys}
    missing = [] if allow_missing else sorted(k for k in space if _group(k) in touched and k not in keys)
    if missing:
        return f"{len(missing)} keys missing: {missing[:5]}{' ...' if len(missing) > 5 else ''}"
    return None


def parts_mismatch(sent: Structure, parts: Mapping[str, Part]) -> str | None:
    """:func:`structure_mismatch` of each WEIGHTS / WEIGHT_DIFF part (naming the part); None when all fit or nothing was sent."""
    if not sent:
        return None
    for name, part in parts.items():
        if part.kind in WEIGHT_KINDS:
            reason = structure_mismatch(sent, part.data, allow_missing=part.subset)
            if reason:
                return f"{name + ': ' if name else ''}{reason}"
    return None


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

    def screen(self, task: str, rnd: Any, parts: Mapping[str, Part], sent: Structure | None = None) -> str | None:
        """None when the result may reach a model, else the reason it may not (naming the part and key).

        ``task`` and ``rnd`` (the round the result answers; None when unknown, then every result of the task counts
        as one round) select the reference norms; ``parts`` are the result's DXOs by name ("" for a plain DXO);
        ``sent`` is the :func:`weight_structure` of what the server sent with the task (None or empty: not known).
        """
        mismatch = parts_mismatch(sent or {}, parts)
        if mismatch:
            return f"does not fit the model the server sent: {mismatch}"
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
