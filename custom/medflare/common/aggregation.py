"""Server math every averaging workflow shares, on flat parameter dicts ``{name: np.ndarray}`` as on the wire.

Plain numpy, no FLARE: FedSM's global model, FedST's generators and any future averaging controller
call these; the unit tests call them with hand-computed arrays.

Sums run in float64 and every result is checked finite before it is cast back to the model's dtype
(:func:`cast_back`): a weighted sum of finite float32 updates can overflow float32 (issue 28: a count of 1e300
gave a NaN global model that was saved and sent), and a non-finite aggregate must never become a model. A
non-finite result raises PayloadError naming the keys; the workflow then ends the round without saving, so the
last saved model stays the last good one. FLARE's FedAvg / Scaffold get the same treatment through
:func:`as_float64` / :func:`cast_back` (:mod:`medflare.baselines.controller`).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

from medflare import PayloadError

Params = Mapping[str, np.ndarray]


def _is_float(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_floating_point()
    return isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.floating)


def as_float64(params: Mapping[str, Any]) -> dict[str, Any]:
    """Float arrays / tensors of ``params`` as float64 copies (other entries as they are), so sums do not overflow."""
    return {k: (v.double() if isinstance(v, torch.Tensor) else v.astype(np.float64)) if _is_float(v) else v
            for k, v in params.items()}


def nonfinite_keys(params: Mapping[str, Any]) -> list[str]:
    """Keys of the float arrays / tensors in a flat ``params`` that hold NaN or Inf."""
    bad = []
    for k, v in params.items():
        if isinstance(v, torch.Tensor):
            if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                bad.append(k)
        elif _is_float(np.asarray(v)) and not np.isfinite(np.asarray(v)).all():
            bad.append(k)
    return bad


def check_finite_params(params: Mapping[str, Any], what: str) -> None:
    """PayloadError naming ``what`` and the keys when a float entry of ``params`` is NaN or Inf."""
    bad = nonfinite_keys(params)
    if bad:
        raise PayloadError(f"{what}: NaN/Inf in {len(bad)} of {len(params)} entries {bad[:5]}{' ...' if len(bad) > 5 else ''}; "
                           "refused (nothing saved or sent; the last saved model is the last good one)")


def cast_back(params: Mapping[str, Any], like: Mapping[str, Any], what: str) -> dict[str, Any]:
    """``params`` (float64 sums) checked finite, then each float entry cast to the dtype of the same key in ``like``
    and checked again (a finite float64 may not fit float32); PayloadError naming ``what`` and the keys otherwise."""
    check_finite_params(params, what)
    out = {}
    for k, v in params.items():
        ref = like.get(k)
        if _is_float(v) and ref is not None and _is_float(ref):
            with np.errstate(over="ignore"):  # an overflow is refused just below, naming the key
                v = v.to(ref.dtype) if isinstance(v, torch.Tensor) else np.asarray(v).astype(np.asarray(ref).dtype)
        out[k] = v
    check_finite_params(out, f"{what} (cast back to the model's dtypes)")
    return out


def same_keys(models: Sequence[Params], what: str) -> list[str]:
    """The sorted parameter names every model shares; PayloadError naming ``what`` if any model differs."""
    if not models:
        raise PayloadError(f"{what}: no models given")
    keys = sorted(models[0])
    for i, m in enumerate(models[1:], 1):
        if sorted(m) != keys:
            diff = sorted(set(keys) ^ set(m))[:5]
            raise PayloadError(f"{what}: model {i} has different parameter names than model 0 ({diff})")
    return keys


def weighted_mean(models: Sequence[Params], weights: Sequence[float]) -> dict[str, np.ndarray]:
    """``sum_k w_k m_k / sum_k w_k`` key by key (FedAvg with w_k = n_k), in float64, cast back to model 0's dtypes and
    checked finite (PayloadError naming the keys). Integer arrays take model 0's value.

    Integer entries (e.g. BatchNorm's ``num_batches_tracked``) are counters, not weights; averaging them
    would only round them.
    """
    keys = same_keys(models, "weighted_mean")
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (len(models),) or not np.all(w >= 0) or not np.isfinite(w.sum()) or w.sum() <= 0:
        raise PayloadError(f"weighted_mean: need one non-negative weight per model with a positive sum, got {list(weights)}")
    w = w / w.sum()
    out = {}
    for k in keys:
        first = np.asarray(models[0][k])
        if not np.issubdtype(first.dtype, np.floating):
            out[k] = first.copy()
            continue
        out[k] = sum(wi * np.asarray(m[k], dtype=np.float64) for wi, m in zip(w, models))
    return cast_back(out, models[0], "weighted_mean")


def apply_diff(params: Params, diff: Params) -> dict[str, np.ndarray]:
    """``params + diff`` key by key (floats summed in float64), in ``params``' dtypes and checked finite (a WEIGHT_DIFF
    applied to the model it was taken from); PayloadError naming the keys otherwise."""
    missing = sorted(set(params) - set(diff))
    if missing:
        raise PayloadError(f"apply_diff: the diff lacks {missing[:5]}")
    summed = {k: (np.asarray(v, dtype=np.float64) + np.asarray(diff[k], dtype=np.float64)) if _is_float(np.asarray(v))
              else (np.asarray(v) + np.asarray(diff[k])).astype(np.asarray(v).dtype) for k, v in params.items()}
    return cast_back(summed, params, "apply_diff")
