"""Recipe of jobs/fedsm: the FedSM controller and executor with the shared medflare wiring.

    from medflare.recipes import FedSMRecipe
    from nvflare.recipe import SimEnv
    FedSMRecipe(preset="seg_synthetic_tiny", num_rounds=3).execute(SimEnv(num_clients=3))
"""

from __future__ import annotations

from typing import Any, Mapping

from medflare.common.recipe import JobRecipe
from medflare.fedsm.controller import FedSMController
from medflare.fedsm.executor import FedSMExecutor


class FedSMRecipe(JobRecipe):
    """FedSM (Xu et al. 2022). Args: preset, overrides, num_rounds, seed, device, min_clients, and every
    :class:`~medflare.fedsm.controller.FedSMController` argument (softpull_lambda, extra_rounds, gamma,
    selector, calibration, min_responses, task_timeout) as keyword arguments; ``stats_noise`` goes to the sites."""

    def __init__(
        self,
        preset: str = "seg_synthetic",
        overrides: Mapping[str, Any] | None = None,
        num_rounds: int = 10,
        seed: int = 0,
        device: str = "auto",
        min_clients: int = 2,
        stats_noise: float = 0.0,
        **controller_args: Any,
    ):
        super().__init__(
            "fedsm",
            workflow=FedSMController(num_rounds=num_rounds, preset=preset, overrides=overrides, seed=seed, **controller_args),
            workflow_id="fedsm",
            executor=FedSMExecutor(preset=preset, overrides=overrides, device=device, seed=seed, stats_noise=stats_noise),
            tasks=["train", "validate"],
            min_clients=min_clients,
        )
