"""Tables of per-site results in the FedSM paper's Table 3 layout: per-site, client average, all cases pooled.

One unit everywhere a person reads a score: percent with two decimals, the unit said in the column header (``dice (%)``);
distances (hd95, in the image's units: pixels, or mm for volumes) and variation of information (bits) keep their own
units. Fractions are only in JSON: TensorBoard's score scalars are percent too (:func:`is_percent_tag`, applied by
:class:`medflare.common.tracking.SiteTracker` when it sends and undone by :func:`medflare.jobs.simulate.read_scalars`
when a program reads them back, so code reads fractions everywhere)."""

from __future__ import annotations

import math
import numbers
import re
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
    head = f"| method ({metric}, %) | " + " | ".join(sites) + " | client avg | all cases |"
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


#: the row of a table that pools every site's cases (``"global"`` in the JSON, the paper's "global test")
POOLED = "all cases"


def metrics_table(table: Mapping[str, Any], counts: Mapping[str, int] | None = None) -> str:
    """Every metric of a :func:`site_table` as markdown: one row per site (+ the client average and all cases pooled
    when there are several sites), scores in percent, distances (hd95, in the image's units) and VI (bits) in theirs;
    each header names its unit."""
    names = list(next(iter(table["sites"].values())).keys()) if table["sites"] else []
    lines = ["| site | cases | " + " | ".join(map(metric_header, names)) + " |", "|" + "---|" * (len(names) + 2)]
    rows = list(table["sites"].items())
    if len(rows) > 1:
        rows += [("client average", table["client_average"]), (POOLED, table["global"])]
    for site, means in rows:
        n = str((counts or {}).get(site, "")) if site in (counts or {}) else ""
        lines.append(f"| {site} | {n} | " + " | ".join(format_cell(k, means.get(k)) for k in names) + " |")
    return "\n".join(lines)


def per_class_table(per_site: Mapping[str, Mapping[str, Any]]) -> str:
    """Each site's per-class means (``evaluate()["per_class"]``) as markdown, one column per metric and class;
    "-" where the class is absent at the site (in no label: left out of its class mean)."""
    columns = sorted({(base, int(k)) for r in per_site.values() for base, classes in r.get("per_class", {}).items() for k in classes})
    names = [f"{base}_c{k}" for base, k in columns]
    lines = ["| site | " + " | ".join(map(metric_header, names)) + " |", "|" + "---|" * (len(names) + 1)]
    for site, result in per_site.items():
        per_class = result.get("per_class", {})
        cells = [format_cell(base, per_class.get(base, {}).get(k)) for base, k in columns]
        lines.append(f"| {site} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: metrics in their own units, never percent: distances (image units: pixels, mm for volumes) and VI (bits)
OWN_UNITS = {"hd95": "px or mm", "vi": "bits"}
#: name parts of numbers that are counts, losses, sizes or settings, never fractions of a whole
_PLAIN = ("cases", "steps", "bytes", "images", "loss", "epsilon", "seconds", "time", "round", "count", "lr", "norm")


def own_unit(name: str) -> str | None:
    """The unit of a metric not shown in percent (:data:`OWN_UNITS`), or None for a score."""
    return next((unit for prefix, unit in OWN_UNITS.items() if name.startswith(prefix)), None)


def _is_score(name: str, value) -> bool:
    """A fraction to show as percent: a float score whose name is not a count, loss or distance."""
    return (isinstance(value, float) and own_unit(name) is None and not any(part in name for part in _PLAIN))


#: words of a score's name: an overlap, an agreement or a share of cases, a fraction of a whole
SCORE_WORDS = frozenset({"dice", "accuracy", "acc", "mpa", "auc", "aji", "iou", "f1", "selected", "sensitivity",
                         "specificity", "precision", "recall"})


def is_percent_tag(tag: str) -> bool:
    """Whether a TensorBoard scalar tag (``val_global/dice``, ``final/test_accuracy/site-1``,
    ``federation/mean_own_or_global_dice``) holds a score, shown in percent: one of its ``/``- or ``_``-separated words
    is a :data:`SCORE_WORDS` word and none names a count, loss, size or time."""
    words = set(re.split(r"[/_]", tag.lower()))
    return bool(words & SCORE_WORDS) and not words.intersection(_PLAIN)


def metric_header(name: str) -> str:
    """A table column's header with its unit: ``dice (%)``, ``hd95 (px or mm)``, ``vi (bits)``."""
    return f"{name} ({own_unit(name) or '%'})"


def format_cell(name: str, value) -> str:
    """A table cell: percent without the sign (the header says it), distances and bits with 3 decimals."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.3f}" if own_unit(name) else f"{100 * value:.2f}"


def format_metric(name: str, value) -> str:
    """A value in running text: scores as percent with the sign (``71.23 %``), distances and bits with 3 decimals,
    counts, losses and other numbers with 4 significant digits ("-" for a missing or NaN value)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or isinstance(value, numbers.Integral):
        return str(value)
    value = float(value)
    if math.isnan(value):
        return "-"
    if own_unit(name):
        return f"{value:.3f}"
    return f"{100 * value:.2f} %" if _is_score(name, value) else f"{value:.4g}"


def named_fractions_table(rows: Mapping[str, Mapping[str, float]], first: str = "site") -> str:
    """``{row: {column: fraction}}`` as a markdown table of percentages (e.g. FedSM's selection frequencies); each
    column's header says "(%)"."""
    cols = list(next(iter(rows.values())))
    lines = [f"| {first} | " + " | ".join(f"{c} (%)" for c in cols) + " |", "|" + "---|" * (len(cols) + 1)]
    lines += [f"| {row} | " + " | ".join(f"{100 * f.get(c, 0.0):.1f}" for c in cols) + " |" for row, f in rows.items()]
    return "\n".join(lines)


def confusion_matrix(per_case: list[Mapping[str, Any]], num_classes: int) -> list[list[int]]:
    """Counts ``[true][predicted]`` from classification per-case rows (``label``, ``pred``)."""
    matrix = [[0] * num_classes for _ in range(num_classes)]
    for case in per_case:
        matrix[int(case["label"])][int(case["pred"])] += 1
    return matrix


def confusion_table(matrix: list[list[int]]) -> str:
    """A confusion matrix with per-class accuracy (recall) as markdown: rows true class, columns predicted."""
    k = len(matrix)
    lines = ["| true \\ predicted | " + " | ".join(map(str, range(k))) + " | cases | accuracy (%) |", "|" + "---|" * (k + 3)]
    for c, row in enumerate(matrix):
        total = sum(row)
        acc = f"{100 * row[c] / total:.1f}" if total else "-"
        lines.append(f"| {c} | " + " | ".join(map(str, row)) + f" | {total} | {acc} |")
    return "\n".join(lines)
