"""Server-side persistence of global models built from a preset.

FLARE's ``PTFileModelPersistor`` writes ``FL_global_model.pt`` (last) and ``best_FL_global_model.pt``
(when ``IntimeModelSelector`` reports a new best validation score) into the server's run folder. It
needs the initial network; building it from the same preset as the clients keeps the two sides in step.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from nvflare.app_opt.pt.file_model_persistor import PTFileModelPersistor

from medflare.common.component import keep_args
from medflare.common.results import describe
from medflare.nets import build_from_spec
from medflare.presets import get_preset


def model_from_preset(preset: str, overrides: Mapping[str, Any] | None = None, seed: int = 0) -> torch.nn.Module:
    """The preset's network, initialised from ``seed`` (the server's initial global model)."""
    spec = get_preset(preset, overrides)["model"]
    torch.manual_seed(seed)
    return build_from_spec(spec)


class PresetModelPersistor(PTFileModelPersistor):
    """``PTFileModelPersistor`` whose initial model is the preset's network.

    Args:
        preset: preset name (must match the clients'; checked at START_RUN, medflare.common.preset_check). Default "seg_synthetic".
        overrides: overrides merged into the preset (must match the clients'). Default none.
        seed: initialisation seed of the global model. Default 0.
        **kwargs: passed to PTFileModelPersistor (global_model_file_name, best_global_model_file_name, ...).
    """

    def __init__(self, preset: str = "seg_synthetic", overrides: Mapping[str, Any] | None = None, seed: int = 0, **kwargs):
        super().__init__(model=model_from_preset(preset, overrides, seed), **kwargs)
        keep_args(self, preset=preset, overrides=overrides or {}, seed=seed)
        self.medflare_conf = describe(preset, overrides)

    def load_model(self, fl_ctx):
        learnable = super().load_model(fl_ctx)
        # Saved checkpoints carry the preset, so `medflare evaluate` rebuilds the network without guessing.
        self.persistence_manager.train_conf = {**(self.persistence_manager.train_conf or {}), "medflare": self.medflare_conf}
        return learnable
