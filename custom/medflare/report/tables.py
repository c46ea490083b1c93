"""REPORT.md, report.csv and report.json from the rows' records (no FLARE, no torch: plain data in, text out).

One table per task (and label skew for classification), one line per method: the key metric per site, its client
average (sites weighted equally) and global value (cases weighted equally), HD95 for segmentation, then what the
method cost: bytes per site and round up (site -> server) in task results and on every channel (task results,
analytics events, aux messages: the egress recorder's count), and down, the total over the job (every channel up,
task data down), what left the sites on every channel (the task results' kinds, the analytics events' types, any
other channel that carried arrays), wall time, FLARE overhead, peak memory of the largest site process, and epsilon where DP was
on. Each line names its seeds (a long run may have more for its cheap rows than for its costly ones); with several
seeds a cell is mean +- standard deviation over seeds, and a federated method whose client average is
within the larger of the two spreads of the best federated method's is marked ``~`` (not distinguishable at this
many seeds). Local and centralised rows are references, not candidates: centralised training is the ceiling no
consortium can pick, and local-only rows are scored on each site's own test split.
"""

from __future__ import annotations

import csv
import io
import json
import statistics
from collections import defaultdict
from typing import Any, Iterable, Mapping

from medflare.presets import assignments_from_overrides

SEG_KEY, CLS_KEY = "dice", "accuracy"


def devices(records: Iterable[Mapping[str, Any]]) -> str:
    """What the records' training ran on (``cpu``, ``GPU <name>``, comma-separated when they differ)."""
    return ", ".join(sorted({r.get("device", "cpu") for r in records})) or "cpu"


def key_metric(task: str) -> str:
    return SEG_KEY if task == "seg" else CLS_KEY


def group(records: Iterable[Mapping[str, Any]]) -> dict[tuple[str, Any], dict[str, list[Mapping[str, Any]]]]:
    """``{(task, skew): {method: [record per seed]}}`` in the order the records come."""
    out: dict[tuple[str, Any], dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        out[(r["task"], r.get("skew"))][r["method"]].append(r)
    return out


def _mean_sd(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if v is not None and v == v]
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summary_row(runs: list[Mapping[str, Any]]) -> dict[str, Any]:
    """One method's numbers over its seeds (means; ``*_sd`` the spread)."""
    task = runs[0]["task"]
    key = key_metric(task)
    row: dict[str, Any] = {"method": runs[0]["method"], "label": runs[0]["label"], "seeds": [r["seed"] for r in runs]}
    sites = runs[0]["sites"]
    for s in sites:
        row[f"{key}/{s}"], _ = _mean_sd([r["scores"]["sites"].get(s, {}).get(key) for r in runs])
    row["client_average"], row["client_average_sd"] = _mean_sd([r["scores"]["client_average"].get(key) for r in runs])
    row["global"], row["global_sd"] = _mean_sd([r["scores"]["global"].get(key) for r in runs])
    if task == "seg":
        row["hd95"], _ = _mean_sd([r["scores"]["client_average"].get("hd95") for r in runs])
    traffic = [r["traffic"] for r in runs if r.get("traffic")]
    row["up_B_per_site_round"] = _mean_sd([t["per_site_round"]["up"] for t in traffic])[0] if traffic else 0.0
    row["down_B_per_site_round"] = _mean_sd([t["per_site_round"]["down"] for t in traffic])[0] if traffic else 0.0
    row["total_MB"] = _mean_sd([(t["total"]["up"] + t["total"]["down"]) / 1e6 for t in traffic])[0] if traffic else 0.0
    # every channel a site sent on (task results, analytics events, aux messages), where the run was audited
    audited = [t for t in traffic if t.get("egress")]
    row["up_all_B_per_site_round"] = _mean_sd([t["egress"]["per_site_round"] for t in audited
                                               if t["egress"]["per_site_round"] is not None])[0] if audited else 0.0
    row["total_all_MB"] = _mean_sd([(t["egress"]["total"] + t["total"]["down"]) / 1e6 for t in audited])[0] if audited else 0.0
    row["sent"] = what_left(traffic[0]) if traffic else "nothing (no federation)"
    row["federated"] = bool(traffic)  # a standalone (local / centralised) row sends nothing
    row["wall_s"], _ = _mean_sd([r["seconds"] for r in runs])
    row["overhead_s"], _ = _mean_sd([r["overhead_s"] for r in runs])
    peaks = [max(v for k, v in r["peak_mb"].items() if k != "server") for r in runs if any(k != "server" for k in r.get("peak_mb", {}))]
    row["peak_site_MB"] = max(peaks) if peaks else float("nan")
    eps = [max(r["epsilon"].values()) for r in runs if r.get("epsilon")]
    row["epsilon"] = max(eps) if eps else None
    row["load"] = [round(x, 1) for r in runs for x in r.get("load", [])]
    row["device"] = devices(runs)
    row.update(compute_cells(runs))
    return row


def compute_cells(runs: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Optimisation steps per round (every site's summed, and the server's) and seconds of compute (the sites' task
    time, the server's training time where streamed), means over seeds; None where no run has it on its record
    (:mod:`medflare.report.compute`; a standalone row, a record made before steps were streamed)."""
    out: dict[str, Any] = {}
    for key in ("site_steps_per_round", "server_steps_per_round", "site_s", "server_s"):
        values = [r["compute"][key] for r in runs if (r.get("compute") or {}).get(key) is not None]
        out[key] = _mean_sd(values)[0] if values else None
    return out


def mark_ties(rows: list[dict[str, Any]]) -> None:
    """``tie`` = a federated method's client average is within the spread of the best federated method's (several
    seeds only); local / centralised rows are never the best nor marked."""
    for r in rows:
        r["tie"] = False
    scored = [r for r in rows if r["federated"] and r["client_average"] == r["client_average"]]
    if not scored:
        return
    best = max(scored, key=lambda r: r["client_average"])
    for r in scored:
        spread = max(r["client_average_sd"], best["client_average_sd"])
        r["tie"] = r is not best and len(r["seeds"]) > 1 and spread > 0 and best["client_average"] - r["client_average"] <= spread


def what_left(traffic: Mapping[str, Any]) -> str:
    """What the sites sent on every channel: the task results' part kinds, then ``analytics: <types>`` and any other
    channel whose messages carried arrays; from the task-result meter alone (kinds only) for a run not audited."""
    egress = traffic.get("egress")
    if not egress:
        return ", ".join(traffic["kinds"]["up"])
    out = [", ".join(egress["kinds"]) or "no task results"]
    if egress["events"]:
        out.append("analytics: " + ", ".join(egress["events"]))
    if egress.get("other"):
        out.append("also " + ", ".join(egress["other"]))
    return "; ".join(out)


def _pct(v: float, sd: float | None = None) -> str:
    if v != v:
        return "-"
    return f"{100 * v:.2f}" + (f" +- {100 * sd:.2f}" if sd else "")


def _bytes(v: float) -> str:
    return "-" if not v else (f"{v / 1e6:.2f} MB" if v >= 1e6 else f"{v / 1e3:.1f} kB")


def markdown(rows: list[dict[str, Any]], task: str, sites: list[str]) -> str:
    key = key_metric(task)
    # scores in percent, the unit in the header; "all cases" pools every site's test cases (JSON key "global")
    head = ["method", "seeds", *(f"{s} {key} (%)" for s in sites), f"client avg {key} (%)", f"all cases {key} (%)"] + (
        ["HD95 (px)"] if task == "seg" else []) + [
        "up / site / round (task results)", "up / site / round (every channel)", "down / site / round",
        "total (every channel up, task data down)", "what left the sites (every channel)", "wall s", "FLARE overhead s",
        "peak MB / site", "epsilon", "steps / round (sites + server)", "compute s (sites + server)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["label"] + (" ~" if r.get("tie") else ""), ", ".join(map(str, r["seeds"]))]
        cells += [_pct(r[f"{key}/{s}"]) for s in sites]
        cells += [_pct(r["client_average"], r["client_average_sd"]), _pct(r["global"], r["global_sd"])]
        if task == "seg":
            cells.append("-" if r["hd95"] != r["hd95"] else f"{r['hd95']:.2f}")
        gpu = " (GPU)" if "GPU" in r.get("device", "cpu") else ""  # timings on a GPU are marked as GPU figures
        cells += [_bytes(r["up_B_per_site_round"]), _bytes(r.get("up_all_B_per_site_round", 0.0)), _bytes(r["down_B_per_site_round"]),
                  "-" if not r.get("total_all_MB") else f"{r['total_all_MB']:.2f} MB", r["sent"], f"{r['wall_s']:.0f}{gpu}",
                  f"{r['overhead_s']:.0f}{gpu}", "-" if r["peak_site_MB"] != r["peak_site_MB"] else f"{r['peak_site_MB']:.0f}",
                  _epsilon(r["epsilon"]), _pair(r.get("site_steps_per_round"), r.get("server_steps_per_round")),
                  _pair(r.get("site_s"), r.get("server_s"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _pair(site: float | None, server: float | None) -> str:
    """``sites + server`` (``-`` for a part not on the record; ``-`` alone when neither is)."""
    if site is None and server is None:
        return "-"
    return " + ".join("-" if v is None else f"{v:.0f}" for v in (site, server))


def _epsilon(eps: float | None) -> str:
    """'-' where no site's result carries an epsilon; 'inf (no noise)' where a site sent outputs computed from its
    data without DP noise (FedIOD with the site's noise multiplier 0)."""
    if eps is None:
        return "-"
    return "inf (no noise)" if eps == float("inf") else f"{eps:.3g}"


def to_csv(rows: list[dict[str, Any]]) -> str:
    names = list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=names)
    writer.writeheader()
    for r in rows:
        writer.writerow({k: (json.dumps(v) if isinstance(v, (list, dict)) else v) for k, v in r.items()})
    return buf.getvalue()


def describe_setting(runs: Mapping[str, list[Mapping[str, Any]]]) -> str:
    """The line above a table: sites, rounds, local epochs, seeds, mode, presets."""
    first = next(iter(runs.values()))[0]
    seeds = sorted({r["seed"] for rs in runs.values() for r in rs})
    presets = sorted({r["preset"] for rs in runs.values() for r in rs})
    epochs = sorted({r["local_epochs"] for rs in runs.values() for r in rs if r.get("local_epochs") is not None})
    common = min(r["rounds"] for rs in runs.values() for r in rs)  # the report's; a job's own schedule only adds rounds
    other = [f"{rs[0].get('label', name)} {rs[0]['rounds']}" for name, rs in runs.items() if rs[0]["rounds"] != common]
    return (f"Sites {', '.join(first['sites'])}; {common} rounds" + (f" ({', '.join(other)}: the job's own schedule)" if other else "")
            + " (local/centralised: the same number of passes "
            f"over the data); local epochs per round {', '.join(map(str, epochs))}; seeds {', '.join(map(str, seeds))}; "
            f"{first['mode']} mode; presets {', '.join(presets)}" + _settings_note(runs) + ".")


def _settings_note(runs: Mapping[str, list[Mapping[str, Any]]]) -> str:
    """``medflare report --set`` as the rows ran with it (``--set data.scale=0.25``), or "" when none was given."""
    found = {json.dumps(r.get("settings") or {}, sort_keys=True) for rs in runs.values() for r in rs}
    notes = [" ".join(assignments_from_overrides(json.loads(f))) for f in sorted(found) if f != "{}"]
    if not notes:
        return ""
    where = "in every row" if len(found) == 1 else "in some rows (they ran on different settings)"
    return f", with {' / '.join(f'--set {n}' for n in notes)} {where}"
