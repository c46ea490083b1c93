"""PNG figures of the report: the key metric against rounds and against bytes communicated, one line per method.

Scores are drawn in percent, the unit of the report's tables (the records hold fractions, as every JSON does)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping


def curve_x(record: Mapping[str, Any]) -> list[int]:
    """Completed rounds each curve point reflects (records before ``curve_x`` was written: 1, 2, ...)."""
    return list(record.get("curve_x") or range(1, len(record.get("curve") or []) + 1))


def bytes_axis(record: Mapping[str, Any]) -> list[float]:
    """Cumulative MB (up + down, all sites) sent before each point of the record's curve: through the rounds that
    point reflects (0 for the initial model); spread evenly over the rounds when the ledger's rounds are not numbered
    0..n-1; zeros for a row without a federation."""
    xs, traffic = curve_x(record), record.get("traffic")
    if not xs or not traffic:
        return [0.0] * len(xs)
    per_round: dict[str, float] = {}
    for rounds in traffic["per_site"].values():
        for rnd, b in rounds.items():
            per_round[rnd] = per_round.get(rnd, 0.0) + (b["up"] + b["down"]) / 1e6
    numbered = dict(sorted((int(k), v) for k, v in per_round.items() if k.lstrip("-").isdigit()))
    if numbered and sorted(numbered) == list(range(len(numbered))):
        return [sum(v for r, v in numbered.items() if r < x) for x in xs]
    total, n = sum(per_round.values()), max(record.get("rounds") or len(xs), 1)
    return [total * min(x, n) / n for x in xs]


def plot_task(records: Mapping[str, list[Mapping[str, Any]]], metric: str, title: str, path: Path) -> Path:
    """Two panels: metric vs round and metric vs cumulative MB, first seed of every method (scores in percent)."""
    import matplotlib

    from medflare.common.report import own_unit

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit = own_unit(metric) or "%"
    scale = 100.0 if unit == "%" else 1.0
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for runs in records.values():
        r = runs[0]
        curve = [scale * v for v in r.get("curve") or []]
        if not curve:
            continue
        left.plot(curve_x(r), curve, marker="o", ms=3, label=r["label"])
        if r.get("traffic"):
            right.plot(bytes_axis(r), curve, marker="o", ms=3, label=r["label"])
    left.set_xlabel("completed rounds (local/centralised: round-equivalent epochs)")
    right.set_xlabel("MB communicated, all sites, up + down")
    right.set_xscale("symlog", linthresh=0.01)
    for ax in (left, right):
        ax.set_ylabel(f"validation {metric} ({unit}, mean over sites)")
        ax.grid(alpha=0.3)
    left.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
