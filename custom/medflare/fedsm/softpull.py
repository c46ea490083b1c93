"""FedSM server math on flat parameter dicts: SoftPull (paper Eq. 11).

Plain numpy, no FLARE: the controller calls these with the models it holds, the unit tests with
hand-computed arrays. A model is a flat ``{name: np.ndarray}`` dict, as on the wire.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from medflare import ConfigError
from medflare.common.aggregation import Params, same_keys

def check_lambda(lam: float, num_sites: int) -> float:
    """SoftPull's lambda as a float, or MedflareError unless it lies in [1/K, 1] (K = ``num_sites``)."""
    lam = float(lam)
    if not 1.0 / num_sites - 1e-9 <= lam <= 1.0 + 1e-9:
        raise ConfigError(
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
    keys = same_keys(models, "softpull")
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
