"""The result kind FedSM saves (a ``medflare.result_kinds`` entry point), for ``medflare evaluate`` / ``predict`` / ``show``
(see :mod:`medflare.common.results`): the super model (:mod:`.supermodel`), kind ``fedsm_super_model``, version 2, written
by :class:`~medflare.fedsm.persistor.SuperModelPersistor` (the only writer) in FLARE's PT layout::

    {"model": {"global.<param>": tensor, "person_0.<param>": ..., "select.<param or buffer>": ...},
     "train_conf": {"medflare": describe(preset, overrides, kind="fedsm_super_model", version=2,
                    sites=[site names in selector order], selector={"name", "args"},
                    softpull_lambda=float, gamma=float or [float per site, selector order])},
     "meta_props": {"round": completed rounds the models reflect, ...}}

``FedSM_super_model.pt`` is written after every round, ``best_FedSM_super_model.pt`` when FLARE's
``IntimeModelSelector`` reports a new best (see :mod:`.controller`). Files load with
``torch.load(weights_only=True)`` and run no code. Version 1 files (the fixed random-feature "style
selector" of the first FedSM pass) are refused with a message: retrain.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from medflare import ConfigError, ResultFileError
from medflare.common.results import Result, ResultKind, describe, description_of, load_result, network_from
from medflare.fedsm import protocol as P
from medflare.fedsm.options import SUPER_MODEL_OPTIONS
from medflare.fedsm.routing import DEFAULT_GAMMA, Gamma, SuperModelPredictor, as_gamma, gamma_text
from medflare.fedsm.supermodel import super_model_network

KIND = "fedsm_super_model"
VERSION = 2


def super_model_description(preset: str, overrides: Mapping[str, Any] | None, sites: Sequence[str], selector_spec: Mapping[str, Any],
                            softpull_lambda: float, gamma: Gamma) -> dict[str, Any]:
    """``train_conf["medflare"]`` of a super-model file: what the loader needs to rebuild the container."""
    return describe(preset, overrides, kind=KIND, version=VERSION, sites=list(sites), selector=dict(selector_spec),
                    softpull_lambda=float(softpull_lambda), gamma=as_gamma(gamma))


class SuperModel(Result):
    """A loaded super model: global, personalised (site-index order) and selector networks, the site map."""

    def __init__(self, path, description, networks, sites: Sequence[str], info: Mapping[str, Any]):
        super().__init__(path, description, networks, info)
        self.sites = list(sites)

    @property
    def global_model(self) -> nn.Module:
        return self.networks[P.GLOBAL]

    @property
    def person_models(self) -> list[nn.Module]:
        return [self.networks[P.person_key(i)] for i in range(len(self.sites))]

    @property
    def selector(self) -> nn.Module:
        return self.networks[P.SELECT]

    def predictor(self, gamma: Gamma) -> SuperModelPredictor:
        """Algorithm 2 at threshold ``gamma`` (or one per site, selector order) as an ``images -> logits`` callable
        that records its choices."""
        return SuperModelPredictor(self.global_model, self.person_models, self.selector, gamma, self.sites)

    def predictors(self, options: Mapping[str, Any]) -> list[tuple[str, SuperModelPredictor]]:
        """One predictor per gamma of ``options["gamma"]`` (a list, each for every site), default the job's gamma
        (one per site where the run chose them so)."""
        if not options.get("gamma"):
            own = self.info.get("gamma", DEFAULT_GAMMA)
            return [(f"super model, {gamma_text(own, self.sites)}", self.predictor(own))]
        gammas = options["gamma"]
        for g in gammas:
            if not 0 <= g <= 1:
                raise ConfigError(f"gamma values must lie in [0, 1], got {list(gammas)}")
        return [(f"super model, gamma {g}", self.predictor(g)) for g in gammas]

    def compared_with(self) -> list[tuple[str, nn.Module]]:
        """The super model's global model alone (FedAvg's model of the same run), scored beside the super model."""
        return [("global model", self.global_model)]

    def parts(self) -> dict[str, str]:
        names = {P.GLOBAL: "global", P.SELECT: "selector",
                 **{P.person_key(i): f"personalised ({s})" for i, s in enumerate(self.sites)}}
        return {names[k]: v for k, v in super().parts().items()}


def load_super_model(path: str | os.PathLike) -> SuperModel:
    """Rebuild every network of a saved super model; MedflareError names the file and what is wrong."""
    result = load_result(path)
    if not isinstance(result, SuperModel):
        raise ResultFileError(f"result file '{path}' holds kind '{result.kind}', not a FedSM super model")
    return result


def super_model_from_checkpoint(data: Mapping[str, Any], path: Path) -> SuperModel:
    """The registry's loader for kind ``fedsm_super_model`` (``data`` read by :func:`read_checkpoint`)."""
    desc = description_of(data)
    if int(desc.get("version", 1)) < VERSION:
        raise ResultFileError(f"super model file '{path}' is version {desc.get('version', 1)} (random-feature selector of the "
                              f"first FedSM pass); this medflare reads version {VERSION}: retrain with jobs/fedsm")
    missing = [k for k in ("sites", "selector") if k not in desc] + ([] if isinstance(data.get("model"), Mapping) else ["model"])
    if missing:
        raise ResultFileError(f"super model file '{path}' lacks {missing}")
    sites = list(desc["sites"])
    state = {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in data["model"].items()}
    try:  # checked against the stored weights (shapes, NaN/Inf) before anything is allocated
        network = network_from(desc["model"], state, f"file '{path}'",
                               build=lambda spec: super_model_network(spec, sites, desc["selector"]))
    except ConfigError as e:
        raise ResultFileError(f"super model file '{path}': {e}") from e
    meta = data.get("meta_props") or {}
    info = {"lambda": desc.get("softpull_lambda"), "gamma": desc.get("gamma", DEFAULT_GAMMA), "round": meta.get("round"),
            "metrics": meta.get("metrics", {})}
    return SuperModel(path, desc, dict(network.items()), sites, info)


SUPER_MODEL = ResultKind(
    name=KIND,
    version=VERSION,
    summary="FedSM super model: global + per-site personalised models + model selector (Algorithm 2)",
    load=super_model_from_checkpoint,
    options=SUPER_MODEL_OPTIONS.options,
)
