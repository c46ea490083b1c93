"""Recipe of jobs/fedvck: the FedVCK controller with its persistor, the FedVCK executor, the shared medflare wiring.

    from medflare.recipes import FedVCKRecipe
    from nvflare.recipe import SimEnv
    FedVCKRecipe(preset="fedvck_synthetic_tiny", num_rounds=3).execute(SimEnv(num_clients=10))
"""

from __future__ import annotations

from typing import Any, Mapping

from medflare.common.recipe import JobRecipe
from medflare.fedvck import protocol as P
from medflare.fedvck.controller import FedVCKController
from medflare.fedvck.executor import FedVCKExecutor
from medflare.fedvck.persistor import FedVCKPersistor


class FedVCKRecipe(JobRecipe):
    """FedVCK (Yan et al., AAAI 2025). Args: preset, overrides, num_rounds, seed, device (server and sites),
    min_clients, and every :class:`~medflare.fedvck.controller.FedVCKController` argument (images_per_class,
    min_responses, task_timeout, ...) as keyword arguments. The algorithm's settings are the preset's ``fedvck``
    section (change them with ``overrides={"fedvck": {...}}``)."""

    def __init__(
        self,
        preset: str = "fedvck_synthetic",
        overrides: Mapping[str, Any] | None = None,
        num_rounds: int = 10,
        seed: int = 0,
        device: str = "auto",
        min_clients: int = 2,
        **controller_args: Any,
    ):
        persistor = FedVCKPersistor(preset=preset, overrides=overrides, seed=seed)
        super().__init__(
            "fedvck",
            workflow=FedVCKController(num_rounds=num_rounds, preset=preset, overrides=overrides, seed=seed, device=device,
                                      persistor_id="persistor", **controller_args),
            workflow_id="fedvck",
            executor=FedVCKExecutor(preset=preset, overrides=overrides, device=device, seed=seed),
            tasks=[P.TASK_CONDENSE, P.TASK_VALIDATE],
            manifest=P.manifest(),
            preset=preset,
            overrides=overrides,
            scope="condensed",
            result_file=persistor.result_file_name,
            server_components={"persistor": persistor},
            min_clients=min_clients,
        )
