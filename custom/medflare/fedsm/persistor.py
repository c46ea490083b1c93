"""The FedSM super model's persistor: FLARE's ``PTFileModelPersistor`` over the super-model container network.

Named by the controller's ``persistor_id`` like any FLARE persistor, so FLARE's own machinery saves the
super model: ``FedSM_super_model.pt`` on every ``save_model`` and ``best_FedSM_super_model.pt`` when FLARE's
``IntimeModelSelector`` fires ``GLOBAL_BEST_MODEL_AVAILABLE`` (it then saves the ``GLOBAL_MODEL`` the
controller published: the super model the round's validation scores describe). The container's shape
depends on the sites and the selector, which are known only when the job runs; the controller passes them
with :meth:`SuperModelPersistor.configure` before it loads the initial model.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from nvflare.apis.fl_context import FLContext
from nvflare.app_opt.pt.file_model_persistor import PTFileModelPersistor

from medflare import ConfigError
from medflare.common.component import keep_args
from medflare.common.persistence import model_from_preset
from medflare.fedsm.supermodel import BEST_SUPER_MODEL_FILE, SUPER_MODEL_FILE, super_model_description, super_model_network
from medflare.presets import get_preset


class SuperModelPersistor(PTFileModelPersistor):
    """Persistor of the FedSM super model (see the module docstring).

    Args:
        preset: preset name of the segmentation network (must match the controller's and sites'). Default "seg_synthetic".
        overrides: overrides merged into the preset. Default none.
        seed: initialisation seed of the global model (every personalised model starts as a copy). Default 0.
    """

    def __init__(self, preset: str = "seg_synthetic", overrides: Mapping[str, Any] | None = None, seed: int = 0):
        super().__init__(global_model_file_name=SUPER_MODEL_FILE, best_global_model_file_name=BEST_SUPER_MODEL_FILE)
        keep_args(self, preset=preset, overrides=overrides or {}, seed=seed)
        self._layout: dict[str, Any] | None = None

    def configure(self, sites: Sequence[str], selector_spec: Mapping[str, Any], softpull_lambda: float, gamma: float) -> None:
        """The run's sites (selector order) and selector, and the values the saved file records; before :meth:`load_model`."""
        self._layout = {"sites": list(sites), "selector_spec": dict(selector_spec), "softpull_lambda": softpull_lambda, "gamma": gamma}

    def load_model(self, fl_ctx: FLContext):
        if self._layout is None:
            raise ConfigError("SuperModelPersistor: configure(sites, selector, ...) must come before load_model (FedSMController does it)")
        if self.model is None:
            spec = get_preset(self.preset, self.overrides)["model"]
            initial = model_from_preset(self.preset, self.overrides, self.seed)
            self.model = super_model_network(spec, self._layout["sites"], self._layout["selector_spec"], initial=initial)
        learnable = super().load_model(fl_ctx)
        # The file describes itself: the registry rebuilds the container from this entry.
        self.persistence_manager.train_conf = {"medflare": super_model_description(
            self.preset, self.overrides, self._layout["sites"], self._layout["selector_spec"], self._layout["softpull_lambda"], self._layout["gamma"])}
        return learnable
