"""Recipe of jobs/fedsm: the FedSM controller, its super-model persistor, FLARE's best-model selector, the executor.

    from medflare.recipes import FedSMRecipe
    from nvflare.recipe import SimEnv
    FedSMRecipe(preset="seg_synthetic_tiny", num_rounds=3).execute(SimEnv(num_clients=3))
"""

from __future__ import annotations

from typing import Any, Mapping

from nvflare.app_common.widgets.intime_model_selector import IntimeModelSelector

from medflare.common.recipe import JobRecipe
from medflare.fedsm import protocol as P
from medflare.fedsm.controller import FedSMController
from medflare.fedsm.executor import FedSMExecutor
from medflare.fedsm.persistor import SuperModelPersistor
from medflare.presets import get_preset


class FedSMRecipe(JobRecipe):
    """FedSM (Xu et al. 2022). Args: preset, overrides (FedSM's settings among them: the ``fedsm`` section,
    :class:`~medflare.fedsm.config.FedSMConfig`, e.g. ``{"fedsm": {"gamma": 0.1, "extra_rounds": 2}}``), num_rounds,
    seed, device, min_clients, and the other :class:`~medflare.fedsm.controller.FedSMController` arguments
    (resume_round, min_responses, task_timeout) as keyword arguments. Defaults: preset ``fedsm_synthetic`` (seg_synthetic
    with one local epoch a round) and 20 rounds, the paper's one-epoch rounds at the baselines' local epochs
    (jobs/fedsm/README.md, "Local schedule").

    Server components: ``persistor`` (:class:`~medflare.fedsm.persistor.SuperModelPersistor`) and
    ``model_selector``, FLARE's ``IntimeModelSelector`` on the sites' mean ``own_or_global_<key metric>``
    (unweighted: each site counts once, like the paper's client average)."""

    def __init__(
        self,
        preset: str = "fedsm_synthetic",
        overrides: Mapping[str, Any] | None = None,
        num_rounds: int = 20,
        seed: int = 0,
        device: str = "auto",
        min_clients: int = 2,
        **controller_args: Any,
    ):
        key = get_preset(preset, overrides)["eval"]["key_metric"]
        persistor = SuperModelPersistor(preset=preset, overrides=overrides, seed=seed)
        super().__init__(
            "fedsm",
            workflow=FedSMController(num_rounds=num_rounds, preset=preset, overrides=overrides, seed=seed,
                                     persistor_id="persistor", **controller_args),
            workflow_id="fedsm",
            executor=FedSMExecutor(preset=preset, overrides=overrides, device=device, seed=seed),
            tasks=list(P.TASKS),
            manifest=P.manifest(),
            preset=preset,
            overrides=overrides,
            scope="standard",
            result_file=persistor.global_model_file_name,
            server_components={
                "persistor": persistor,
                "model_selector": IntimeModelSelector(key_metric=f"own_or_global_{key}"),
            },
            min_clients=min_clients,
        )
