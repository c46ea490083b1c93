"""The FedSM super model on disk: global model, K personalised models, selector and site-index map in one file.

Written by the server (``FedSM_super_model.pt`` last, ``best_FedSM_super_model.pt`` best by the sites'
mean validation super-model Dice) as a plain dict of tensors, strings and numbers, so a downloaded file
loads with ``torch.load(weights_only=True)`` and runs no code. Layout::

    {"train_conf": {"medflare": describe(preset, overrides, kind="super_model")},
     "sites": [site names in selector-index order], "selector": {"name", "args"}, "global_class": bool,
     "global": state_dict, "person": {site: state_dict}, "select": state_dict,
     "lambda": float, "gamma": float (the job's, default of ``medflare evaluate``), "round": int,
     "metrics": {name: float}}
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from medflare import MedflareError
from medflare.common.checkpoint import describe_checkpoint, read_checkpoint
from medflare.common.payload import load_numpy_state
from medflare.fedsm.routing import SuperModelPredictor
from medflare.fedsm.selector import build_selector
from medflare.nets import build_model

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


@dataclass
class SuperModel:
    """A loaded super model: networks in eval mode, the site-index map and the file's description."""

    global_model: torch.nn.Module
    person_models: list[torch.nn.Module]
    selector: torch.nn.Module
    sites: list[str]
    global_class: bool
    description: dict[str, Any]
    info: dict[str, Any]

    def predictor(self, gamma: float) -> SuperModelPredictor:
        """Algorithm 2 at threshold ``gamma`` as an ``images -> logits`` callable that records its choices."""
        return SuperModelPredictor(self.global_model, self.person_models, self.selector, gamma, self.global_class)

    def to(self, device) -> "SuperModel":
        for m in (self.global_model, *self.person_models, self.selector):
            m.to(device)
        return self


def _build(spec: Mapping[str, Any], state: Mapping[str, torch.Tensor], what: str, selector: bool = False) -> torch.nn.Module:
    model = build_selector(spec) if selector else build_model(spec["name"], **spec.get("args", {}))
    load_numpy_state(model, state, who=what)
    return model.eval()


def is_super_model(data: Mapping[str, Any]) -> bool:
    """Whether a checkpoint dict read by :func:`read_checkpoint` is a FedSM super model."""
    return ((data.get("train_conf") or {}).get("medflare") or {}).get("kind") == "super_model"


def load_super_model(path: str | os.PathLike) -> SuperModel:
    """Rebuild every network of a saved super model; MedflareError names the file and what is wrong."""
    return super_model_from_checkpoint(read_checkpoint(path), path)


def super_model_from_checkpoint(data: Mapping[str, Any], path: str | os.PathLike) -> SuperModel:
    """:func:`load_super_model` on a dict already read by :func:`read_checkpoint` (``path`` names it in errors)."""
    if not is_super_model(data):
        raise MedflareError(f"model file '{path}' is not a FedSM super model (no 'super_model' description)")
    desc = describe_checkpoint(data, str(path))
    missing = [k for k in ("sites", "selector", "global", "person", "select") if k not in data]
    if missing:
        raise MedflareError(f"super model file '{path}' lacks {missing}")
    sites = list(data["sites"])
    absent = [s for s in sites if s not in data["person"]]
    if absent:
        raise MedflareError(f"super model file '{path}' has no personalised model for {absent}")
    spec = desc["model"]
    return SuperModel(
        global_model=_build(spec, data["global"], f"file '{path}' (global)"),
        person_models=[_build(spec, data["person"][s], f"file '{path}' (person {s})") for s in sites],
        selector=_build(data["selector"], data["select"], f"file '{path}' (selector)", selector=True),
        sites=sites,
        global_class=bool(data.get("global_class", False)),
        description=desc,
        info={"lambda": data.get("lambda"), "gamma": data.get("gamma"), "round": data.get("round"), "metrics": data.get("metrics", {})},
    )
