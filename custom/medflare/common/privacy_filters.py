"""A site's clip-and-noise filter for any of the bundle's array payloads, applied by FLARE like its own filters.

FLARE ships filters for weights (PercentilePrivacy, SVTPrivacy, ExcludeVars) and a blocker for any kind (DXOBlocker),
but no Gaussian mechanism for the bundle's own kinds (FedIOD's logits, scores and input gradients, FedSM's feature
statistics). :class:`ClipAndNoise` is that: a site lists it in a scope of its ``local/privacy.json`` with the data
kinds it applies to (FLARE recurses into COLLECTION replies, so it acts on those parts only)::

    {"path": "medflare.common.privacy_filters.ClipAndNoise",
     "args": {"data_kinds": ["FEDIOD_LOGITS", "FEDIOD_SCORES"], "clip_norm": 10.0, "noise_std": 0.5}}

Every float array of a matching part is clipped row by row to L2 norm ``clip_norm`` (a row: the entries after the
first ``row_axes`` axes; 0 = the whole array is one vector) and gets Gaussian noise of standard deviation ``noise_std``.
Integer arrays (counts, labels) are left alone: block them with a DXOBlocker when they may not leave. FedVCK's condensed
images have their own filter (:class:`medflare.fedvck.filters.CondensedSetFilter`).
"""

from __future__ import annotations

from typing import List

import numpy as np
from nvflare.apis.dxo import DXO
from nvflare.apis.dxo_filter import DXOFilter
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable

from medflare import ConfigError


def clip_and_noise_array(x: np.ndarray, clip_norm: float, noise_std: float, row_axes: int, rng: np.random.Generator) -> np.ndarray:
    """``x`` with each row clipped to L2 norm ``clip_norm`` (0 = no clip) plus N(0, noise_std^2) noise; dtype kept."""
    out = np.asarray(x, dtype=np.float64)
    if clip_norm > 0:
        rows = out.reshape(int(np.prod(out.shape[:row_axes])) if row_axes else 1, -1)
        norms = np.linalg.norm(rows, axis=1, keepdims=True)
        rows = rows * np.minimum(1.0, clip_norm / np.maximum(norms, 1e-12))
        out = rows.reshape(out.shape)
    if noise_std > 0:
        out = out + rng.normal(0.0, noise_std, size=out.shape)
    return out.astype(np.asarray(x).dtype)


class ClipAndNoise(DXOFilter):
    """Clip and noise the float arrays of the listed data kinds (see the module docstring).

    Args:
        data_kinds: DXO data kinds it acts on (FLARE's or the bundle's own, e.g. "FEDIOD_LOGITS"). Required.
        clip_norm: L2 bound of each row; 0 = no clipping. Default 0.
        noise_std: standard deviation of the Gaussian noise added to every entry; 0 = none. Default 0.
        row_axes: leading axes that index rows (vectors clipped one by one); 0 = one vector. Default 1.
        seed: seed of the noise (None = fresh randomness each run). Default None.
    """

    def __init__(self, data_kinds: List[str], clip_norm: float = 0.0, noise_std: float = 0.0, row_axes: int = 1,
                 seed: int | None = None):
        if not data_kinds or not all(isinstance(k, str) for k in data_kinds):
            raise ConfigError(f"ClipAndNoise: 'data_kinds' must be a non-empty list of kind names, got {data_kinds!r}")
        for name, value in (("clip_norm", clip_norm), ("noise_std", noise_std)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"ClipAndNoise: '{name}' must be a number >= 0, got {value!r}")
        if isinstance(row_axes, bool) or not isinstance(row_axes, int) or row_axes < 0:
            raise ConfigError(f"ClipAndNoise: 'row_axes' must be an integer >= 0, got {row_axes!r}")
        super().__init__(supported_data_kinds=[], data_kinds_to_filter=list(data_kinds))
        self.clip_norm, self.noise_std, self.row_axes, self.seed = float(clip_norm), float(noise_std), row_axes, seed
        self.rng = np.random.default_rng(seed)

    def process_dxo(self, dxo: DXO, shareable: Shareable, fl_ctx: FLContext) -> DXO | None:
        data = {}
        for key, value in dxo.data.items():
            arr = np.asarray(value) if isinstance(value, np.ndarray) else None
            if arr is not None and np.issubdtype(arr.dtype, np.floating):
                data[key] = clip_and_noise_array(arr, self.clip_norm, self.noise_std, min(self.row_axes, arr.ndim), self.rng)
            else:
                data[key] = value
        return DXO(dxo.data_kind, data=data, meta=dict(dxo.meta or {}))
