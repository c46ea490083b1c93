"""Tables of per-site results in the FedSM paper's Table 3 layout: per-site, client average, global."""

from __future__ import annotations

import math
from typing import Any, Mapping


def site_table(per_site: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Summarise ``{site: evaluate() result}``.

    Returns ``{"sites": {site: {metric: mean}}, "client_average": {metric: mean of site means},
    "global": {metric: mean over every case of every site}}``: the client average weighs sites equally
    (the paper's "client average"), the global score weighs cases equally (its pooled "global test").
    """
    sites = {site: dict(result["mean"]) for site, result in per_site.items()}
    names = sorted({k for m in sites.values() for k in m})
    client_average = {n: _nanmean([m.get(n, math.nan) for m in sites.values()]) for n in names}
    cases = [case for result in per_site.values() for case in result.get("per_case", [])]
    global_ = {n: _nanmean([c.get(n, math.nan) for c in cases]) for n in names}
    return {"sites": sites, "client_average": client_average, "global": global_}


def markdown_table(rows: Mapping[str, Mapping[str, Any]], metric: str = "dice") -> str:
    """One markdown row per method from ``{method: site_table(...)}``: per-site, client average, global."""
    sites = sorted({s for t in rows.values() for s in t["sites"]})
    head = "| method | " + " | ".join(sites) + " | client avg | global |"
    lines = [head, "|" + "---|" * (len(sites) + 3)]
    for method, t in rows.items():
        cells = [_fmt(t["sites"].get(s, {}).get(metric)) for s in sites]
        cells += [_fmt(t["client_average"].get(metric)), _fmt(t["global"].get(metric))]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _nanmean(values) -> float:
    finite = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    return sum(finite) / len(finite) if finite else math.nan


def _fmt(value) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{100 * value:.2f}"
