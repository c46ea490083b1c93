"""A site's own privacy filter for condensed sets, applied by FLARE like its own filters (a DXOFilter).

A site lists it in a scope of its ``local/privacy.json`` (template scope ``condensed`` in
app_configs/site/local/privacy.json); FLARE runs the scope's result filters on every reply of a job that
picks the scope and recurses into COLLECTION DXOs, so the filter sees the ``condensed`` part of a FedVCK
reply (data kind ``CONDENSED_SET``) and nothing else::

    {"path": "medflare.fedvck.filters.CondensedSetFilter",
     "args": {"max_per_class": 10, "noise_std": 0.02, "levels": 32}}

In this order: keep at most ``max_per_class`` images of each class (a random subset), add Gaussian noise of
standard deviation ``noise_std`` (in units of the [0, 1] pixel range) to every pixel, quantise to ``levels``
grey levels, and send uint8 again. The server trains on whatever arrives.
"""

from __future__ import annotations

import numpy as np
from nvflare.apis.dxo import DXO
from nvflare.apis.dxo_filter import DXOFilter
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable

from medflare import ConfigError
from medflare.fedvck.protocol import CONDENSED_SET


def filter_condensed(images: np.ndarray, labels: np.ndarray, *, max_per_class: int = 0, noise_std: float = 0.0, levels: int = 256,
                     rng: np.random.Generator | None = None) -> tuple[np.ndarray, np.ndarray]:
    """uint8 (M, C, H, W) images and (M,) labels -> the capped, noised, quantised uint8 images and their labels."""
    rng = rng or np.random.default_rng()
    images, labels = np.asarray(images), np.asarray(labels)
    keep = np.arange(len(labels))
    if max_per_class > 0:
        chosen = [np.sort(rng.permutation(np.flatnonzero(labels == c))[:max_per_class]) for c in np.unique(labels)]
        keep = np.sort(np.concatenate(chosen)) if chosen else keep
    x = images[keep].astype(np.float64) / 255.0 if images.dtype == np.uint8 else np.asarray(images[keep], dtype=np.float64)
    if noise_std > 0:
        x = x + rng.normal(0.0, noise_std, size=x.shape)
    step = 1.0 / (levels - 1)
    x = np.round(np.clip(x, 0.0, 1.0) / step) * step
    return np.round(x * 255).astype(np.uint8), labels[keep]


class CondensedSetFilter(DXOFilter):
    """Caps, noises and quantises outgoing condensed sets (DXO kind ``CONDENSED_SET``).

    Args:
        max_per_class: most images of one class that leave the site; 0 = no cap. Default 0.
        noise_std: standard deviation of Gaussian pixel noise, in units of the [0, 1] range; 0 = none. Default 0.
        levels: grey levels of the sent images, 2..256 (256 = uint8 as is). Default 256.
        seed: seed of the random subset and noise; None (default) draws from the OS, so repeated rounds get
            fresh noise. Set it only for tests.
    """

    def __init__(self, max_per_class: int = 0, noise_std: float = 0.0, levels: int = 256, seed: int | None = None):
        super().__init__(supported_data_kinds=[CONDENSED_SET], data_kinds_to_filter=[CONDENSED_SET])
        if isinstance(max_per_class, bool) or not isinstance(max_per_class, int) or max_per_class < 0:
            raise ConfigError(f"CondensedSetFilter: 'max_per_class' must be an int >= 0, got {max_per_class!r}")
        if isinstance(noise_std, bool) or not isinstance(noise_std, (int, float)) or not noise_std >= 0:
            raise ConfigError(f"CondensedSetFilter: 'noise_std' must be a number >= 0, got {noise_std!r}")
        if isinstance(levels, bool) or not isinstance(levels, int) or not 2 <= levels <= 256:
            raise ConfigError(f"CondensedSetFilter: 'levels' must be an int in [2, 256], got {levels!r}")
        self.max_per_class, self.noise_std, self.levels, self.seed = max_per_class, float(noise_std), levels, seed
        self._rng = np.random.default_rng(seed)

    def process_dxo(self, dxo: DXO, shareable: Shareable, fl_ctx: FLContext) -> DXO:
        images, labels = filter_condensed(dxo.data["images"], dxo.data["labels"], max_per_class=self.max_per_class,
                                          noise_std=self.noise_std, levels=self.levels, rng=self._rng)
        self.log_info(fl_ctx, f"condensed set: {len(dxo.data['labels'])} -> {len(labels)} images, noise std {self.noise_std}, {self.levels} levels")
        return DXO(dxo.data_kind, data={"images": images, "labels": labels}, meta=dict(dxo.meta))
