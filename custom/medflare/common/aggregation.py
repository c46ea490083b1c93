"""Server math every averaging workflow shares, on flat parameter dicts ``{name: np.ndarray}`` as on the wire.

Plain numpy, no FLARE: FedSM's global model, FedST's generators and any future averaging controller
call these; the unit tests call them with hand-computed arrays.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from medflare import PayloadError

Params = Mapping[str, np.ndarray]


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
    """``sum_k w_k m_k / sum_k w_k`` key by key (FedAvg with w_k = n_k). Integer arrays take model 0's value.

    Integer entries (e.g. BatchNorm's ``num_batches_tracked``) are counters, not weights; averaging them
    would only round them.
    """
    keys = same_keys(models, "weighted_mean")
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (len(models),) or not np.all(w >= 0) or w.sum() <= 0:
        raise PayloadError(f"weighted_mean: need one non-negative weight per model with a positive sum, got {list(weights)}")
    w = w / w.sum()
    out = {}
    for k in keys:
        first = np.asarray(models[0][k])
        if not np.issubdtype(first.dtype, np.floating):
            out[k] = first.copy()
            continue
        acc = sum(wi * np.asarray(m[k], dtype=np.float64) for wi, m in zip(w, models))
        out[k] = acc.astype(first.dtype)
    return out


def apply_diff(params: Params, diff: Params) -> dict[str, np.ndarray]:
    """``params + diff`` key by key, in ``params``' dtypes (a WEIGHT_DIFF applied to the model it was taken from)."""
    missing = sorted(set(params) - set(diff))
    if missing:
        raise PayloadError(f"apply_diff: the diff lacks {missing[:5]}")
    return {k: (np.asarray(v) + np.asarray(diff[k])).astype(np.asarray(v).dtype) for k, v in params.items()}
