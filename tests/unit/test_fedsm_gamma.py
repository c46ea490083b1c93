"""FedSM's gamma chosen from the sites' validation cases (issue 32): every site scores the super model per gamma as a
seen site and left out of the selector as if new; the server keeps the gamma whose route serves both best."""

from __future__ import annotations

import pytest
import torch

from medflare.fedsm.scoring import GAMMA_GRID, SWEEP_NAME, choose_gamma, gamma_sweep, is_sweep_score, summarize

N = 20


def _site(own: int, person: list[float], global_score: float) -> dict[str, float]:
    """One site's sweep on N cases all typical of itself (typicality 0.9), of site ``own + 1`` somewhat (0.3) and of
    the rest barely (0.02); per-case scores: ``person[i]`` for site i's personalised model, ``global_score`` for the
    global model."""
    k = len(person)
    table = torch.tensor([[global_score] * N, *([p] * N for p in person)], dtype=torch.float64)
    typ = torch.full((N, k), 0.02)
    typ[:, own] = 0.9
    typ[:, (own + 1) % k] = 0.3
    return gamma_sweep(table, typ, None, own, "dice")


def _name(what: str, gamma: float) -> str:
    return SWEEP_NAME.format(what=what, key="dice", gamma=gamma)


def test_the_unseen_score_leaves_the_site_out_and_routes_to_the_nearest_other_site_or_the_global_model():
    sweep = _site(0, [0.9, 0.8, 0.2], 0.3)
    assert sweep[_name("super", 0.05)] == pytest.approx(0.9)  # seen: its own model
    assert sweep[_name("super", 1.0)] == pytest.approx(0.3)  # gamma 1: always the global model
    assert sweep[_name("unseen", 0.0)] == pytest.approx(0.8)  # its own model gone: the most typical other site's
    assert sweep[_name("unseen", 0.2)] == pytest.approx(0.8)  # that site's typicality 0.3 passes gamma 0.2
    assert sweep[_name("unseen", 0.5)] == pytest.approx(0.3)  # not gamma 0.5: the global model
    assert set(sweep) == {_name(w, g) for w in ("super", "unseen") for g in GAMMA_GRID} and all(map(is_sweep_score, sweep))
    assert not is_sweep_score("super_dice") and not is_sweep_score("global_dice")


@pytest.mark.parametrize("person, global_score, better", [
    ([0.9, 0.8, 0.85], 0.3, "nearest"),  # similar sites: a new site is served best by its nearest site's model
    ([0.9, 0.1, 0.15], 0.7, "global"),   # dissimilar sites: the global model serves a new site better
])
def test_the_chosen_gamma_is_the_better_route_for_an_unseen_site(person, global_score, better):
    # each site's own model scores 0.9 on its cases, the others' models ``person[i]``
    per_site = {f"hospital-{own}": _site(own, [0.9 if i == own else person[i] for i in range(3)], global_score)
                for own in range(3)}
    gamma, table = choose_gamma(per_site, "dice", default=0.05)
    unseen = {g: u for g, (_, u) in table.items()}
    assert unseen[gamma] == pytest.approx(max(unseen.values()))
    nearest, global_route = unseen[0.0], unseen[1.0]
    assert (nearest > global_route + 0.2) if better == "nearest" else (global_route > nearest + 0.2)
    assert (gamma < 0.3) if better == "nearest" else (gamma >= 0.5)  # 0.3: the nearest other site's typicality


def test_no_sweep_keeps_the_configured_gamma_and_ties_go_to_it():
    assert choose_gamma({"a": {"super_dice": 0.5}}, "dice", default=0.1) == (0.1, {})
    flat = {g: 0.5 for g in GAMMA_GRID}
    per_site = {"a": {**{_name("super", g): v for g, v in flat.items()}, **{_name("unseen", g): v for g, v in flat.items()}}}
    assert choose_gamma(per_site, "dice", default=0.1)[0] == 0.1


def test_summarize_adds_the_sweep_only_when_asked_and_with_every_sites_model():
    g, p0, p1 = (torch.full((N,), v, dtype=torch.float64) for v in (0.3, 0.9, 0.8))
    typ = torch.tensor([[0.9, 0.3]] * N)
    scores = {"global": g, "person": p0, "person_0": p0, "person_1": p1}
    plain = summarize(scores, typ, None, 0, 0.05, "dice", "global", ["person_0", "person_1"], "person")
    swept = summarize(scores, typ, None, 0, 0.05, "dice", "global", ["person_0", "person_1"], "person", sweep=True)
    assert not any(map(is_sweep_score, plain)) and swept[_name("unseen", 0.0)] == pytest.approx(0.8)
    assert {k: v for k, v in swept.items() if not is_sweep_score(k)} == plain
