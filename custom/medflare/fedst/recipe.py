"""Recipes of jobs/fedst_separate and jobs/fedst_join: the FedST workflow, its persistor and the three site executors.

    from medflare.recipes import FedSTJoinRecipe
    from nvflare.recipe import SimEnv
    FedSTJoinRecipe(preset="fedst_tiny").execute(SimEnv(num_clients=2))
    FedSTSeparateRecipe(preset="fedst_paper").export("jobs_paper")   # 384x384, 50 rounds, 1000 DDPM sampling steps

``num_rounds`` defaults to the preset's ``fedst.rounds``, so the paper's scale is a preset away; FedST's settings are the
preset's ``fedst`` and ``diffusion`` sections (:mod:`medflare.fedst.config`), set through ``overrides``.
"""

from __future__ import annotations

from typing import Any, Mapping

from medflare.common.recipe import JobRecipe
from medflare.fedst import protocol as P
from medflare.fedst.config import FedSTConfig
from medflare.fedst.controller import FedSTJoinController, FedSTSeparateController
from medflare.fedst.executor import GeneratorTrainingExecutor, SegmentationExecutor, StyleSamplingExecutor
from medflare.fedst.filters import GeneratorDiffDequantizer, GeneratorDiffQuantizer
from medflare.fedst.persistor import FedSTPersistor
from medflare.presets import get_preset


class _FedSTRecipe(JobRecipe):
    """A FedST job. Args: preset (default "fedst"), overrides (any key of the ``fedst`` and ``diffusion`` sections among
    them), num_rounds (None = the preset's ``fedst.rounds``), seed, device, min_clients, init_file (the persistor's),
    and the controller's other arguments (min_responses, task_timeout, task names) as keyword arguments."""

    job_name = ""
    variant = ""
    controller_cls: type = FedSTJoinController

    def __init__(
        self,
        preset: str = "fedst",
        overrides: Mapping[str, Any] | None = None,
        num_rounds: int | None = None,
        seed: int = 0,
        device: str = "auto",
        min_clients: int = 2,
        init_file: str = "",
        **controller_args: Any,
    ):
        rounds = num_rounds if num_rounds is not None else FedSTConfig.from_preset(get_preset(preset, overrides)).rounds
        join = self.variant == "join"
        site_args = dict(preset=preset, overrides=overrides, device=device, seed=seed)
        persistor = FedSTPersistor(variant=self.variant, preset=preset, overrides=overrides, seed=seed, init_file=init_file)
        super().__init__(
            self.job_name,
            workflow=self.controller_cls(num_rounds=rounds, preset=preset, overrides=overrides, seed=seed, **controller_args),
            workflow_id=self.job_name,
            executor=SegmentationExecutor(**site_args),
            tasks=[P.TRAIN, "validate"],
            manifest=P.manifest(join=self.variant == "join"),
            preset=preset,
            overrides=overrides,
            scope="standard",
            result_file=persistor.result_file,
            server_components={"persistor": persistor},
            min_clients=min_clients,
            more_executors=[(GeneratorTrainingExecutor(**site_args), [P.TRAIN_GENERATOR]), (StyleSamplingExecutor(**site_args), [P.SAMPLE])],
            wire_filters=[(GeneratorDiffQuantizer(preset, overrides), GeneratorDiffDequantizer(preset, overrides), [P.TRAIN_GENERATOR])]
            if join else (),  # diffusion.exchange_dtype "int8" / "int4"; pass-through otherwise
        )


class FedSTSeparateRecipe(_FedSTRecipe):
    """FedST-separate (Ma et al., AAAI 2024): per-site generators in a shared style store. Args: see :class:`_FedSTRecipe`."""

    job_name = "fedst_separate"
    variant = "separate"
    controller_cls = FedSTSeparateController


class FedSTJoinRecipe(_FedSTRecipe):
    """FedST-join (Ma et al., AAAI 2024): one federated generator with a domain vector. Args: see :class:`_FedSTRecipe`."""

    job_name = "fedst_join"
    variant = "join"
    controller_cls = FedSTJoinController
