"""``medflare report``: run (or reuse) every row, then write REPORT.md, report.csv, report.json and the figures."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from medflare import ConfigError
from medflare.presets import get_preset
from medflare.report.figures import plot_task
from medflare.report.methods import BASELINES, METHODS, methods_for
from medflare.report.runner import Row, record_path, run_row
from medflare.report.sends import plot_sends
from medflare.report.tables import describe_setting, devices, group, key_metric, mark_ties, markdown, summary_row, to_csv

#: quick = the 20-minute tour on a 2-core CPU; full = what the README quotes (three seeds: the tables mark what the
#: spread over seeds cannot separate)
SETTINGS = {
    "quick": {"seg": {"sites": 3, "rounds": 2}, "cls": {"sites": 4, "rounds": 2}, "skews": [0.5, 0.05], "seeds": [0]},
    "full": {"seg": {"sites": 6, "rounds": 10}, "cls": {"sites": 10, "rounds": 10}, "skews": [0.5, 0.05], "seeds": [0, 1, 2]},
}


def plan(tasks: list[str], mode: str, *, methods: list[str] | None = None, sites: list[str] | None = None,
         seeds: list[int] | None = None, rounds: int | None = None, skews: list[float] | None = None,
         match: list[str] | None = None, settings: Mapping[str, Any] | None = None) -> list[Row]:
    """Every row to run, in table order. ``match`` (``--match-compute``, short names such as ``fedvck``): after a
    task's rows, each baseline among them (:data:`~medflare.report.methods.BASELINES`) once more at each named
    method's optimisation steps per round (the named method's row is planned too when ``methods`` left it out).
    ``settings`` (``--set``, e.g. ``{"data": {"scale": 0.25}}``: every site with a quarter of its cases) are merged
    into every row's preset, after the task's shared data block; each row's preset is checked with them here, so a
    bad key stops the report before anything runs."""
    if mode not in SETTINGS:
        raise ConfigError(f"unknown mode '{mode}' (quick or full)")
    for task in tasks:
        methods_for(task)  # ConfigError for an unknown task
    refs = {task: [m for n in match or [] for m in methods_for(task, [n])] for task in tasks}
    unmatched = [n for n in match or [] if not any(methods_for(t, [n]) for t in tasks)]
    if unmatched:
        raise ConfigError(f"--match-compute {','.join(unmatched)}: no such method in task(s) {', '.join(tasks)}")
    rows = []
    for task in tasks:
        cfg = SETTINGS[mode][task]
        names = sites or [f"site-{i}" for i in range(1, cfg["sites"] + 1)]
        chosen = methods_for(task, methods)
        chosen += [m for m in refs[task] if m not in chosen]
        baselines = [m for m in chosen if m.name.removeprefix("cls_") in BASELINES]
        for skew in (skews or SETTINGS[mode]["skews"]) if task == "cls" else [None]:
            for seed in seeds or SETTINGS[mode]["seeds"]:
                rows += [Row(m, tuple(names), (rounds or cfg["rounds"]) * m.rounds_scale.get(mode, 1), mode, seed, skew,
                             settings=settings)
                         for m in chosen]
                rows += [Row(b, tuple(names), rounds or cfg["rounds"], mode, seed, skew, match=ref.name, settings=settings)
                         for ref in refs[task] for b in baselines]
    if settings:
        for row in {(r.preset, json.dumps(r.overrides, sort_keys=True)): r for r in rows}.values():
            get_preset(row.preset, row.overrides)  # ConfigError naming the preset and the key
    return rows


def report(out: Path, rows: list[Row], *, rerun: bool = False, write_only: bool = False,
           log: Callable[[str], None] = print) -> tuple[Path, list[str]]:
    """Run or reuse each row (progress on the terminal), then write the report; returns REPORT.md's path and the
    rows that failed (each logged with its error; the others go on, and a rerun resumes with the failed ones).
    ``write_only``: run nothing, write the tables from the rows that have a record and list the others as not run
    (a long full-mode run done in parts)."""
    out.mkdir(parents=True, exist_ok=True)
    records, failed, missing, start, done_s = [], [], [], time.perf_counter(), []
    for k, row in enumerate(rows, 1):
        reused = record_path(out, row).is_file() and not rerun
        if write_only and not reused:
            missing.append(row.key)
            continue
        elapsed = time.perf_counter() - start
        eta = f", about {sum(done_s) / len(done_s) * (len(rows) - k + 1) / 60:.0f} min left" if done_s else ""
        log(f"[{k}/{len(rows)}] {row.key} ({'reused' if reused else 'running'}; {elapsed / 60:.1f} min elapsed{eta})")
        tic = time.perf_counter()
        try:
            records.append(run_row(row, out, rerun=rerun, log=log))
        except Exception as e:  # noqa: BLE001 - one broken row must not cost the others; it is named and listed
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            log(f"[{k}/{len(rows)}] {row.key}: FAILED: {type(e).__name__}: {first}")
            failed.append(f"{row.key}: {type(e).__name__}: {first}")
        if not reused:
            done_s.append(time.perf_counter() - tic)
    if missing:
        log(f"{len(missing)} of {len(rows)} rows have no record yet (not run): {', '.join(missing)}")
    write(out, records, failed, missing)
    return out / "REPORT.md", failed


def write(out: Path, records: list[dict[str, Any]], failed: list[str] | None = None, missing: list[str] | None = None) -> None:
    """REPORT.md + report.csv + report.json + one PNG of curves per table from the records, and one of what the
    methods send (:mod:`medflare.report.sends`) where their runs wrote images of it."""
    parts = ["# medflare report", "",
             "Every method on the same sites, scored the same way (`medflare evaluate` on each site's test split). "
             "Bytes are payload arrays: task results and task data counted by a FLARE filter on the server, and everything "
             "each site sent on every channel (task results, analytics events, aux messages) counted by the egress "
             "recorder at the site's cell, each payload once (see docs/report.md); FLARE overhead is "
             "wall time minus the compute on the critical path (per exchange, the slowest site's time from receiving a "
             "task to its result arriving); peak memory is the largest resident size of a site's process. `~`: within the spread over seeds of the best federated method (local and centralised rows are references).",
             f"Machine: {os.cpu_count()} CPUs, training on {devices(records)}; 1-minute load during the runs "
             f"{_load_range(records)}; {describe_environments(records)}. Timings marked (GPU) were taken with a GPU and "
             "compare only with each other.", ""]
    if failed:
        parts += ["**Rows that failed** (not in the tables; the run folders under `runs/` hold their logs; rerunning "
                  "the command retries them):", "", *[f"- {f}" for f in failed], ""]
    if missing:
        parts += ["**Rows not run yet** (written with `--write-only`; the command without it runs them):", "",
                  ", ".join(missing), ""]
    all_rows = []
    for (task, skew), runs in group(records).items():
        rows = [summary_row(rs) for rs in runs.values()]
        mark_ties(rows)
        title = "Segmentation" if task == "seg" else f"Classification, Dirichlet({skew:g}) label skew"
        sites = next(iter(runs.values()))[0]["sites"]
        png = plot_task(runs, key_metric(task), title, out / f"{task}{'' if skew is None else f'_beta{skew:g}'}.png")
        parts += [f"## {title}", "", describe_setting(runs), "", compute_note(runs), "", markdown(rows, task, sites), "",
                  f"![{title}]({png.name})", ""]
        sends = plot_sends(runs, title, out / f"sends_{task}{'' if skew is None else f'_beta{skew:g}'}.png")
        if sends is not None:
            parts += [f"What the methods send (last round, first seed; FedST's panels of a site's own data are kept at "
                      f"the sites and shown only because the report runs every site locally): "
                      f"![{title}: what the methods send]({sends.name})", ""]
        for r in rows:
            r.update(task=task, skew=skew)
        all_rows += rows
    (out / "REPORT.md").write_text("\n".join(parts))
    (out / "report.csv").write_text(to_csv(all_rows))
    (out / "report.json").write_text(json.dumps({"rows": all_rows, "records": records}, indent=1, default=float))


def compute_note(runs: dict[str, list[dict[str, Any]]]) -> str:
    """The line that says which comparison a table shows: every method at its own default local work, and, where
    ``--match-compute`` ran, which baseline rows got which method's optimisation steps per round."""
    matched = sorted({(r["label"], r["steps_per_site"]) for rs in runs.values() for r in rs if r.get("match")})
    text = ("Compute: steps / round = optimisation steps per round, every site's summed + the server's (`-`: not on "
            "the record); compute s = every site's task time + the server's training time where streamed. ")
    if not matched:
        return text + "Every method runs at its own default local work (not compute-matched)."
    return text + "Matched compute (`--match-compute`): " + "; ".join(
        f"{label} ran exactly {steps} steps per site and round" for label, steps in matched) + (
        " (the named method's steps per round over sites and server, split evenly over the sites); the other rows "
        "run at their defaults.")


def describe_environments(records) -> str:
    """The environment the rows ran in (:func:`medflare.report.runner.environment`), or how many there were: scores
    reproduce to the digit only within one, so a report mixing them says so."""
    envs = {json.dumps(r["environment"], sort_keys=True) for r in records if r.get("environment")}
    if not envs:
        return "environment not recorded"
    if len(envs) > 1:
        return (f"the rows ran in {len(envs)} environments (each record's `environment`: CPU, library versions, torch "
                "threads), and scores compare to the digit only within one")
    e = json.loads(envs.pop())
    return (f"{e['cpu']}, Python {e['python']}, torch {e['torch']}, MONAI {e['monai']}, NVFlare {e['nvflare']}, "
            f"{e['torch_threads']} torch threads in the standalone rows (OMP_NUM_THREADS {e['omp_num_threads'] or 'unset'})")


def _load_range(records) -> str:
    loads = [x for r in records for x in r.get("load", [])]
    return f"{min(loads):.1f}-{max(loads):.1f}" if loads else "not recorded"


__all__ = ["METHODS", "SETTINGS", "describe_environments", "plan", "report", "write"]
