"""The FedSM super model as one network and one file: global model, K personalised models and the selector.

:func:`super_model_network` builds the container (an ``nn.ModuleDict`` with submodules ``global``,
``person_<i>`` in selector order, ``select``; names from :mod:`.protocol`, so its flat state has the
payload's keys). The server's persistor (:class:`medflare.fedsm.persistor.SuperModelPersistor`, a FLARE
``PTFileModelPersistor``) saves it in FLARE's PT layout, which the registry reads back (kind
``fedsm_super_model``, version 2)::

    {"model": {"global.<param>": tensor, "person_0.<param>": ..., "select.<param or buffer>": ...},
     "train_conf": {"medflare": describe(preset, overrides, kind="fedsm_super_model", version=2,
                    sites=[site names in selector order], selector={"name", "args"},
                    softpull_lambda=float, gamma=float)},
     "meta_props": {"round": completed rounds the models reflect, ...}}

``FedSM_super_model.pt`` is written after every round, ``best_FedSM_super_model.pt`` when FLARE's
``IntimeModelSelector`` reports a new best (see :mod:`.controller`). Files load with
``torch.load(weights_only=True)`` and run no code. Version 1 files (the fixed random-feature "style
selector" of the first FedSM pass) are refused with a message: retrain.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from medflare import ConfigError, ResultFileError
from medflare.common.results import Result, describe, description_of, load_result, network_from, save_checkpoint
from medflare.fedsm import protocol as P
from medflare.fedsm.routing import SuperModelPredictor
from medflare.fedsm.selector import build_selector
from medflare.nets import build_from_spec

SUPER_MODEL_FILE = "FedSM_super_model.pt"
BEST_SUPER_MODEL_FILE = "best_FedSM_super_model.pt"
KIND = "fedsm_super_model"
VERSION = 2
DEFAULT_GAMMA = 0.05


def super_model_network(model_spec: Mapping[str, Any], sites: Sequence[str], selector_spec: Mapping[str, Any],
                        initial: nn.Module | None = None) -> nn.ModuleDict:
    """The container: ``initial`` (default a fresh network of ``model_spec``) as ``global``, copied as each
    ``person_<i>``, and the selector.

    Every personalised model starts as the global model (as in the reference); the selector's stem is a copy
    of the global model's encoder and it has no site Gaussians yet (every case goes to the global model).
    """
    net = initial if initial is not None else build_from_spec(model_spec)
    parts: dict[str, nn.Module] = {P.GLOBAL: net}
    parts.update({P.person_key(i): copy.deepcopy(net) for i in range(len(sites))})
    select = build_selector(selector_spec)
    select.set_stem(net)
    parts[P.SELECT] = select
    return nn.ModuleDict(parts)


def super_model_description(preset: str, overrides: Mapping[str, Any] | None, sites: Sequence[str], selector_spec: Mapping[str, Any],
                            softpull_lambda: float, gamma: float) -> dict[str, Any]:
    """``train_conf["medflare"]`` of a super-model file: what the loader needs to rebuild the container."""
    return describe(preset, overrides, kind=KIND, version=VERSION, sites=list(sites), selector=dict(selector_spec),
                    softpull_lambda=float(softpull_lambda), gamma=float(gamma))


def save_super_model(path: str | os.PathLike, network: nn.ModuleDict, description: Mapping[str, Any], meta: Mapping[str, Any] | None = None) -> None:
    """Write ``network`` in the persistor's layout (the server saves through FLARE's persistor; tools and tests use this)."""
    data = {"model": {k: v.detach().cpu() for k, v in network.state_dict().items()},
            "train_conf": {"medflare": dict(description)}, "meta_props": dict(meta or {})}
    save_checkpoint(data, path)


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

    def predictor(self, gamma: float) -> SuperModelPredictor:
        """Algorithm 2 at threshold ``gamma`` as an ``images -> logits`` callable that records its choices."""
        return SuperModelPredictor(self.global_model, self.person_models, self.selector, gamma, self.sites)

    def predictors(self, options: Mapping[str, Any]) -> list[tuple[str, SuperModelPredictor]]:
        """One predictor per gamma of ``options["gamma"]`` (a list), default the job's gamma."""
        gammas = options.get("gamma") or [self.info.get("gamma", DEFAULT_GAMMA)]
        for g in gammas:
            if not 0 <= g <= 1:
                raise ConfigError(f"gamma values must lie in [0, 1], got {list(gammas)}")
        return [(f"super model, gamma {g}", self.predictor(g)) for g in gammas]

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
