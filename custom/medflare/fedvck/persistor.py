"""The FedVCK server's persistor: the global model (initial, last, best) and the ``FedVCK_result.pt`` file, one component.

:class:`FedVCKPersistor` is the preset's :class:`~medflare.common.persistence.PresetModelPersistor` (FLARE's PT
persistor: the initial model from the seed, ``FL_global_model.pt`` after every round, ``best_FL_global_model.pt``
on FLARE's GLOBAL_BEST_MODEL_AVAILABLE) that also writes the FedVCK result (layout and kind in :mod:`.results`)
into the same folder when the controller hands it the round's state (:meth:`FedVCKPersistor.save_result`). This
module is the only writer of that file.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from medflare import ConfigError
from medflare.common.component import keep_args
from medflare.common.persistence import PresetModelPersistor
from medflare.common.results import describe, save_checkpoint
from medflare.fedvck.config import FedVCKConfig
from medflare.fedvck.results import KIND
from medflare.presets import get_preset

RESULT_FILE = "FedVCK_result.pt"


def save_result(
    path: str | os.PathLike,
    *,
    description: Mapping[str, Any],
    global_state: Mapping[str, Any],
    projector: torch.nn.Module | None,
    projector_dims: Sequence[int] | None,
    condensed: Mapping[int, Mapping[str, tuple[np.ndarray, np.ndarray]]],
    sites: Sequence[str],
    round_num: int,
    metrics: Mapping[str, float] | None = None,
) -> None:
    """Write the result atomically; ``condensed`` maps round -> site -> (uint8 images, labels)."""
    data = {
        "train_conf": {"medflare": dict(description)},
        "global": {k: torch.as_tensor(np.array(v, copy=True)) for k, v in global_state.items()},
        "projector": {k: v.detach().cpu().clone() for k, v in projector.state_dict().items()} if projector is not None else {},
        "projector_dims": [int(d) for d in projector_dims] if projector_dims else [],
        "condensed": {str(r): {s: {"images": torch.from_numpy(np.ascontiguousarray(x)), "labels": torch.from_numpy(np.asarray(y, np.int64))}
                               for s, (x, y) in per_site.items()} for r, per_site in condensed.items()},
        "sites": list(sites),
        "round": int(round_num),
        "metrics": {k: float(v) for k, v in (metrics or {}).items()},
    }
    save_checkpoint(data, path)


class FedVCKPersistor(PresetModelPersistor):
    """The global model's FLARE persistor that also writes ``FedVCK_result.pt`` (see the module docstring).

    Args:
        preset / overrides / seed: the network and FedVCK settings (the preset's ``fedvck`` section) and the initial
            model's seed, as the controller's and the sites' (must match). Defaults "fedvck_synthetic", none, 0.
        result_file_name: the FedVCK result file in the server's app folder. Default "FedVCK_result.pt".
        **kwargs: passed to PTFileModelPersistor (global_model_file_name, best_global_model_file_name, ...).
    """

    def __init__(self, preset: str = "fedvck_synthetic", overrides: Mapping[str, Any] | None = None, seed: int = 0,
                 result_file_name: str = RESULT_FILE, **kwargs: Any):
        super().__init__(preset=preset, overrides=overrides, seed=seed, **kwargs)
        keep_args(self, result_file_name=result_file_name)
        settings = FedVCKConfig.from_preset(get_preset(preset, overrides))
        self.result_description = describe(preset, overrides, kind=KIND, fedvck=settings.as_dict())

    def result_path(self) -> str:
        """Where :meth:`save_result` writes: beside ``FL_global_model.pt`` (known once FLARE started the persistor)."""
        folder = getattr(self, "log_dir", None)
        if not folder:
            raise ConfigError("FedVCKPersistor: save_result before the run started (the app folder is not known yet)")
        return os.path.join(folder, self.result_file_name)

    def save_result(self, *, global_state: Mapping[str, Any], projector: torch.nn.Module | None,
                    condensed: Mapping[int, Mapping[str, tuple[np.ndarray, np.ndarray]]], sites: Sequence[str],
                    round_num: int, metrics: Mapping[str, float] | None = None) -> str:
        """Write the round's FedVCK result (``condensed``: round -> site -> (uint8 images, labels)); returns its path."""
        dims = None if projector is None else (projector.net[0].in_features, projector.net[0].out_features)
        path = self.result_path()
        save_result(path, description=self.result_description, global_state=global_state, projector=projector,
                    projector_dims=dims, condensed=condensed, sites=sites, round_num=round_num, metrics=metrics)
        return path
