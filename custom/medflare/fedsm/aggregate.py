"""One FedSM round on the server, as plain functions: what the controller does with the sites' replies.

- main rounds (Algorithm 1, lines 15-16): the global model moves by the n_k-weighted mean of the answering
  sites' global diffs; each answering site's personalised model by its own diff, then SoftPull (Eq. 11) over
  all K (a site that did not answer takes part with its previous model); a site that did not answer keeps its
  previous personalised model exactly: it trained nothing, and pulling it towards the others every round it
  is away would average it away (after r missed rounds only lambda^r of it would be left), which is what
  FedSM's personalisation is there to prevent (a deviation from Algorithm 1, which assumes every site
  answers; see jobs/fedsm/README.md); the selector takes the encoder the sites
  computed their feature Gaussians with (the global model they received) and the Gaussians of the sites
  that answered (a silent site has none for this encoder, so it is not selectable until it answers again);
- extra rounds (FedSM-extra): the models and Gaussians stay; the head takes one server-side Adam step from
  the sites' averaged head steps (:mod:`.extra`).

No FLARE: the controller turns FLARE results into :class:`SiteReply` and calls :func:`aggregate_round`;
the unit tests call it with hand-made replies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from medflare import PayloadError
from medflare.common.aggregation import Params, apply_diff, weighted_mean
from medflare.fedsm import protocol as P
from medflare.fedsm.extra import HeadAdam
from medflare.fedsm.selector import EncoderGaussianSelector
from medflare.fedsm.softpull import softpull


@dataclass
class SiteReply:
    """What one site sent in a round: its training-case count and, by phase, model diffs and statistics or a head step."""

    n: int
    diffs: Mapping[str, Params] | None = None  # {P.GLOBAL: diff, P.PERSON: diff} (main)
    stats: Mapping[str, np.ndarray] | None = None  # its feature Gaussian (main)
    head_step: Params | None = None  # FedSM-extra head update


@dataclass
class SuperState:
    """The server's FedSM state: global model, every site's personalised model, the selector (and its head optimiser)."""

    sites: list[str]
    global_params: dict[str, np.ndarray]
    person: dict[str, dict[str, np.ndarray]]
    selector: EncoderGaussianSelector
    head_opt: HeadAdam | None = field(default=None)


def aggregate_models(global_params: Params, person: Mapping[str, Params], replies: Mapping[str, SiteReply], sites: list[str],
                     lam: float) -> tuple[dict[str, np.ndarray], dict[str, dict[str, np.ndarray]]]:
    """FedAvg of the global diffs (n_k-weighted over answering sites), own diffs, SoftPull over all sites in ``sites`` order;
    a site not in ``replies`` keeps its personalised model unchanged (see the module docstring)."""
    answered = [s for s in sites if s in replies]
    if not answered:
        raise PayloadError("aggregate_models: no site answered")
    for s in answered:
        if replies[s].diffs is None or P.GLOBAL not in replies[s].diffs or P.PERSON not in replies[s].diffs:
            raise PayloadError(f"site '{s}' sent no '{P.GLOBAL}'/'{P.PERSON}' diffs in a main round")
    mean = weighted_mean([replies[s].diffs[P.GLOBAL] for s in answered], [replies[s].n for s in answered])
    new_global = apply_diff(global_params, mean)
    trained = [apply_diff(person[s], replies[s].diffs[P.PERSON]) if s in replies else {k: np.array(v, copy=True) for k, v in person[s].items()} for s in sites]
    pulled = softpull(trained, lam)
    return new_global, {s: pulled[i] if s in replies else trained[i] for i, s in enumerate(sites)}


def refresh_selector(selector: EncoderGaussianSelector, encoder_params: Params, replies: Mapping[str, SiteReply], sites: list[str]) -> list[str]:
    """Stem <- the encoder the statistics were computed with; Gaussians <- those sent this round. Returns the sites set."""
    got = [s for s in sites if s in replies and replies[s].stats is not None]
    if not got:
        return []
    selector.set_stem_params(encoder_params)
    selector.clear_sites()
    for s in got:
        selector.set_site(sites.index(s), replies[s].stats)
    if selector.global_class:
        selector.set_head_standardisation([replies[s].stats for s in got])
    return got


def aggregate_round(state: SuperState, replies: Mapping[str, SiteReply], phase: str, lam: float) -> SuperState:
    """The next state after a round of ``phase`` (see the module docstring); ``state``'s selector is updated in place."""
    if phase == P.MAIN:
        encoder = state.global_params  # what the sites computed their features with
        state.global_params, state.person = aggregate_models(state.global_params, state.person, replies, state.sites, lam)
        refresh_selector(state.selector, encoder, replies, state.sites)
    elif phase == P.EXTRA:
        if state.head_opt is None:
            raise PayloadError("an extra round needs a selector head (FedSM-extra) and its optimiser")
        steps = [(replies[s].head_step, replies[s].n) for s in state.sites if s in replies and replies[s].head_step is not None]
        if steps:
            state.head_opt.step([s for s, _ in steps], [n for _, n in steps])
            state.selector.head_trained.fill_(1.0)
    else:
        raise PayloadError(f"unknown FedSM phase '{phase}' (known: {list(P.PHASES)})")
    return state
