"""The FedSM super model on disk: global model, K personalised models, selector and site-index map in one file.

Written by the server (``FedSM_super_model.pt`` last, ``best_FedSM_super_model.pt`` best by the sites'
mean validation super-model Dice) as a plain dict of tensors, strings and numbers, so a downloaded file
loads with ``torch.load(weights_only=True)`` and runs no code. Layout::

    {"train_conf": {"medflare": describe(preset, overrides, kind="fedsm_super_model")},
     "sites": [site names in selector-index order], "selector": {"name", "args"}, "global_class": bool,
     "global": state_dict, "person": {site: state_dict}, "select": state_dict,
     "lambda": float, "gamma": float (the job's, default of ``medflare evaluate``), "round": int,
     "metrics": {name: float}}
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from medflare import ConfigError, ResultFileError
from medflare.common.results import Result, description_of, load_result, network_from
from medflare.fedsm.routing import SuperModelPredictor
from medflare.fedsm.selector import build_selector

SUPER_MODEL_FILE = "FedSM_super_model.pt"
BEST_SUPER_MODEL_FILE = "best_FedSM_super_model.pt"


def _tensors(params: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(np.array(v, copy=True)) for k, v in params.items()}


def save_super_model(
    path: str | os.PathLike,
    *,
    description: Mapping[str, Any],
    sites: Sequence[str],
    selector_spec: Mapping[str, Any],
    global_class: bool,
    global_params: Mapping[str, np.ndarray],
    person_params: Mapping[str, Mapping[str, np.ndarray]],
    selector_params: Mapping[str, np.ndarray],
    lam: float,
    round_num: int,
    gamma: float = 0.9,
    metrics: Mapping[str, float] | None = None,
) -> None:
    """Write the super model atomically (a reader never sees half a file)."""
    data = {
        "train_conf": {"medflare": dict(description)},
        "sites": list(sites),
        "selector": {"name": selector_spec["name"], "args": dict(selector_spec.get("args", {}))},
        "global_class": bool(global_class),
        "global": _tensors(global_params),
        "person": {site: _tensors(person_params[site]) for site in sites},
        "select": _tensors(selector_params),
        "lambda": float(lam),
        "gamma": float(gamma),
        "round": int(round_num),
        "metrics": {k: float(v) for k, v in (metrics or {}).items()},
    }
    tmp = f"{path}.tmp"
    torch.save(data, tmp)
    os.replace(tmp, path)


class SuperModel(Result):
    """A loaded super model: global, personalised (site-index order) and selector networks, the site map."""

    def __init__(self, path, description, networks, sites: Sequence[str], global_class: bool, info: Mapping[str, Any]):
        super().__init__(path, description, networks, info)
        self.sites = list(sites)
        self.global_class = bool(global_class)

    @property
    def global_model(self) -> torch.nn.Module:
        return self.networks["global"]

    @property
    def person_models(self) -> list[torch.nn.Module]:
        return [self.networks[f"person_{i}"] for i in range(len(self.sites))]

    @property
    def selector(self) -> torch.nn.Module:
        return self.networks["select"]

    def predictor(self, gamma: float) -> SuperModelPredictor:
        """Algorithm 2 at threshold ``gamma`` as an ``images -> logits`` callable that records its choices."""
        return SuperModelPredictor(self.global_model, self.person_models, self.selector, gamma, self.global_class, self.sites)

    def predictors(self, options: Mapping[str, Any]) -> list[tuple[str, SuperModelPredictor]]:
        """One predictor per gamma of ``options["gamma"]`` (a list), default the job's gamma."""
        gammas = options.get("gamma") or [self.info.get("gamma", 0.9)]
        for g in gammas:
            if not 0 <= g <= 1:
                raise ConfigError(f"gamma values must lie in [0, 1], got {list(gammas)}")
        return [(f"super model, gamma {g}", self.predictor(g)) for g in gammas]

    def parts(self) -> dict[str, str]:
        names = {"global": "global", "select": "selector", **{f"person_{i}": f"personalised ({s})" for i, s in enumerate(self.sites)}}
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
    missing = [k for k in ("sites", "selector", "global", "person", "select") if k not in data]
    if missing:
        raise ResultFileError(f"super model file '{path}' lacks {missing}")
    sites = list(data["sites"])
    absent = [s for s in sites if s not in data["person"]]
    if absent:
        raise ResultFileError(f"super model file '{path}' has no personalised model for {absent}")
    spec = desc["model"]
    networks = {"global": network_from(spec, data["global"], f"file '{path}' (global)")}
    networks.update({f"person_{i}": network_from(spec, data["person"][s], f"file '{path}' (person {s})") for i, s in enumerate(sites)})
    networks["select"] = network_from(data["selector"], data["select"], f"file '{path}' (selector)", build=build_selector)
    info = {"lambda": data.get("lambda"), "gamma": data.get("gamma"), "round": data.get("round"), "metrics": data.get("metrics", {})}
    return SuperModel(path, desc, networks, sites, bool(data.get("global_class", False)), info)
