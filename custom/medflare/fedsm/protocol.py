"""What the FedSM server and sites exchange besides the weights: task-meta keys and the selector's Adam moments.

Weights travel in the DXO data (FULL out, WEIGHT_DIFF back, prefixes ``global.``, ``person.``,
``select.``; in FedSM-extra rounds ``person_<i>.`` for every site), where FLARE's privacy filters see
them. The selector's Adam moments are optimiser state, not weights: they travel in the DXO meta as full
values (a filter that perturbs weight diffs must not perturb them) and the server averages them.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

SITES = "fedsm_sites"  # [site names]; a site's selector label is its index here (Eq. 2)
SELECTOR = "fedsm_selector"  # {"name", "args"} of the selector network
GLOBAL_CLASS = "fedsm_global_class"  # selector column 0 is the global model (FedSM-extra)
PHASE = "fedsm_phase"  # "main" (Algorithm 1) | "extra" (selector only, Eq. 1 labels)
GAMMA = "fedsm_gamma"  # routing threshold for the super-model Dice reported each round
SELOPT = "fedsm_selopt"  # averaged selector Adam moments (server -> site) / the site's (site -> server)
TRAIN_SELECTOR = "fedsm_train_selector"  # False in FedSM-extra's main rounds (selector trained later)

PHASES = ("main", "extra")


def adam_moments(optimizer: torch.optim.Adam, model: torch.nn.Module) -> dict[str, np.ndarray]:
    """The Adam state of ``model``'s parameters as ``{"exp_avg.<name>": ..., "exp_avg_sq.<name>": ..., "step": ...}``.

    Empty before the first step.
    """
    out: dict[str, np.ndarray] = {}
    steps = []
    for name, p in model.named_parameters():
        state = optimizer.state.get(p)
        if not state:
            continue
        out[f"exp_avg.{name}"] = state["exp_avg"].detach().cpu().numpy().copy()
        out[f"exp_avg_sq.{name}"] = state["exp_avg_sq"].detach().cpu().numpy().copy()
        steps.append(float(state["step"]))
    if steps:
        out["step"] = np.asarray(max(steps), dtype=np.float64)
    return out


def load_adam_moments(optimizer: torch.optim.Adam, model: torch.nn.Module, moments: Mapping[str, np.ndarray]) -> None:
    """Replace ``model``'s Adam state with ``moments`` (as made by :func:`adam_moments`); empty = leave as is."""
    if not moments:
        return
    step = float(np.asarray(moments["step"]))
    for name, p in model.named_parameters():
        if f"exp_avg.{name}" not in moments:
            continue
        optimizer.state[p] = {
            "step": torch.tensor(step),
            "exp_avg": torch.as_tensor(np.asarray(moments[f"exp_avg.{name}"])).to(p.device, p.dtype).clone(),
            "exp_avg_sq": torch.as_tensor(np.asarray(moments[f"exp_avg_sq.{name}"])).to(p.device, p.dtype).clone(),
        }
