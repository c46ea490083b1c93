"""Recipes of the baseline jobs (jobs/fedavg, jobs/fedprox, jobs/scaffold): FLARE's FedAvg / Scaffold workflows,
the preset's network as initial model, FLARE's IntimeModelSelector for the best model (the final model judged too:
one last round that only validates), our SupervisedExecutor.

The workflows (:mod:`medflare.baselines.controller`) run with ``ignore_result_error=True``: a site whose result failed
or was refused by the server's update guard (:mod:`medflare.common.result_guard`) is left out of that round's
average (weighted over the sites that answered) and asked again next round; the server log names it. A round that
no site answered (fewer than the workflow's ``min_responses``, default 1) ends the job with an error.

    from medflare.recipes import FedAvgRecipe
    from nvflare.recipe import SimEnv
    FedAvgRecipe(preset="seg_synthetic_tiny", num_rounds=3).execute(SimEnv(num_clients=2))
"""

from __future__ import annotations

from typing import Any, Mapping

from nvflare.app_common.widgets.intime_model_selector import IntimeModelSelector

from medflare import ConfigError
from medflare.baselines import protocol as P
from medflare.baselines.config import FedProxConfig
from medflare.baselines.controller import ResilientFedAvg, ResilientScaffold
from medflare.baselines.executor import SupervisedExecutor
from medflare.common.persistence import PresetModelPersistor
from medflare.common.recipe import TASK_CHECK_PERIOD, JobRecipe
from medflare.presets import get_preset


class _BaselineRecipe(JobRecipe):
    """A weight-averaging baseline: ``workflow_cls`` of FLARE with our persistor, best-model selector and executor."""

    job_name = ""
    workflow_cls: type = ResilientFedAvg
    sends_controls = False  # SCAFFOLD: the control variate's change leaves beside the update

    def __init__(
        self,
        preset: str = "seg_synthetic",
        overrides: Mapping[str, Any] | None = None,
        num_rounds: int = 10,
        num_clients: int = 4,
        seed: int = 0,
        device: str = "auto",
        min_clients: int = 2,
        **workflow_args: Any,
    ):
        cfg = get_preset(preset, overrides)
        workflow_args = {**self.algorithm_args(cfg), **workflow_args}
        key_metric = cfg["eval"]["key_metric"]
        # A site whose result failed (its own error, or refused by the server's update guard) is left out of the
        # round's weighted average instead of ending the job (FedAvg asks every sampled site, so FLARE's default
        # would end it at the first one); a round no site answered ends it (medflare.baselines.controller).
        workflow = self.workflow_cls(num_clients=num_clients, num_rounds=num_rounds, persistor_id="persistor",
                                     task_check_period=TASK_CHECK_PERIOD, key_metric=key_metric, **workflow_args)
        persistor = PresetModelPersistor(preset=preset, overrides=overrides, seed=seed)
        super().__init__(
            self.job_name,
            workflow=workflow,
            workflow_id=self.job_name,
            executor=SupervisedExecutor(preset=preset, overrides=overrides, device=device, seed=seed),
            tasks=[P.TASK_TRAIN, P.TASK_VALIDATE],
            manifest=P.manifest(scaffold=self.sends_controls),
            preset=preset,
            overrides=overrides,
            scope="standard",
            result_file=persistor.global_model_file_name,
            server_components={
                "persistor": persistor,
                # the best model by the sites' mean score, each site once (the client average): weighing by the count a
                # site reports would let a lying site pick the "best" round (the aggregation bounds counts, this does not)
                "model_selector": IntimeModelSelector(key_metric=key_metric, weigh_by_local_iter=False),
            },
            min_clients=min_clients,
        )

    def algorithm_args(self, cfg: Mapping[str, Any]) -> dict[str, Any]:
        """The workflow's arguments that come from the preset's algorithm section (FedAvg and SCAFFOLD have none: a
        ``fedprox`` section in their overrides is refused, not ignored)."""
        if "fedprox" in cfg:
            raise ConfigError(f"job '{self.job_name}': the overrides set the 'fedprox' section, FedProx's; run the fedprox job")
        return {}


class FedAvgRecipe(_BaselineRecipe):
    """FedAvg (McMahan et al. 2017) with FLARE's ``FedAvg`` workflow. Args: preset, overrides, num_rounds,
    num_clients (sites per round), seed, device, min_clients."""

    job_name = "fedavg"


class FedProxRecipe(_BaselineRecipe):
    """FedProx (Li et al. 2020): FLARE's ``FedAvg`` with ``fedprox_mu`` (the sites add FLARE's PTFedProxLoss).
    Args: those of :class:`FedAvgRecipe`; mu is the preset's ``fedprox.mu`` (default 0.01,
    :class:`~medflare.baselines.config.FedProxConfig`), set through ``overrides``."""

    job_name = "fedprox"

    def algorithm_args(self, cfg: Mapping[str, Any]) -> dict[str, Any]:
        """FLARE's ``fedprox_mu`` from the preset's ``fedprox.mu`` (the server sends it to the sites in each task)."""
        return {"fedprox_mu": FedProxConfig.from_preset(cfg).mu}


class ScaffoldRecipe(_BaselineRecipe):
    """SCAFFOLD (Karimireddy et al. 2020) with FLARE's ``Scaffold`` workflow (the sites use PTScaffoldHelper).
    Args: those of :class:`FedAvgRecipe`."""

    job_name = "scaffold"
    workflow_cls = ResilientScaffold
    sends_controls = True
