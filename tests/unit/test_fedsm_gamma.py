"""FedSM's gamma chosen from the sites' validation cases (issue 32): every site scores the super model per gamma as a
seen site and left out of the selector as if new; the server keeps the gamma whose route serves both best, one for all
sites (``choose_gamma``, logged) and one per site (``choose_site_gammas``, saved)."""

from __future__ import annotations

import pytest
import torch

from medflare.fedsm.routing import GLOBAL, route
from medflare.fedsm.scoring import GAMMA_GRID, SITE_SWEEP_NAME, SWEEP_NAME, choose_gamma, choose_site_gammas, gamma_sweep, is_sweep_score, summarize

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
    shares = {SITE_SWEEP_NAME.format(key="dice", site=k, gamma=g) for k in range(3) for g in GAMMA_GRID}
    assert set(sweep) == {_name(w, g) for w in ("super", "unseen") for g in GAMMA_GRID} | shares and all(map(is_sweep_score, sweep))
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


def _share(k: int, gamma: float) -> str:
    return SITE_SWEEP_NAME.format(key="dice", site=k, gamma=gamma)


def test_the_per_site_shares_add_up_to_the_sweep_at_every_gamma():
    # random per-class scores with classes absent from some cases (one absent from every case), random typicality
    # spanning the grid's scale, four sites: the shares over sites of a threshold are (seen + left out) / 2 there
    gen = torch.Generator().manual_seed(0)
    n, k = 30, 4
    values = torch.rand((k + 1, n, 3), generator=gen, dtype=torch.float64)
    present = torch.rand((n, 3), generator=gen) > 0.3
    present[:, 2] = False
    table = torch.stack([values, present.double().expand(k + 1, n, 3)], 2)  # (K + 1, N, 2, C)
    typ = 10 ** (-14 * torch.rand((n, k), generator=gen, dtype=torch.float64))
    sweep = gamma_sweep(table, typ, None, 1, "dice")
    for g in GAMMA_GRID:
        total = sum(sweep[_share(j, g)] for j in range(k))
        assert total == pytest.approx((sweep[_name("super", g)] + sweep[_name("unseen", g)]) / 2)


def _twin_federation():
    """Three training sites and a new one: sites 0 and 1 look alike, their left-out cases reach each other at typicality
    0.03 and score better with the global model (0.8) than with each other's model (0.6); site 2 is unlike both (1e-20)
    and only its own model serves it (0.9 against the global model's 0.3). Seen cases are typical of their own site (0.5).
    The new site is site 2's twin: typicality 1e-6 of site 2, its model 0.85 there, the global model 0.3."""
    near = torch.tensor([[0.5, 0.03, 1e-20], [0.03, 0.5, 1e-20], [1e-20, 1e-20, 0.5]], dtype=torch.float64)
    person = torch.tensor([[0.9, 0.6, 0.1], [0.6, 0.9, 0.1], [0.1, 0.1, 0.9]], dtype=torch.float64)  # [site, model]
    glob = torch.tensor([0.8, 0.8, 0.3], dtype=torch.float64)
    per_site = {}
    for own in range(3):
        table = torch.cat([glob[own].expand(1, N), person[own][:, None].expand(3, N)])
        per_site[f"hospital-{own}"] = gamma_sweep(table, near[own].expand(N, 3), None, own, "dice")
    return per_site


def test_a_threshold_per_site_routes_a_new_sites_cases_to_its_look_alike_where_one_threshold_cannot():
    per_site = _twin_federation()
    one, _ = choose_gamma(per_site, "dice", default=0.05)
    gammas, shares = choose_site_gammas(per_site, "dice", 3)
    # sites 0 and 1: their look-alikes' cases do better on the global model, so the threshold stops them (> 0.03);
    # site 2: no case says the global model serves its look-alikes better, so the smallest positive threshold
    assert gammas[0] >= 0.05 and gammas[1] >= 0.05 and gammas[2] == min(g for g in GAMMA_GRID if g > 0)
    # one threshold for all has to stop the look-alikes of sites 0 and 1 too, and with them the new site's cases
    assert one >= 0.05
    new_site = torch.tensor([[1e-20, 1e-20, 1e-6]], dtype=torch.float64)
    assert route(new_site, gammas).item() == 2 and route(new_site, one).item() == GLOBAL  # 0.85 against 0.3
    # and on the training sites' own validation cases the thresholds per site score at least the one for all
    assert sum(shares) >= sum(choose_gamma(per_site, "dice", 0.05)[1][one]) / 2 - 1e-12


def test_site_thresholds_need_every_share_keep_the_gate_and_break_ties_to_the_smallest():
    assert choose_site_gammas({"a": {"super_dice": 0.5}}, "dice", 1) is None
    smallest = min(g for g in GAMMA_GRID if g > 0)
    flat = {"a": {_share(0, g): 0.5 for g in GAMMA_GRID}}
    assert choose_site_gammas(flat, "dice", 1) == ([smallest], [0.5])
    no_gate = {"a": {_share(0, g): 0.6 if g == 0 else 0.5 for g in GAMMA_GRID}}  # 0 (no gate) is never chosen
    assert choose_site_gammas(no_gate, "dice", 1)[0] == [smallest]
    higher = {"a": {_share(0, g): 0.6 if g >= 0.1 else 0.5 for g in GAMMA_GRID}}
    assert choose_site_gammas(higher, "dice", 1)[0] == [0.1]


def test_route_tests_each_case_against_its_most_typical_sites_threshold():
    typ = torch.tensor([[0.02, 0.01], [0.01, 0.02], [1e-9, 1e-10]], dtype=torch.float64)
    assert route(typ, [0.05, 0.001]).tolist() == [GLOBAL, 1, GLOBAL]
    assert route(typ, [1e-12, 0.05]).tolist() == [0, GLOBAL, 0]
    with pytest.raises(Exception, match="per-site thresholds"):
        route(typ, [0.1, 0.1, 0.1])


def test_a_site_that_lies_about_its_shares_moves_a_threshold_by_a_bounded_amount():
    honest = _twin_federation()
    gammas, _ = choose_site_gammas(honest, "dice", 3)
    shares = {name: 0.0 for name in honest["hospital-0"] if name.startswith("sweep_site_")}
    broken = {**honest, "broken": {**shares, _share(2, 1e-12): float("nan"), _share(2, 0.01): float("inf")}}
    assert choose_site_gammas(broken, "dice", 3)[0] == choose_site_gammas({**honest, "broken": shares}, "dice", 3)[0]
    huge = {**honest, "liar": {**shares, _share(0, 1e-12): 1e9}}
    capped = {**honest, "liar": {**shares, _share(0, 1e-12): 1.0}}
    assert choose_site_gammas(huge, "dice", 3) == choose_site_gammas(capped, "dice", 3)
    assert gammas[2] == min(g for g in GAMMA_GRID if g > 0)
