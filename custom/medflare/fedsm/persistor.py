"""The FedSM super model's persistor: FLARE's ``PTFileModelPersistor`` over the super-model container network.

Named by the controller's ``persistor_id`` like any FLARE persistor, so FLARE's own machinery saves the
super model: ``FedSM_super_model.pt`` on every ``save_model`` and ``best_FedSM_super_model.pt`` when FLARE's
``IntimeModelSelector`` fires ``GLOBAL_BEST_MODEL_AVAILABLE`` (it then saves the ``GLOBAL_MODEL`` the
controller published: the super model the round's validation scores describe). The container's shape
depends on the sites and the selector, which are known only when the job runs; the controller passes them
with :meth:`SuperModelPersistor.configure` before it loads the initial model.

Resuming: FLARE 2.9 cannot resume a running job after a server restart (provisioning/README.md §10), so a
FedSM run goes on by resubmission: ``source_ckpt_file_full_name`` names a saved super model (this job's
``FedSM_super_model.pt``) as the initial model and the controller's ``resume_round`` the next round. The file
is read weights-only and must describe the same sites (in order) and selector as the new run: a different
federation would route images to the wrong site's model, so it is a ConfigError naming the file.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from nvflare.apis.fl_context import FLContext
from nvflare.app_opt.pt.file_model_persistor import PTFileModelPersistor

from medflare import ConfigError
from medflare.common.component import keep_args
from medflare.common.payload import load_numpy_state
from medflare.common.persistence import model_from_preset
from medflare.common.results import read_checkpoint, save_checkpoint
from medflare.fedsm.results import KIND, VERSION, super_model_description
from medflare.fedsm.routing import as_gamma
from medflare.fedsm.supermodel import super_model_network
from medflare.presets import get_preset

SUPER_MODEL_FILE = "FedSM_super_model.pt"
BEST_SUPER_MODEL_FILE = "best_FedSM_super_model.pt"


def save_super_model(path: str | os.PathLike, network: nn.ModuleDict, description: Mapping[str, Any], meta: Mapping[str, Any] | None = None) -> None:
    """Write ``network`` in the persistor's layout (the server saves through FLARE's persistor; tools and tests use this)."""
    data = {"model": {k: v.detach().cpu() for k, v in network.state_dict().items()},
            "train_conf": {"medflare": dict(description)}, "meta_props": dict(meta or {})}
    save_checkpoint(data, path)


class SuperModelPersistor(PTFileModelPersistor):
    """Persistor of the FedSM super model (see the module docstring).

    Args:
        preset: preset name of the segmentation network (must match the controller's and sites'; checked at START_RUN). Default "seg_synthetic".
        overrides: overrides merged into the preset. Default none.
        seed: initialisation seed of the global model (every personalised model starts as a copy). Default 0.
        source_ckpt_file_full_name: a saved super model (absolute path on the server) to start from instead of
            the preset's initial network, to resume a run by resubmission (module docstring). Default none.
    """

    def __init__(self, preset: str = "seg_synthetic", overrides: Mapping[str, Any] | None = None, seed: int = 0,
                 source_ckpt_file_full_name: str | None = None):
        if source_ckpt_file_full_name is not None and not os.path.isabs(str(source_ckpt_file_full_name)):
            raise ConfigError(f"SuperModelPersistor: 'source_ckpt_file_full_name' must be an absolute path on the server, "
                              f"got {source_ckpt_file_full_name!r}")
        super().__init__(global_model_file_name=SUPER_MODEL_FILE, best_global_model_file_name=BEST_SUPER_MODEL_FILE,
                         source_ckpt_file_full_name=source_ckpt_file_full_name)
        keep_args(self, preset=preset, overrides=overrides or {}, seed=seed, source_ckpt_file_full_name=source_ckpt_file_full_name)
        self._layout: dict[str, Any] | None = None

    def configure(self, sites: Sequence[str], selector_spec: Mapping[str, Any], softpull_lambda: float, gamma: float) -> None:
        """The run's sites (selector order) and selector, and the values the saved file records; before :meth:`load_model`."""
        self._layout = {"sites": list(sites), "selector_spec": dict(selector_spec), "softpull_lambda": softpull_lambda, "gamma": gamma}

    def record_gamma(self, gamma: float | Sequence[float]) -> None:
        """The run's gamma as chosen at the end of training (:meth:`FedSMController._choose_gamma`; one per site in
        selector order, or one for all): every file saved from now on records it, and a best file saved before is
        rewritten to record it (its weights unchanged)."""
        self._layout["gamma"] = as_gamma(gamma)
        self.persistence_manager.train_conf = self._train_conf()
        best = os.path.join(self.log_dir, self.best_global_model_file_name)
        if os.path.isfile(best):
            save_checkpoint({**read_checkpoint(best), "train_conf": self._train_conf()}, best)

    def _train_conf(self) -> dict[str, Any]:
        """What a saved file records besides the weights: the description the registry rebuilds the container from."""
        layout = self._layout
        return {"medflare": super_model_description(self.preset, self.overrides, layout["sites"], layout["selector_spec"],
                                                    layout["softpull_lambda"], layout["gamma"])}

    def load_model(self, fl_ctx: FLContext):
        if self._layout is None:
            raise ConfigError("SuperModelPersistor: configure(sites, selector, ...) must come before load_model (FedSMController does it)")
        if self.model is None:
            spec = get_preset(self.preset, self.overrides)["model"]
            initial = model_from_preset(self.preset, self.overrides, self.seed)
            self.model = super_model_network(spec, self._layout["sites"], self._layout["selector_spec"], initial=initial)
            if self.source_ckpt_file_full_name:
                self._check_resume_file()  # FLARE's loader below then reads the weights from it
        learnable = super().load_model(fl_ctx)
        self.persistence_manager.train_conf = self._train_conf()  # the file describes itself
        return learnable

    def _check_resume_file(self) -> None:
        """The saved super model is this run's: same kind, sites (in order), selector and container keys/shapes."""
        data = read_checkpoint(self.source_ckpt_file_full_name)
        desc = (data.get("train_conf") or {}).get("medflare") or {}
        where = f"SuperModelPersistor: source_ckpt_file_full_name '{self.source_ckpt_file_full_name}'"
        if desc.get("kind") != KIND or desc.get("version") != VERSION:
            raise ConfigError(f"{where} is not a FedSM super model of version {VERSION} "
                              f"(kind {desc.get('kind')!r}, version {desc.get('version')!r})")
        if list(desc.get("sites", [])) != self._layout["sites"]:
            raise ConfigError(f"{where} was trained with sites {desc.get('sites')}, this run has {self._layout['sites']}")
        if json.dumps(desc.get("selector"), sort_keys=True) != json.dumps(self._layout["selector_spec"], sort_keys=True):
            raise ConfigError(f"{where} holds another selector than this run's (FedSM-extra or selector settings differ)")
        weights = {k: v.cpu().numpy() if torch.is_tensor(v) else np.asarray(v) for k, v in dict(data.get("model") or {}).items()}
        load_numpy_state(self.model, weights, who=where)
