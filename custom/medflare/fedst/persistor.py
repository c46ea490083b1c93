"""The FedST server's persistor: the initial segmentation model (and join generator), and the saved style store /
join generator file.

A FLARE ``ModelPersistor``: the workflow loads the initial weights through it (``load_model``) and saves through
it (``save_model``) after every round; on FLARE's ``GLOBAL_BEST_MODEL_AVAILABLE`` (fired by
``IntimeModelSelector`` when the sites' mean validation Dice of the model sent this round is the best so far) it
writes the model the workflow published as ``GLOBAL_MODEL`` to the "best" file. Weights are flat dicts with
the payload prefixes of :mod:`.protocol` (``seg.``, ``gen.``, ``gen_<i>.``); the learnable's meta holds the
site list, the classes each generator was trained on, the image size and each store entry's upload round.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.model import ModelLearnable, ModelLearnableKey, make_model_learnable
from nvflare.app_common.abstract.model_persistor import ModelPersistor
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType

from medflare import ConfigError, MedflareError
from medflare.common.component import keep_args
from medflare.common.payload import flatten, state_to_numpy, unflatten
from medflare.common.persistence import model_from_preset
from medflare.common.results import describe, save_checkpoint
from medflare.fedst import protocol as P
from medflare.fedst.config import DiffusionConfig
from medflare.fedst.diffusion import build_style_generator, generator_args
from medflare.fedst.results import KIND_OF, check_compatible
from medflare.presets import get_preset

FILE_OF = {"separate": "FedST_style_store.pt", "join": "FedST_join_generator.pt"}
BEST_FILE_OF = {v: f"best_{f}" for v, f in FILE_OF.items()}

#: learnable meta keys
META_SITES, META_CLASSES, META_SIZE, META_VERSIONS, META_ROUND, META_METRICS = (
    "sites", "trained_classes", "image_size", "versions", "round", "metrics")


def fedst_generator_args(preset: str, overrides: Mapping[str, Any] | None, num_domains: int) -> dict[str, Any]:
    """The StyleGenerator arguments a preset implies (image channels and classes from its model and data)."""
    cfg = get_preset(preset, overrides)
    if "diffusion" not in cfg:
        raise ConfigError(f"preset '{preset}' has no 'diffusion' section; FedST needs one (e.g. preset 'fedst')")
    return generator_args(DiffusionConfig.from_preset(cfg), int(cfg["model"]["args"].get("in_channels", 1)), int(cfg["data"]["num_classes"]),
                          num_domains)


def fedst_description(preset: str, overrides: Mapping[str, Any] | None, variant: str) -> dict[str, Any]:
    """The ``train_conf["medflare"]`` entry of a FedST file (kind, preset, overrides, seg model, data, diffusion)."""
    return describe(preset, overrides, kind=KIND_OF[variant], diffusion=DiffusionConfig.from_preset(get_preset(preset, overrides)).as_dict())


def _tensors(params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(np.array(v, copy=True)) for k, v in params.items()}


def save_result(path: str | os.PathLike, *, description: Mapping[str, Any], sites: Sequence[str], generator_args: Mapping[str, Any],
                segmentation: Mapping[str, Any], generators: Mapping[str, Mapping[str, Any]] | None = None,
                generator_state: Mapping[str, Any] | None = None, trained_classes: Mapping[str, Sequence[int]] | None = None,
                image_size: Sequence[int] | None = None, versions: Mapping[str, int] | None = None, round_num: int = 0,
                metrics: Mapping[str, float] | None = None) -> None:
    """Write a style store (``generators``) or a join generator (``generator_state``) atomically."""
    data: dict[str, Any] = {
        "train_conf": {"medflare": dict(description)},
        "sites": list(sites),
        "generator": dict(generator_args),
        "trained_classes": {s: [int(c) for c in v] for s, v in (trained_classes or {}).items()},
        "image_size": [int(v) for v in image_size] if image_size else None,
        "versions": {s: int(v) for s, v in (versions or {}).items()},
        "segmentation": _tensors(segmentation),
        "round": int(round_num),
        "metrics": {k: float(v) for k, v in (metrics or {}).items()},
    }
    if generators is not None:
        data["generators"] = {s: _tensors(p) for s, p in generators.items()}
    if generator_state is not None:
        data["generator_state"] = _tensors(generator_state)
    save_checkpoint(data, path)


class FedSTPersistor(ModelPersistor):
    """Initial and saved weights of a FedST job.

    Args:
        variant: "separate" (style store) or "join" (one domain-conditioned generator). Default "join".
        preset / overrides / seed: as the sites' executors (the segmentation network and the generator
            architecture come from the preset). Defaults "fedst", none, 0.
        init_file: a FedST file of the same variant and generator architecture to start from (pretrained
            generators; FedST-separate sites already in its store skip the generator warm-up). "" = none.
        file_name / best_file_name: files written into the server's app folder. "" = ``FedST_style_store.pt`` /
            ``FedST_join_generator.pt`` and their ``best_`` versions.
    """

    def __init__(self, variant: str = "join", preset: str = "fedst", overrides: Mapping[str, Any] | None = None, seed: int = 0,
                 init_file: str = "", file_name: str = "", best_file_name: str = ""):
        super().__init__()
        if variant not in P.VARIANTS:
            raise ConfigError(f"FedSTPersistor: 'variant' must be one of {list(P.VARIANTS)}, got {variant!r}")
        keep_args(self, variant=variant, preset=preset, overrides=overrides or {}, seed=seed, init_file=init_file,
                  file_name=file_name, best_file_name=best_file_name)
        self.description = fedst_description(preset, overrides, variant)
        self.num_classes = int(get_preset(preset, overrides)["data"]["num_classes"])
        self._dir = ""

    @property
    def result_file(self) -> str:
        """The name of the file this persistor saves the job's result to (in the server's app folder)."""
        return self.file_name or FILE_OF[self.variant]

    def _path(self, best: bool) -> str:
        name = (self.best_file_name or BEST_FILE_OF[self.variant]) if best else self.result_file
        return os.path.join(self._dir, name)

    def load_model(self, fl_ctx: FLContext) -> ModelLearnable:
        self._dir = fl_ctx.get_prop(FLContextKey.APP_ROOT) or os.getcwd()
        sites = sorted(c.name for c in fl_ctx.get_engine().get_clients())
        join = self.variant == "join"
        args = fedst_generator_args(self.preset, self.overrides, len(sites) if join else 0)
        models: dict[str, dict[str, np.ndarray]] = {P.SEG: state_to_numpy(model_from_preset(self.preset, self.overrides, self.seed))}
        meta: dict[str, Any] = {META_SITES: sites, META_CLASSES: {}, META_SIZE: None, META_VERSIONS: {}, META_ROUND: 0, META_METRICS: {}}
        start = check_compatible(self.init_file, self.variant, self.preset, args, self.num_classes) if self.init_file else None
        if join:
            torch.manual_seed(self.seed)
            models[P.GEN] = state_to_numpy(build_style_generator(args))
            if start is not None:
                if list(start.sites) != sites:
                    raise MedflareError(f"init_file '{self.init_file}' was trained for sites {start.sites}; this job has {sites} "
                                        "(the domain vector has one entry per site)")
                models[P.GEN] = state_to_numpy(start.networks["generator"])
                meta[META_CLASSES] = dict(start.trained_classes)
        elif start is not None:
            for i, site in enumerate(sites):
                if site in start.domains:
                    models[P.store_prefix(i)] = state_to_numpy(start.generator_for(site)[0])
                    meta[META_CLASSES][site] = start.trained_classes.get(site, [])
                    meta[META_VERSIONS][site] = -1  # from the init file
            self.log_info(fl_ctx, f"style store starts with {sorted(meta[META_VERSIONS])} from '{self.init_file}'")
        if start is not None:
            meta[META_SIZE] = start.image_size
        return make_model_learnable(weights=flatten(models), meta_props=meta)

    def save_model(self, learnable: ModelLearnable, fl_ctx: FLContext) -> None:
        self._write(learnable, self._path(best=False))

    def _write(self, learnable: ModelLearnable, path: str) -> None:
        weights, meta = learnable[ModelLearnableKey.WEIGHTS], learnable[ModelLearnableKey.META]
        sites = list(meta[META_SITES])
        parts = unflatten(weights)
        join = self.variant == "join"
        store = None if join else {s: parts[P.store_prefix(i)] for i, s in enumerate(sites) if P.store_prefix(i) in parts}
        save_result(
            path, description=self.description, sites=sites,
            generator_args=fedst_generator_args(self.preset, self.overrides, len(sites) if join else 0),
            segmentation=parts[P.SEG], generators=store, generator_state=parts.get(P.GEN) if join else None,
            trained_classes=meta.get(META_CLASSES), image_size=meta.get(META_SIZE), versions=meta.get(META_VERSIONS),
            round_num=int(meta.get(META_ROUND, 0)), metrics=meta.get(META_METRICS),
        )

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type == AppEventType.GLOBAL_BEST_MODEL_AVAILABLE:
            learnable = fl_ctx.get_prop(AppConstants.GLOBAL_MODEL)
            if learnable and self._dir:
                self._write(learnable, self._path(best=True))
                self.log_info(fl_ctx, f"new best model -> {self._path(best=True)}")
