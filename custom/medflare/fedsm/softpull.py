"""FedSM server math on flat parameter dicts: n_k/n-weighted averaging and SoftPull (paper Eq. 11).

Plain numpy, no FLARE: the controller calls these with the models it holds, the unit tests with
hand-computed arrays. A model is a flat ``{name: np.ndarray}`` dict, as on the wire.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from medflare import MedflareError

Params = Mapping[str, np.ndarray]


def _check_same_keys(models: Sequence[Params], what: str) -> list[str]:
    if not models:
        raise MedflareError(f"{what}: no models given")
    keys = sorted(models[0])
    for i, m in enumerate(models[1:], 1):
        if sorted(m) != keys:
            diff = sorted(set(keys) ^ set(m))[:5]
            raise MedflareError(f"{what}: model {i} has different parameter names than model 0 ({diff})")
    return keys


def weighted_mean(models: Sequence[Params], weights: Sequence[float]) -> dict[str, np.ndarray]:
    """``sum_k w_k m_k / sum_k w_k`` key by key (FedAvg with w_k = n_k). Integer arrays take model 0's value.

    Integer entries (e.g. BatchNorm's ``num_batches_tracked``) are counters, not weights; averaging them
    would only round them.
    """
    keys = _check_same_keys(models, "weighted_mean")
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (len(models),) or not np.all(w >= 0) or w.sum() <= 0:
        raise MedflareError(f"weighted_mean: need one non-negative weight per model with a positive sum, got {list(weights)}")
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


def check_lambda(lam: float, num_sites: int) -> float:
    """SoftPull's lambda as a float, or MedflareError unless it lies in [1/K, 1] (K = ``num_sites``)."""
    lam = float(lam)
    if not 1.0 / num_sites - 1e-9 <= lam <= 1.0 + 1e-9:
        raise MedflareError(
            f"softpull: 'lambda' must lie in [1/K, 1] = [{1.0 / num_sites:.4f}, 1] for K={num_sites} sites, got {lam}"
        )
    return lam


def softpull(models: Sequence[Params], lam: float) -> list[dict[str, np.ndarray]]:
    """SoftPull, Eq. 11: ``w_k <- lam * w_k + (1 - lam) / (K - 1) * sum_{k' != k} w_k'`` for every k.

    ``models`` are the K personalised models after local training, in site-index order; ``lam`` must
    lie in [1/K, 1]: 1/K gives every site the plain mean (FedAvg's hard averaging, unweighted as in the
    paper), 1 keeps each site's own model (local training). Float entries, BatchNorm running statistics
    included, are pulled like weights (they describe the same interpolated model); integer entries
    (``num_batches_tracked``) keep the site's own value. Returns K new dicts; the inputs are not changed.
    """
    keys = _check_same_keys(models, "softpull")
    K = len(models)
    if K == 1:
        return [{k: np.array(models[0][k], copy=True) for k in keys}]
    lam = check_lambda(lam, K)
    other = (1.0 - lam) / (K - 1)
    out: list[dict[str, np.ndarray]] = [{} for _ in range(K)]
    for key in keys:
        arrays = [np.asarray(m[key]) for m in models]
        if not np.issubdtype(arrays[0].dtype, np.floating):
            for k in range(K):
                out[k][key] = arrays[k].copy()
            continue
        total = sum(a.astype(np.float64) for a in arrays)
        for k in range(K):
            own = arrays[k].astype(np.float64)
            out[k][key] = (lam * own + other * (total - own)).astype(arrays[k].dtype)
    return out
