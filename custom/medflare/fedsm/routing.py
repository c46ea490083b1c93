"""FedSM inference (Algorithm 2): the model selector routes each image to a personalised or the global model.

Plain torch, no FLARE: used by the FedSM client to score the super model every round, by
``medflare evaluate`` on a saved super model and by the unseen-site sweep.
"""

from __future__ import annotations

from typing import Sequence

import torch

from medflare import MedflareError

#: Routing result meaning "the global model" (personalised models are 0..K-1).
GLOBAL = -1


def route(probs: torch.Tensor, gamma: float, global_class: bool = False) -> torch.Tensor:
    """Which model each case goes to: (B, C) selector probabilities -> (B,) long, GLOBAL or a site index.

    Algorithm 2: if ``max(probs) > gamma`` the personalised model of the argmax site, else the global
    model. With ``global_class`` (the FedSM-extra selector, trained by Eq. 1 over {global, sites}) column
    0 is the global model and column k+1 site k; the argmax picks directly and ``gamma`` still applies
    (0 = pure argmax, as the paper uses FedSM-extra).
    """
    if probs.ndim != 2:
        raise MedflareError(f"route: selector probabilities must be (B, C), got shape {tuple(probs.shape)}")
    conf, arg = probs.max(dim=1)
    choice = arg - 1 if global_class else arg.clone()
    choice[conf <= gamma] = GLOBAL
    return choice


class SuperModelPredictor:
    """Callable ``images -> logits`` of the FedSM super model; remembers which model each case used.

    Args:
        global_model: the FedAvg global segmentation network.
        person_models: the K personalised networks in site-index order.
        selector: the model selector; K outputs (FedSM) or K + 1 with ``global_class`` (FedSM-extra).
        gamma: confidence threshold of Algorithm 2 (evaluation only). Default 0.9, the reference's.
        global_class: the selector's column 0 is the global model (FedSM-extra). Default False.
        sites: names of the personalised models' sites, for :meth:`report`. Default model_0..model_{K-1}.

    ``choices`` collects the routing of every case seen since the last :meth:`reset` (GLOBAL or site index).
    """

    def __init__(
        self,
        global_model: torch.nn.Module,
        person_models: Sequence[torch.nn.Module],
        selector: torch.nn.Module,
        gamma: float = 0.9,
        global_class: bool = False,
        sites: Sequence[str] = (),
    ):
        if not person_models:
            raise MedflareError("SuperModelPredictor: 'person_models' is empty")
        self.global_model = global_model
        self.person_models = list(person_models)
        self.selector = selector
        self.gamma = float(gamma)
        self.global_class = bool(global_class)
        self.sites = list(sites) or [f"model_{i}" for i in range(len(self.person_models))]
        self.choices: list[int] = []

    def reset(self) -> None:
        self.choices = []

    def report(self) -> dict[str, float]:
        """Fraction of the cases seen since :meth:`reset` routed to each model (paper Table 5 layout)."""
        return selection_frequency(self.choices, self.sites)

    def models(self) -> list[torch.nn.Module]:
        return [self.global_model, *self.person_models, self.selector]

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C_in, H, W) -> (B, num_classes, H, W) logits, each case from the model the selector chose."""
        for m in self.models():
            m.eval()
        choice = route(torch.softmax(self.selector(images), dim=1), self.gamma, self.global_class)
        out = None
        for idx in choice.unique().tolist():
            mask = choice == idx
            net = self.global_model if idx == GLOBAL else self.person_models[idx]
            logits = net(images[mask])
            if out is None:
                out = logits.new_zeros((images.shape[0], *logits.shape[1:]))
            out[mask] = logits
        self.choices.extend(choice.tolist())
        return out


def selection_frequency(choices: Sequence[int], sites: Sequence[str]) -> dict[str, float]:
    """Fraction of cases routed to each model (paper Table 5 layout): ``{"GM": f, site: f, ...}``."""
    n = max(len(choices), 1)
    freq = {"GM": sum(1 for c in choices if c == GLOBAL) / n}
    for i, site in enumerate(sites):
        freq[site] = sum(1 for c in choices if c == i) / n
    return freq
