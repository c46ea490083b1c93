"""FedProx and SCAFFOLD as hooks on the shared training loop, built on FLARE's own helpers.

FedProx (Li et al. 2020) adds mu/2 * ||w - w_global||^2 to the local loss (``PTFedProxLoss``); SCAFFOLD
(Karimireddy et al. 2020) corrects every local step by -lr * (c - c_i) and updates c_i from the local
progress (``PTScaffoldHelper``, option II of the paper). Which one a round uses is decided by the
server: FedAvg(fedprox_mu=...) puts ``fedprox_mu`` in the task meta, the Scaffold workflow puts the
global controls there, so one client executor serves the three baseline jobs.

Deviation: SCAFFOLD is derived for SGD; with the Adam optimiser of the segmentation presets the
control estimate (w_global - w_local) / (K * lr) still measures the client drift per step, which is how
NVFlare's own SCAFFOLD examples use it. Use ``train.optimizer: "sgd"`` for the textbook setting.
"""

from __future__ import annotations

import copy
from typing import Callable, Mapping

import numpy as np
import torch
from nvflare.app_opt.pt.fedproxloss import PTFedProxLoss
from nvflare.app_opt.pt.scaffold import PTScaffoldHelper


def fedprox_term(global_model: torch.nn.Module, mu: float) -> Callable[[torch.nn.Module], torch.Tensor]:
    """``extra_loss`` hook: mu/2 * ||w - w_global||^2 against a frozen copy of the received global model."""
    frozen = copy.deepcopy(global_model).eval()
    for p in frozen.parameters():
        p.requires_grad_(False)
    prox = PTFedProxLoss(mu=mu)
    return lambda model: prox(model, frozen)


class ScaffoldState:
    """A site's SCAFFOLD control variate c_i, kept across rounds (the executor must be stateful: -t == -n)."""

    def __init__(self, model: torch.nn.Module):
        self.helper = PTScaffoldHelper()
        self.helper.init(model)
        self._round: tuple | None = None

    def begin_round(self, model: torch.nn.Module, global_controls: Mapping[str, np.ndarray], lr: float) -> Callable:
        """Load the server's c, snapshot w_global and return the ``after_step`` hook for this round."""
        self.helper.load_global_controls(global_controls)
        c_global, c_local = self.helper.get_params()
        self._round = (copy.deepcopy(model), c_global, c_local, lr)
        return lambda m: self.helper.model_update(m, lr, c_global, c_local)

    def correction_norm(self) -> float:
        """||c - c_i|| of the current round: how hard every local step is pulled (0 in round 0)."""
        _, c_global, c_local, _ = self._round
        return float(sum(((c_global[k] - c_local[k]).double() ** 2).sum() for k in c_global) ** 0.5)

    def end_round(self, model: torch.nn.Module) -> dict[str, np.ndarray]:
        """Update c_i from this round's progress and return the control delta the server aggregates."""
        global_model, c_global, c_local, lr = self._round
        self.helper.terms_update(model, lr, c_global, c_local, global_model)
        self._round = None
        return self.helper.get_delta_controls()
