"""FedSM inference (Algorithm 2): the model selector routes each image to a personalised or the global model.

Plain torch, no FLARE: used by the FedSM client to score the super model every round, by
``medflare evaluate`` on a saved super model and by the unseen-site sweep.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

from medflare import MedflareError
from medflare.fedsm.config import DEFAULT_GAMMA  # noqa: F401 - Algorithm 2's threshold when a job or a command gives none

#: Routing result meaning "the global model" (personalised models are 0..K-1).
GLOBAL = -1
#: the name of the global model in a routing report (the paper's Table 5 calls it "GM")
GLOBAL_MODEL = "global model"
#: what a routing report's table is, for the header above it
REPORT_TITLE = "cases routed to each model (%; 'global model': the FedAvg global model, a site: its personalised model)"


#: a routing threshold: one for every site, or one per site in selector order (chosen per site, :mod:`.scoring`)
Gamma = Union[float, Sequence[float]]


def route(typicality: torch.Tensor, gamma: Gamma, head_probs: torch.Tensor | None = None) -> torch.Tensor:
    """Which model each case goes to: -> (B,) long, GLOBAL or a site index (Algorithm 2).

    ``typicality`` (B, K) is the selector's confidence per site (:class:`~medflare.fedsm.selector.EncoderGaussianSelector`).
    If ``max_k typicality > gamma`` the case goes to the personalised model of the argmax site, else to the
    global model; with K thresholds (one per site) the argmax site's threshold is the one tested. With
    ``head_probs`` (B, K + 1) from a trained FedSM-extra head (column 0 = global model),
    a case passing the same test goes to the head's argmax instead (which may be the global model):
    the head chooses among the models, the typicality gate still sends a case atypical of every site to
    the global model. ``gamma`` 0 never falls back on typicality (the paper's FedSM-extra uses no threshold),
    1 always does.
    """
    if typicality.ndim != 2:
        raise MedflareError(f"route: typicality must be (B, K), got shape {tuple(typicality.shape)}")
    conf, choice = typicality.max(dim=1)
    threshold = torch.as_tensor(gamma, dtype=conf.dtype)
    if threshold.ndim == 1:
        if threshold.shape[0] != typicality.shape[1]:
            raise MedflareError(f"route: {threshold.shape[0]} per-site thresholds for {typicality.shape[1]} sites")
        threshold = threshold[choice]
    elif threshold.ndim:
        raise MedflareError(f"route: gamma must be a number or one per site, got shape {tuple(threshold.shape)}")
    if head_probs is not None:
        if head_probs.shape != (typicality.shape[0], typicality.shape[1] + 1):
            raise MedflareError(f"route: head probabilities must be (B, K + 1) = {(typicality.shape[0], typicality.shape[1] + 1)}, got {tuple(head_probs.shape)}")
        choice = head_probs.argmax(dim=1) - 1  # column 0 (global) -> GLOBAL
    choice = choice.clone()
    choice[conf <= threshold] = GLOBAL
    return choice


def as_gamma(gamma: Gamma) -> float | list[float]:
    """``gamma`` as a file records it and a predictor holds it: a float, or a list of floats (one per site)."""
    return float(gamma) if isinstance(gamma, (int, float)) else [float(g) for g in gamma]


def gamma_text(gamma: Gamma, sites: Sequence[str]) -> str:
    """``gamma 0.05``, or ``gamma per site (site-1 0.01, site-2 1e-12)`` for one threshold per site."""
    if isinstance(gamma, (int, float)):
        return f"gamma {float(gamma):g}"
    return "gamma per site (" + ", ".join(f"{s} {float(g):g}" for s, g in zip(sites, gamma)) + ")"


class SuperModelPredictor:
    """Callable ``images -> logits`` of the FedSM super model (Algorithm 2); remembers which model each case used.

    Args:
        global_model: the FedAvg global segmentation network.
        person_models: the K personalised networks in site-index order.
        selector: an :class:`~medflare.fedsm.selector.EncoderGaussianSelector` (``route_scores``).
        gamma: typicality threshold of Algorithm 2: about the share of a seen site's cases sent to the global
            model (see :mod:`medflare.fedsm.density`); or one per site in ``person_models`` order, as a run that
            chose them from validation saves them (:func:`medflare.fedsm.scoring.choose_site_gammas`). Default 0.05.
        sites: names of the personalised models' sites, for :meth:`report`. Default model_0..model_{K-1}.

    ``choices`` collects the routing of every case seen since the last :meth:`reset` (GLOBAL or site index).
    """

    def __init__(
        self,
        global_model: torch.nn.Module,
        person_models: Sequence[torch.nn.Module],
        selector: torch.nn.Module,
        gamma: Gamma = 0.05,
        sites: Sequence[str] = (),
    ):
        if not person_models:
            raise MedflareError("SuperModelPredictor: 'person_models' is empty")
        self.global_model = global_model
        self.person_models = list(person_models)
        self.selector = selector
        self.gamma = as_gamma(gamma)
        self.sites = list(sites) or [f"model_{i}" for i in range(len(self.person_models))]
        self.choices: list[int] = []

    def reset(self) -> None:
        self.choices = []

    report_title = REPORT_TITLE

    def report(self) -> dict[str, float]:
        """Fraction of the cases seen since :meth:`reset` routed to each model (paper Table 5 layout)."""
        return selection_frequency(self.choices, self.sites)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C_in, H, W) -> (B, num_classes, H, W) logits, each case from the model the selector chose."""
        for m in (self.global_model, *self.person_models, self.selector):
            m.eval()
        choice = self._route(images)
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

    def _route(self, images: torch.Tensor) -> torch.Tensor:
        typicality, head = self.selector.route_scores(images)
        return route(typicality, self.gamma, head)


def selection_frequency(choices: Sequence[int], sites: Sequence[str]) -> dict[str, float]:
    """Fraction of cases routed to each model (paper Table 5 layout, whose "GM" is ``"global model"`` here):
    ``{"global model": f, site: f, ...}``, a site's name standing for its personalised model."""
    n = max(len(choices), 1)
    freq = {GLOBAL_MODEL: sum(1 for c in choices if c == GLOBAL) / n}
    for i, site in enumerate(sites):
        freq[site] = sum(1 for c in choices if c == i) / n
    return freq
