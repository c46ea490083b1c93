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
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import torch

from medflare import MedflareError
from medflare.fedsm.routing import GLOBAL, route
from medflare.metrics import evaluate
from medflare.metrics.site_mean import site_mean

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
) -> dict[str, float]:
    """The metrics of the module docstring from per-case scores and selector outputs.

    The site means reduce through :func:`site_score` (a class in no case's label is left out, as in
    every evaluation); a super model's case takes the routed model's per-class scores and presence.
    ``case_scores`` holds (N,) or (N, 2, K) (:func:`case_scorer`) per-case scores of the global model (``global_name``), this site's personalised
    model (``own_name``) and, when ``person_names`` is given, every site's personalised model in site order.
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
        out[f"super_{key}"] = site_score(table[(choice + 1).clamp(min=0), torch.arange(len(choice))])
    out["selector_acc"] = float((typicality.argmax(1) == own).double().mean())
    out["selected_own"] = float(mine.sum()) / n
    out["selected_global"] = float((choice == GLOBAL).sum()) / n
    out["selected_other"] = float(((choice != own) & (choice != GLOBAL)).sum()) / n
    return out
