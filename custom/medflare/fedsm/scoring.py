"""A site's per-round FedSM scores in one pass over a split: every model and the selector on each batch.

Dice and the other preset metrics are per case (and per class) and averaged over cases, so the super model's
score of a case is the score of the model the selector routed it to: one forward of each network per batch gives the
global, personalised and super-model scores together, with no separate super-model pass
(:func:`one_pass`, then :func:`summarize`). Plain torch (the metric comes from :mod:`medflare.metrics`), no FLARE.

Metrics (``key`` is the preset's key metric, e.g. ``dice``):
    global_<key>, person_<key>: the global and this site's personalised model;
    super_<key>: the super model (Algorithm 2) exactly, when the site holds every site's personalised model
        (FedSM-extra rounds, the final ``validate`` task);
    own_or_global_<key>: the super model as a site can run it with the models it holds in a main round:
        its own personalised model where the selector picks this site, the global model elsewhere (a case
        routed to *another* site's model is scored with the global model; ``selected_other`` says how
        often that happened). The best super model is chosen by this score, the same in every round;
    selector_acc: share of cases whose most typical site is this site (site identification);
    selected_own / selected_global / selected_other: where Algorithm 2 at gamma sends the cases.

The final round also scores every threshold of :data:`GAMMA_GRID` (:func:`gamma_sweep`): the super model at that gamma
as this site's cases meet it (``sweep_super_<key>_g<gamma>``), and as they would meet it were this site new to the
federation (``sweep_unseen_<key>_g<gamma>``: leave this site out, its selector column and its personalised model removed,
so a case goes to the most typical *other* site's model or, below gamma, to the global model). The server picks the
super model's gamma from those scores (:func:`choose_gamma`) instead of keeping a fixed one: whether an unseen site is
better served by the nearest personalised model or by the global model depends on the federation (on the synthetic
held-out sites the former, on real ones the latter; benchmarks/RESULTS_fedsm.md). It also depends on which site a new
case resembles, so the sweep is also split by the site each case is most typical of (``sweep_site_<key>_s<k>_g<gamma>``,
:func:`gamma_sweep`) and the saved super model keeps one threshold per site (:func:`choose_site_gammas`): a look-alike
of a site whose left-out neighbours fare better on the global model is stopped, one of a site unlike the rest is not.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from medflare import MedflareError
from medflare.fedsm.routing import GLOBAL, route
from medflare.metrics import evaluate
from medflare.metrics.site_mean import site_mean

#: the thresholds the final round scores and the server chooses among (0: never the global model, 1: always). The
#: typicality is a chi-square tail probability, so thresholds far under 0.01 still separate cases: on the synthetic
#: sites a site's look-alike sits at 1e-12-1e-2 of the nearest seen site, a site unlike all of them under 1e-12
#: (benchmarks/RESULTS_fedsm.md, "A threshold per site")
GAMMA_GRID = (0.0, 1e-12, 1e-8, 1e-6, 1e-4, 1e-3, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0)
#: a sweep score's name: ``super`` or ``unseen``, the key metric, the threshold (``sweep_unseen_dice_g0.05``)
SWEEP_NAME = "sweep_{what}_{key}_g{gamma:g}"
#: a site's share of the choice of site ``site``'s threshold (index in selector order): see :func:`gamma_sweep`
SITE_SWEEP_NAME = "sweep_site_{key}_s{site}_g{gamma:g}"

#: (batch, logits) -> (B, 2, K) per-case, per-class key metric (row 0) and class presence (row 1, see :func:`case_scorer`)
CaseScorer = Callable[[Mapping[str, Any], torch.Tensor], torch.Tensor]


def case_scorer(task: str, num_classes: int, metric: str, device: torch.device | str) -> CaseScorer:
    """Per-case ``metric`` of a batch's logits, computed by :func:`medflare.metrics.evaluate` (one home for metrics).

    A class-averaged metric ("dice") comes back per class with where each class is in the case's label,
    (B, 2, num_classes-1), because whether a class counts in the site's mean depends on every case of the split
    (:func:`medflare.metrics.site_mean`); any other metric as (B, 2, 1) with presence 1.
    """

    def score(batch: Mapping[str, Any], logits: torch.Tensor) -> torch.Tensor:
        result = evaluate(None, [batch], task=task, num_classes=num_classes, metrics=[metric], device=device,
                          predict=lambda _: logits, keep_class_values=True)
        if metric in result.get("class_values", {}):
            values, present = result["class_values"][metric].double(), result["present"].double()
        else:
            values = torch.tensor([[row[metric]] for row in result["per_case"]], dtype=torch.float64)
            present = torch.ones_like(values)
        return torch.stack([values, present], 1)

    return score


def site_score(case_scores: torch.Tensor) -> float:
    """The site mean of per-case scores: (N,) already per case, or (N, 2, K) from :func:`case_scorer`."""
    if case_scores.ndim == 1:
        return site_mean(case_scores).mean
    return site_mean(case_scores[:, 0], case_scores[:, 1].bool()).mean


@torch.no_grad()
def one_pass(
    batches: Iterable[Mapping[str, Any]],
    nets: Mapping[str, torch.nn.Module | Callable[[torch.Tensor], torch.Tensor]],
    selector: torch.nn.Module | None,
    score: CaseScorer,
    device: torch.device | str,
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
    """Per-case scores of each net ``{name: (N, ...)}`` (as ``score`` gives them), and the selector's typicality (N, K) and head probabilities (N, K+1) or None."""
    scores: dict[str, list[torch.Tensor]] = {name: [] for name in nets}
    typ, head = [], []
    for net in nets.values():
        if isinstance(net, torch.nn.Module):  # else a predictor around a network already in eval mode
            net.eval()
    if selector is not None:
        selector.eval()
    for batch in batches:
        images = torch.as_tensor(batch["image"]).to(device)
        for name, net in nets.items():
            scores[name].append(score(batch, net(images)))
        if selector is not None:
            t, h = selector.route_scores(images)
            typ.append(t.cpu())
            if h is not None:
                head.append(h.cpu())
    if not typ and selector is not None:
        raise MedflareError("one_pass: the split has no cases")
    return ({name: torch.cat(v) for name, v in scores.items()},
            torch.cat(typ) if typ else None, torch.cat(head) if head else None)


def summarize(
    case_scores: Mapping[str, torch.Tensor],
    typicality: torch.Tensor,
    head: torch.Tensor | None,
    own: int,
    gamma: float,
    key: str,
    global_name: str,
    person_names: list[str] | None,
    own_name: str,
    sweep: bool = False,
) -> dict[str, float]:
    """The metrics of the module docstring from per-case scores and selector outputs.

    The site means reduce through :func:`site_score` (a class in no case's label is left out, as in
    every evaluation); a super model's case takes the routed model's per-class scores and presence.
    ``case_scores`` holds (N,) or (N, 2, K) (:func:`case_scorer`) per-case scores of the global model (``global_name``), this site's personalised
    model (``own_name``) and, when ``person_names`` is given, every site's personalised model in site order; then
    ``sweep`` adds the :func:`gamma_sweep` scores.
    """
    g, p = case_scores[global_name], case_scores[own_name]
    choice = route(typicality, gamma, head)
    n = max(len(choice), 1)
    mine = choice == own
    mine_b = mine.reshape(-1, *([1] * (g.ndim - 1)))
    out = {
        f"global_{key}": site_score(g),
        f"person_{key}": site_score(p),
        f"own_or_global_{key}": site_score(torch.where(mine_b, p, g)),
    }
    if person_names is not None:
        table = torch.stack([g, *(case_scores[name] for name in person_names)])  # (K + 1, N, ...), row 0 = global
        out[f"super_{key}"] = _routed(table, choice)
        if sweep:
            out.update(gamma_sweep(table, typicality, head, own, key))
    out["selector_acc"] = float((typicality.argmax(1) == own).double().mean())
    out["selected_own"] = float(mine.sum()) / n
    out["selected_global"] = float((choice == GLOBAL).sum()) / n
    out["selected_other"] = float(((choice != own) & (choice != GLOBAL)).sum()) / n
    return out


def _routed(table: torch.Tensor, choice: torch.Tensor) -> float:
    """The site mean of each case scored by the model it was routed to (``table`` row 0 = global, 1 + i = site i)."""
    return site_score(table[choice + 1, torch.arange(len(choice))])


def gamma_sweep(table: torch.Tensor, typicality: torch.Tensor, head: torch.Tensor | None, own: int, key: str,
                grid: Sequence[float] = GAMMA_GRID) -> dict[str, float]:
    """For each ``gamma`` of ``grid``: ``sweep_super_<key>_g<gamma>``, Algorithm 2 at that threshold on this site's
    cases, and ``sweep_unseen_<key>_g<gamma>``, the same with this site left out (see the module docstring).

    ``table`` (K + 1, N, ...): per-case scores, row 0 the global model, row 1 + i site i's personalised model;
    ``typicality`` (N, K) and ``head`` (N, K + 1) or None: the selector's outputs; ``own``: this site's index. Each
    site's typicality is its own Gaussian's tail probability (:mod:`medflare.fedsm.density`), so dropping a column is
    the selector without that site. The models still learnt from it, the global model with its full FedAvg weight and
    another site's personalised model only through SoftPull's share, so the unseen scores flatter the global route
    most (jobs/fedsm/README.md, "Choosing gamma").
    """
    others = [i for i in range(typicality.shape[1]) if i != own]
    rows = [0, *(i + 1 for i in others)]
    out = {}
    for gamma in grid:
        out[SWEEP_NAME.format(what="super", key=key, gamma=gamma)] = _routed(table, route(typicality, gamma, head))
        if others:
            unseen = route(typicality[:, others], gamma, head[:, rows] if head is not None else None)
            score = _routed(table[rows], unseen)
        else:  # a federation of one site: a new site has only the global model
            score = site_score(table[0])
        out[SWEEP_NAME.format(what="unseen", key=key, gamma=gamma)] = score
    out.update(_site_shares(table, typicality, head, others, key, grid))
    return out


def _site_shares(table: torch.Tensor, typicality: torch.Tensor, head: torch.Tensor | None, others: list[int], key: str,
                 grid: Sequence[float]) -> dict[str, float]:
    """``sweep_site_<key>_s<k>_g<gamma>``: this site's (seen + left-out) / 2 score, counting only the cases whose most
    typical site is k, each routed at ``gamma``.

    A case meets only its most typical site's threshold (:func:`~medflare.fedsm.routing.route`), so the score with one
    threshold per site is the sum over sites k of these shares at k's threshold: the server can choose each site's
    threshold on its own (:func:`choose_site_gammas`). A share is a sum of per-case scores over this site's cases
    (the site mean is the mean over cases, :func:`~medflare.metrics.site_mean.site_mean`), divided by the count of
    cases the global model scores; a site whose label maps hold a class no case has keeps the site mean's rule.
    """
    per_case = _per_case(table)  # (K + 1, N), row 0 the global model
    n = max(int((~per_case[0].isnan()).sum()), 1)
    num_sites = typicality.shape[1]
    shares = torch.zeros(num_sites, len(grid), dtype=torch.float64)
    views = [(list(range(num_sites)), typicality, head)]
    if others:
        views.append((others, typicality[:, others], head[:, [0, *(i + 1 for i in others)]] if head is not None else None))
    for cols, typ, hd in views:
        col = torch.as_tensor(cols)
        gate = col[typ.argmax(1)]  # the site whose threshold each case meets
        for j, gamma in enumerate(grid):
            choice = route(typ, gamma, hd)
            routed = per_case[torch.where(choice == GLOBAL, 0, col[choice.clamp(min=0)] + 1), torch.arange(len(choice))]
            shares[:, j] += torch.zeros(num_sites, dtype=torch.float64).index_add_(0, gate, routed.nan_to_num(0.0)) / (2 * n)
    if not others:  # a federation of one site: its left-out half is the global model's score
        shares += site_score(table[0]) / 2
    return {SITE_SWEEP_NAME.format(key=key, site=k, gamma=gamma): float(shares[k, j])
            for k in range(num_sites) for j, gamma in enumerate(grid)}


def _per_case(table: torch.Tensor) -> torch.Tensor:
    """(K + 1, N) per-case scores of each row of a sweep table (rows already (N,) per case, or (N, 2, C) per class)."""
    if table.ndim == 2:
        return table.double()
    return torch.stack([site_mean(row[:, 0], row[:, 1].bool()).per_case.double() for row in table])


def is_sweep_score(name: str) -> bool:
    """Whether a metric's name is one of :func:`gamma_sweep`'s (:data:`SWEEP_NAME`)."""
    return name.startswith("sweep_")


def choose_gamma(per_site: Mapping[str, Mapping[str, float]], key: str, default: float,
                 grid: Sequence[float] = GAMMA_GRID) -> tuple[float, dict[float, tuple[float, float]]]:
    """The super model's gamma from the sites' final validation sweeps (:func:`gamma_sweep`): the grid's threshold with
    the best mean over sites of (seen + unseen) / 2, the threshold closest to ``default`` among equals; ``default``
    when no site reported a sweep. Returns it and ``{gamma: (mean seen score, mean unseen score)}``.

    Seen and unseen weigh the same: a super model serves the federation's own sites and the sites that join it later,
    and over small thresholds the seen score barely moves (a seen case is typical of its own site), so the unseen
    route decides where the seen sites do not care."""
    table: dict[float, tuple[float, float]] = {}
    for gamma in grid:
        names = [SWEEP_NAME.format(what=what, key=key, gamma=gamma) for what in ("super", "unseen")]
        rows = [[float(m[n]) for m in per_site.values() if isinstance(m.get(n), (int, float)) and math.isfinite(m[n])]
                for n in names]
        if all(rows):
            table[gamma] = (sum(rows[0]) / len(rows[0]), sum(rows[1]) / len(rows[1]))
    if not table:
        return float(default), {}
    best = max(sum(v) / 2 for v in table.values())
    tied = [g for g, v in table.items() if sum(v) / 2 >= best - 1e-12]
    return float(min(tied, key=lambda g: (abs(g - default), g))), table


def choose_site_gammas(per_site: Mapping[str, Mapping[str, float]], key: str, num_sites: int,
                       grid: Sequence[float] = GAMMA_GRID) -> tuple[list[float], list[float]] | None:
    """One threshold per site (selector order) from the sites' :func:`gamma_sweep` shares: for site k the grid value
    whose cases routed there score best, summed over the reporting sites, seen and left out alike; None when no site
    sent a share (sites of an older medflare). Returns the thresholds and each one's share of the objective. A share
    is clipped to [0, 1], its range for a score in [0, 1], and a site's non-finite share is left out: a site that lies
    moves a threshold's mean by at most 1/K, and the thresholds stay grid values.

    The objective is :func:`choose_gamma`'s (the mean over sites of (seen + left out) / 2) with a threshold per site
    instead of one for all, so it is never lower than any one positive threshold for all. The thresholds are the grid's
    positive ones: a case atypical of every site beyond the smallest still goes to the global model (Algorithm 2's
    "maybe none of the personalised models is suitable"), which a handful of validation cases should not switch off for
    a site (with 0 allowed, the report's FedSM at seed 0 chose it for one site). Among equal scores the smallest wins: where no validation
    case says that the global model serves a site's look-alikes better, they keep that site's personalised model
    (Algorithm 2's premise).
    """
    candidates = [g for g in grid if g > 0] or list(grid)
    gammas, values = [], []
    for k in range(num_sites):
        totals = {}
        for gamma in candidates:
            name = SITE_SWEEP_NAME.format(key=key, site=k, gamma=gamma)
            shares = [min(max(float(v), 0.0), 1.0) for m in per_site.values()
                      if isinstance(v := m.get(name), (int, float)) and math.isfinite(v)]
            if not shares:
                return None
            totals[gamma] = sum(shares) / len(shares)
        best = max(totals.values())
        chosen = min(g for g, v in totals.items() if v >= best - 1e-12)
        gammas.append(float(chosen))
        values.append(totals[chosen])
    return gammas, values
