"""FedSM vs FedSM-extra vs the baselines on the synthetic non-IID sites; lambda and gamma sweeps; unseen site.

    python benchmarks/fedsm_benchmark.py [--sites 6] [--rounds 10] [--preset seg_synthetic]
        [--parts fedsm,extra,lambda,unseen] [--lambdas 0.3,0.5,0.9] [--gammas 0,0.5,0.7,0.9,0.99,1]
        [--baselines benchmarks/results/baselines/results.json | run] [--out benchmarks/results/fedsm]

Parts (each one or more FLARE simulator runs of jobs/fedsm as shipped, only preset, rounds, lambda and
extra_rounds changed):
    fedsm    FedSM (lambda 0.7), its super model scored on every site's test split at every gamma
             (gamma sweep; gamma 1 = the global model alone); also the personalised models alone
    extra    FedSM-extra (one extra round: K+1 selector head from Eq. 1 labels, routed by argmax)
    lambda   FedSM at each --lambdas value (paper Table 7; 0.7 comes from the fedsm part)
    unseen   FedSM trained without the last site, evaluated on it at every gamma: Dice and how often each
             model was selected (paper Table 5)
Baseline rows (FedAvg, FedProx, SCAFFOLD, local, central) are read from compare_baselines.py's
results.json when the setting is its default (seg_synthetic, 6 sites, 10 rounds) or, with ``--baselines run``, recomputed with its functions.
Writes table.md, results.json and curves.png to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_baselines import FL_JOBS, plot_curves, run_fl, run_standalone_row, score_sites  # noqa: E402

from medflare.testing.jobconfig import customize_job  # noqa: E402
from medflare.common.report import markdown_table  # noqa: E402
from medflare.testing.simrun import run_simulator  # noqa: E402
from medflare.fedsm.routing import selection_frequency  # noqa: E402
from medflare.fedsm.supermodel import SUPER_MODEL_FILE, load_super_model  # noqa: E402
from medflare.presets import get_preset  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def run_fedsm(name: str, sites: list[str], rounds: int, preset: str, work: Path, lam: float = 0.7, extra_rounds: int = 0):
    """Run jobs/fedsm on ``sites``; returns (super model, validation super-Dice curve, seconds)."""
    folder = customize_job(REPO / "jobs" / "fedsm", work / name, preset=preset,
                           workflow_args={"num_rounds": rounds, "softpull_lambda": lam, "extra_rounds": extra_rounds})
    run = run_simulator(folder, work / f"ws_{name}", len(sites), clients=sites, timeout=3600)
    model_file = run.app_server / SUPER_MODEL_FILE
    if run.returncode != 0 or not model_file.is_file():
        raise RuntimeError(f"{name} failed:\n{run.log[-3000:]}")
    scalars = run.scalars()
    # Sites score what they receive, so round r's value is that of r completed rounds (r = 0: initial models).
    curve = [sum(dict(scalars[s]["val/super_dice"]).get(r, float("nan")) for s in sites) / len(sites) for r in range(rounds)]
    return load_super_model(model_file), curve, run.seconds


def super_rows(sm, sites: list[str], preset: str, gammas: list[float]) -> dict[str, dict[str, Any]]:
    """Test table of the super model at each gamma (with selection frequencies) and of the personalised models."""
    rows = {}
    for gamma in gammas:
        table = score_sites(None, sites, preset, predict=sm.predictor(gamma))
        table["selection"] = {s: selection_frequency(c, sm.sites) for s, c in table.pop("choices").items()}
        rows[f"gamma {gamma}"] = table
    # Each site's own personalised model on its own test split (gamma 0 with a perfect selector).
    own = {s: score_sites(sm.person_models[sm.sites.index(s)], [s], preset) for s in sites if s in sm.sites}
    if own:
        rows["personalised (own)"] = {
            "sites": {s: t["sites"][s] for s, t in own.items()},
            "client_average": {k: sum(t["sites"][s][k] for s, t in own.items()) / len(own) for k in next(iter(own.values()))["client_average"]},
            "global": {},
        }
    return rows


def selection_md(rows: dict[str, dict[str, Any]], site: str) -> str:
    cols = list(next(iter(rows.values()))["selection"][site])
    lines = ["| gamma | Dice | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 2)]
    for name, t in rows.items():
        if "selection" in t:
            f = t["selection"][site]
            lines.append(f"| {name.split()[-1]} | {100 * t['sites'][site]['dice']:.2f} | " + " | ".join(f"{100 * f[c]:.1f}" for c in cols) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sites", type=int, default=6)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--preset", default="seg_synthetic")
    p.add_argument("--parts", default="fedsm,extra,lambda,unseen")
    p.add_argument("--lambdas", default="0.3,0.5,0.9")
    p.add_argument("--gammas", default="0,0.5,0.7,0.9,0.99,1")
    p.add_argument("--baselines", default=str(REPO / "benchmarks" / "results" / "baselines" / "results.json"),
                   help="compare_baselines.py results.json to reuse, or 'run' to recompute")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "fedsm"))
    args = p.parse_args(argv)
    sites = [f"site-{i}" for i in range(1, args.sites + 1)]
    gammas = [float(g) for g in args.gammas.split(",")]
    parts = args.parts.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    key = get_preset(args.preset)["eval"]["key_metric"]
    results: dict[str, Any] = {"rows": {}, "sweeps": {}, "seconds": {}}
    rows = results["rows"]
    log = lambda m: print(m, flush=True)  # noqa: E731

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if "fedsm" in parts:
            sm, curve, sec = run_fedsm("fedsm", sites, args.rounds, args.preset, work)
            sweep = super_rows(sm, sites, args.preset, gammas)
            results["sweeps"]["gamma"] = sweep
            rows["FedSM (gamma 0.9)"] = {**sweep.get("gamma 0.9", next(iter(sweep.values()))), "curve": curve,
                                          "curve_x": list(range(len(curve))), "seconds": sec}
            rows["FedSM personalised (own)"] = sweep["personalised (own)"]
            rows["FedSM global model"] = sweep.get("gamma 1.0", {})
            log(f"fedsm: {sec:.0f} s, super client average {rows['FedSM (gamma 0.9)']['client_average']}")
        if "extra" in parts:
            sm, curve, sec = run_fedsm("fedsm_extra", sites, args.rounds, args.preset, work, extra_rounds=1)
            table = super_rows(sm, sites, args.preset, [0.0])["gamma 0.0"]  # FedSM-extra routes by argmax
            rows["FedSM-extra"] = {**table, "curve": curve, "curve_x": list(range(len(curve))), "seconds": sec}
            log(f"fedsm-extra: {sec:.0f} s, client average {table['client_average']}")
        if "lambda" in parts:
            for lam in [float(x) for x in args.lambdas.split(",")]:
                sm, curve, sec = run_fedsm(f"fedsm_lam{lam}", sites, args.rounds, args.preset, work, lam=lam)
                results["sweeps"].setdefault("lambda", {})[lam] = {**super_rows(sm, sites, args.preset, [0.9])["gamma 0.9"], "seconds": sec}
                log(f"lambda {lam}: {sec:.0f} s, client average {results['sweeps']['lambda'][lam]['client_average']}")
        if "unseen" in parts:
            held_out, train_sites = sites[-1], sites[:-1]
            sm, _, sec = run_fedsm("fedsm_unseen", train_sites, args.rounds, args.preset, work)
            results["sweeps"]["unseen"] = {"site": held_out, **super_rows(sm, [held_out], args.preset, gammas)}
            results["sweeps"]["unseen"].pop("personalised (own)", None)
            log(f"unseen {held_out}: {sec:.0f} s")

        if args.baselines == "run":
            for method in ("fedavg", "fedprox", "scaffold", "local", "central"):
                rows[method] = (run_fl(method, sites, args.rounds, args.preset, work) if method in FL_JOBS
                                else run_standalone_row(method, sites, args.rounds, args.preset))
        elif Path(args.baselines).is_file() and (args.sites, args.rounds, args.preset) == (6, 10, "seg_synthetic"):
            rows.update(json.loads(Path(args.baselines).read_text()))  # compare_baselines.py's defaults: same setting

    md = [f"Test {key} (x100), {args.sites} synthetic sites, {args.rounds} rounds, preset {args.preset}", "",
          markdown_table({k: v for k, v in rows.items() if v}, metric=key)]
    if "gamma" in results["sweeps"]:
        md += ["", "Gamma sweep of the FedSM super model (gamma 1 = global model only):", "",
               markdown_table({k: v for k, v in results["sweeps"]["gamma"].items() if k.startswith("gamma")}, metric=key)]
    if "lambda" in results["sweeps"]:
        md += ["", "Lambda sweep (super model, gamma 0.9):", "",
               markdown_table({f"lambda {k}": v for k, v in results["sweeps"]["lambda"].items()}, metric=key)]
    if "unseen" in results["sweeps"]:
        u = results["sweeps"]["unseen"]
        md += ["", f"Unseen site {u['site']} (trained without it): test Dice and selection frequency (%) per gamma:", "",
               selection_md({k: v for k, v in u.items() if k.startswith("gamma")}, u["site"])]
    (out / "table.md").write_text("\n".join(md) + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=2, default=float))
    curves = {k: v for k, v in rows.items() if v.get("curve")}
    if curves:
        plot_curves(curves, out / "curves.png", key)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
