"""PNG figures of the report: the key metric against rounds and against bytes communicated, one line per method."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping


def bytes_axis(record: Mapping[str, Any]) -> list[float]:
    """Cumulative MB (up + down, all sites) at each point of the record's curve: per measured round when the curve
    has one point per round, else spread evenly over the points; zeros for a row without a federation."""
    curve, traffic = record.get("curve") or [], record.get("traffic")
    if not curve:
        return []
    if not traffic:
        return [0.0] * len(curve)
    per_round: dict[str, float] = {}
    for rounds in traffic["per_site"].values():
        for rnd, b in rounds.items():
            per_round[rnd] = per_round.get(rnd, 0.0) + (b["up"] + b["down"]) / 1e6
    numbered = sorted((int(k), v) for k, v in per_round.items() if k.lstrip("-").isdigit())
    if len(numbered) == len(curve):
        out, acc = [], 0.0
        for _, v in numbered:
            acc += v
            out.append(acc)
        return out
    total = sum(per_round.values())
    return [total * (i + 1) / len(curve) for i in range(len(curve))]


def plot_task(records: Mapping[str, list[Mapping[str, Any]]], metric: str, title: str, path: Path) -> Path:
    """Two panels: metric vs round and metric vs cumulative MB, first seed of every method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for runs in records.values():
        r = runs[0]
        curve = r.get("curve") or []
        if not curve:
            continue
        left.plot(range(1, len(curve) + 1), curve, marker="o", ms=3, label=r["label"])
        if r.get("traffic"):
            right.plot(bytes_axis(r), curve, marker="o", ms=3, label=r["label"])
    left.set_xlabel("round (local/centralised: round-equivalent epochs)")
    right.set_xlabel("MB communicated, all sites, up + down")
    right.set_xscale("symlog", linthresh=0.01)
    for ax in (left, right):
        ax.set_ylabel(f"validation {metric} (mean over sites)")
        ax.grid(alpha=0.3)
    left.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
