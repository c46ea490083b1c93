"""FedAvg vs FedProx vs SCAFFOLD vs local-only vs centralised on the synthetic segmentation sites.

    python benchmarks/compare_baselines.py [--sites 6] [--rounds 10] [--preset seg_synthetic]
                                           [--out benchmarks/results/baselines]

Every method sees the same sites, preset, loss, optimiser and number of passes over the local data
(``rounds`` x ``train.epochs``). The federated jobs run in the FLARE simulator exactly as shipped in
jobs/ (only preset, rounds and site count changed); their final global model is scored on every
site's test split. Local-only trains one model per site; centralised one on the pooled training data.
Writes ``table.md`` (per-site, client-average and global Dice, the FedSM paper's Table 3 layout),
``results.json`` and ``curves.png`` (client-average validation Dice per round).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from medflare.common.results import load_result
from medflare.common.report import markdown_table, site_table
from medflare.report.runner import run_job, standalone_row
from medflare.common.training import make_loader
from medflare.data import load_site
from medflare.metrics import evaluate, unseen_classes_warning
from medflare.presets import get_preset

REPO = Path(__file__).resolve().parents[1]
FL_JOBS = ("fedavg", "fedprox", "scaffold")


def score_sites(model, sites: list[str], preset: str, split: str = "test", predict=None, overrides=None) -> dict[str, Any]:
    """``site_table`` of one model (or ``predict`` callable) evaluated on each site's ``split`` (preset + ``overrides``).

    A ``predict`` that records its routing (a FedSM super model's predictor: ``reset()``, ``choices``) adds
    ``table["choices"] = {site: [routing of every case]}``. Foreground classes a site's labels never hold are printed
    as a warning and listed in ``table["warnings"]`` (the preset's class count does not match the data).
    """
    cfg = get_preset(preset, overrides)
    per_site, choices, warnings = {}, {}, []
    for site in sites:
        d = load_site(site, cfg["data"])
        loader = make_loader(getattr(d, split), cfg["train"]["batch_size"], False)
        if hasattr(predict, "reset"):
            predict.reset()
        per_site[site] = evaluate(model, loader, task=d.task, num_classes=d.num_classes, metrics=cfg["eval"]["metrics"], predict=predict)
        warning = unseen_classes_warning(site, d.num_classes, per_site[site].get("unseen_classes", []), per_site[site]["num_cases"], split)
        if warning:
            print(warning)
            warnings.append(warning)
        if hasattr(predict, "choices"):
            choices[site] = list(predict.choices)
    table = site_table(per_site)
    if choices:
        table["choices"] = choices
    if warnings:
        table["warnings"] = warnings
    return table


def run_fl(job: str, sites: list[str], rounds: int, preset: str, work: Path, overrides=None,
           seed: int | None = None) -> dict[str, Any]:
    """Run ``jobs/<job>`` in the simulator (``seed``: the job's seed, None = the job's own); returns the test table of
    its last global model and its curve."""
    run = run_job(job, work / job, sites, preset=preset, overrides=overrides,
                  workflow_args={"num_rounds": rounds, "num_clients": len(sites)}, seed=seed, timeout=3600)["run"]
    model_file = run.app_server / "FL_global_model.pt"
    if run.returncode != 0 or not model_file.is_file():
        raise RuntimeError(f"{job} failed:\n{run.log[-3000:]}")
    scalars = run.scalars()
    key = get_preset(preset, overrides)["eval"]["key_metric"]
    curve = [
        sum(dict(scalars[s][f"val_global/{key}"]).get(r, float("nan")) for s in sites) / len(sites)
        for r in range(rounds)
    ]
    model = load_result(model_file).model
    table = score_sites(model, sites, preset, overrides=overrides)
    # Sites validate the global model they receive, so round r's score is that of r completed rounds.
    table.update(curve=curve, curve_x=list(range(rounds)), seconds=run.seconds)
    return table


def run_standalone_row(mode: str, sites: list[str], rounds: int, preset: str, overrides=None) -> dict[str, Any]:
    """Local-only or centralised with the same number of passes over the data as ``rounds`` FL rounds."""
    return standalone_row(mode, preset, sites, rounds, overrides)


def plot_curves(rows: dict[str, dict[str, Any]], path: Path, metric: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method, row in rows.items():
        ax.plot(row["curve_x"], row["curve"], marker="o", ms=3, label=method)
    ax.set_xlabel("completed rounds (FL) / round-equivalent epochs (local, central)")
    ax.set_ylabel(f"client-average validation {metric}")
    ax.set_title("Synthetic non-IID segmentation sites")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sites", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--preset", default="seg_synthetic")
    parser.add_argument("--methods", default="fedavg,fedprox,scaffold,local,central")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "baselines"))
    parser.add_argument("--replot", action="store_true", help="only redraw curves.png from results.json")
    args = parser.parse_args(argv)
    if args.replot:
        rows = json.loads((Path(args.out) / "results.json").read_text())
        plot_curves(rows, Path(args.out) / "curves.png", get_preset(args.preset)["eval"]["key_metric"])
        return 0
    sites = [f"site-{i}" for i in range(1, args.sites + 1)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods.split(","):
            tic = time.perf_counter()
            if method in FL_JOBS:
                rows[method] = run_fl(method, sites, args.rounds, args.preset, Path(tmp))
            else:
                rows[method] = run_standalone_row(method, sites, args.rounds, args.preset)
            print(f"{method}: client average {rows[method]['client_average']} ({time.perf_counter() - tic:.0f} s)", flush=True)
    key = get_preset(args.preset)["eval"]["key_metric"]
    table = markdown_table(rows, metric=key)
    (out / "table.md").write_text(
        f"Test {key} (x100), {args.sites} synthetic sites, {args.rounds} rounds, preset {args.preset}\n\n{table}\n"
    )
    (out / "results.json").write_text(json.dumps(rows, indent=2, default=float))
    plot_curves(rows, out / "curves.png", key)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
