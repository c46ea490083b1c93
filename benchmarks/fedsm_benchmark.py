"""FedSM on the synthetic non-IID sites: the paper's Table 3 layout, gamma and lambda sweeps, unseen sites (Table 5), traffic.

    python benchmarks/fedsm_benchmark.py [--sites 6] [--rounds 10] [--preset seg_synthetic]
        [--parts fedsm,extra,lambda,unseen] [--lambdas 0.3,0.5,0.9] [--gammas 0,1e-12,...,1 (the job's grid)]
        [--extra-rounds 10] [--held-out site-6] [--baselines fedavg,central | none | FILE.json]
        [--out benchmarks/results/fedsm]

Parts (each one or more FLARE simulator runs of jobs/fedsm as shipped, only preset, rounds, lambda and
extra_rounds changed):
    fedsm    FedSM (lambda 0.7): its super model on every site's test split at every gamma (gamma 1 = the global
             model alone), each personalised model on its own site, the selector's site identification, and the
             bytes each site sent and received per round, by part and data kind
    extra    FedSM-extra (--extra-rounds rounds of the selector head on Eq. 1 labels), at the job's gamma and at 0
    lambda   FedSM at each --lambdas value (paper Table 7; 0.7 comes from the fedsm part)
    unseen   for each --held-out site: FedSM trained without it, evaluated on it at every gamma (Dice and how often
             each model was chosen: paper Table 5), next to the seen sites at the job's gamma
Baseline rows: ``--baselines`` lists methods of compare_baselines.py to run now (fedavg, fedprox, scaffold, local,
central), or names its results.json to reuse (same setting), or ``none``.
Writes table.md, results.json and curves.png to --out.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_baselines import FL_JOBS, plot_curves, run_fl, run_standalone_row, score_sites  # noqa: E402

from medflare.common.report import markdown_table  # noqa: E402
from medflare.common.training import make_loader  # noqa: E402
from medflare.data import load_site  # noqa: E402
from medflare.fedsm.routing import selection_frequency  # noqa: E402
from medflare.fedsm.persistor import SUPER_MODEL_FILE  # noqa: E402
from medflare.fedsm.results import load_super_model  # noqa: E402
from medflare.fedsm.routing import DEFAULT_GAMMA, gamma_text  # noqa: E402
from medflare.fedsm.scoring import GAMMA_GRID  # noqa: E402
from medflare.presets import get_preset  # noqa: E402
from medflare.report.runner import run_job  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


#: each run's server line on the gamma it chose from its sites' validation cases, by run name (the seen / unseen table)
GAMMA_CHOICES: dict[str, str] = {}
#: each run's server lines with every site's own sweep (seen / left out per gamma), by run name
SWEEP_LINES: dict[str, list[str]] = {}
#: the unseen sweep's row of the thresholds per site a run chose (its last word is the gamma column of the table)
PER_SITE_ROW = "gamma chosen-per-site"


def run_fedsm(name: str, sites: list[str], rounds: int, preset: str, work: Path, lam: float = 0.7, extra_rounds: int = 0,
              overrides: dict[str, Any] | None = None, seed: int | None = None):
    """Run jobs/fedsm on ``sites`` (preset ``overrides`` beside the part's own FedSM settings; ``seed``: the job's seed,
    None = the job's own); returns (super model, validation curve, seconds, traffic of the first site)."""
    overrides = overrides or {}
    overrides = {**overrides, "fedsm": {**overrides.get("fedsm", {}), "softpull_lambda": lam, "extra_rounds": extra_rounds}}
    run = run_job("fedsm", work / name, sites, preset=preset, timeout=7200, workflow_args={"num_rounds": rounds},
                  overrides=overrides, seed=seed)["run"]
    server_log = run.workspace / "server" / "log.txt"
    text = server_log.read_text() if server_log.is_file() else ""
    chosen = re.findall(r"(?:one gamma for all sites|gamma per site), chosen on .*", text)
    if chosen:
        GAMMA_CHOICES[name] = " / ".join(chosen)
    SWEEP_LINES[name] = re.findall(r"gamma sweep of .*", text)
    model_file = run.app_server / SUPER_MODEL_FILE
    if run.returncode != 0 or not model_file.is_file():
        raise RuntimeError(f"{name} failed:\n{run.log[-3000:]}")
    scalars = run.scalars()
    key = get_preset(preset)["eval"]["key_metric"]
    # Sites score what they receive, so round r's value is that of r completed rounds (r = 0: initial models).
    curve = [sum(dict(scalars[s][f"val/own_or_global_{key}"]).get(r, float("nan")) for s in sites) / len(sites) for r in range(rounds + extra_rounds)]
    return load_super_model(model_file), curve, run.seconds, traffic(run.log, sites[0])


def traffic(log: str, site: str) -> dict[str, Any]:
    """Bytes ``site`` received and sent in each round (the controller's log lines) and its reply's parts by kind."""
    rounds: dict[int, dict[str, Any]] = {}
    # the server's line: "round R TASK: SITE sent <bytes to the site> B, received <bytes from the site> B"
    for rnd, task, to_site, from_site in re.findall(rf"round (\d+) (\w+): {re.escape(site)} sent (\d+) B, received (\d+) B", log):
        rounds[int(rnd)] = {"task": task, "server_to_site": int(to_site), "site_to_server": int(from_site)}
    for rnd, parts in re.findall(rf"round (\d+): {re.escape(site)} sent ((?:\w+ \w+ \d+ B(?:, )?)+)", log):
        rounds.setdefault(int(rnd), {})["parts"] = {name: {"kind": kind, "bytes": int(b)} for name, kind, b in re.findall(r"(\w+) (\w+) (\d+) B", parts)}
    return rounds


@torch.no_grad()
def site_identification(sm, sites: list[str], preset: str) -> dict[str, float]:
    """Share of each seen site's test cases whose most typical site (the selector's argmax) is that site."""
    cfg = get_preset(preset)
    out = {}
    for site in sites:
        if site not in sm.sites:
            continue
        d = load_site(site, cfg["data"])
        hits = total = 0
        for batch in make_loader(d.test, cfg["train"]["batch_size"], False):
            hits += int((sm.selector(batch["image"]).argmax(1) == sm.sites.index(site)).sum())
            total += batch["image"].shape[0]
        out[site] = hits / max(total, 1)
    return out


def super_row(sm, sites: list[str], preset: str, gamma) -> dict[str, Any]:
    """Test table of the super model at ``gamma`` (one for all, or one per site) with its selection frequencies."""
    table = score_sites(None, sites, preset, predict=sm.predictor(gamma))
    table["selection"] = {s: selection_frequency(c, sm.sites) for s, c in table.pop("choices").items()}
    return table


def super_rows(sm, sites: list[str], preset: str, gammas: list[float]) -> dict[str, dict[str, Any]]:
    """Test table of the super model at each gamma (with selection frequencies) and of the personalised models."""
    rows = {f"gamma {gamma}": super_row(sm, sites, preset, gamma) for gamma in gammas}
    own = {s: score_sites(sm.person_models[sm.sites.index(s)], [s], preset) for s in sites if s in sm.sites}
    if own:
        rows["personalised (own)"] = {
            "sites": {s: t["sites"][s] for s, t in own.items()},
            "client_average": {k: sum(t["sites"][s][k] for s, t in own.items()) / len(own) for k in next(iter(own.values()))["client_average"]},
            "global": {},
        }
    return rows


def selection_md(rows: dict[str, dict[str, Any]], site: str, key: str) -> str:
    cols = list(next(iter(rows.values()))["selection"][site])
    lines = [f"| gamma | {key} | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 2)]
    for name, t in rows.items():
        if "selection" in t:
            f = t["selection"][site]
            lines.append(f"| {name.split()[-1]} | {100 * t['sites'][site][key]:.2f} | " + " | ".join(f"{100 * f[c]:.1f}" for c in cols) + " |")
    return "\n".join(lines)


def _chosen_line(unseen: dict[str, Any], held_out: str, key: str) -> str:
    """What the run chose as its super model's gamma from its sites' validation cases, and what that scores on the
    held-out site (jobs/fedsm/README.md, "Choosing gamma")."""
    gamma = unseen.get("chosen_gamma")
    if gamma is None:
        return "(this run predates the gamma chosen from validation)"
    per_site = not isinstance(gamma, (int, float))
    row = unseen["sweep"].get(PER_SITE_ROW if per_site else f"gamma {float(gamma)}")
    score = f"{100 * row['sites'][held_out][key]:.2f}" if row else "not in the sweep"
    best = max((t["sites"][held_out][key], name.split()[-1]) for name, t in unseen["sweep"].items() if "sites" in t)
    return (f"The run chose {gamma_text(gamma, unseen['train_sites'])} from its sites' validation cases (seen and left out one at a time): "
            f"{key} {score} on {held_out}; the sweep's best on it is gamma {best[1]} ({100 * best[0]:.2f})."
            + (f" The server's line: `{unseen['gamma_choice']}`" if unseen.get("gamma_choice") else ""))


def traffic_md(rounds: dict[int, dict[str, Any]]) -> str:
    lines = ["| round | task | server -> site (B) | site -> server (B) | parts of the reply (kind, B) |", "|---|---|---|---|---|"]
    for r, t in sorted(rounds.items()):
        parts = ", ".join(f"{n}: {p['kind']} {p['bytes']:,}" for n, p in t.get("parts", {}).items())
        lines.append(f"| {r} | {t.get('task', '')} | {t.get('server_to_site', 0):,} | {t.get('site_to_server', 0):,} | {parts} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sites", type=int, default=6)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--preset", default="seg_synthetic")
    p.add_argument("--parts", default="fedsm,extra,lambda,unseen")
    p.add_argument("--lambdas", default="0.3,0.5,0.9")
    p.add_argument("--gammas", default=",".join(f"{g:g}" for g in GAMMA_GRID), help="thresholds of the sweeps (default: the job's grid)")
    p.add_argument("--extra-rounds", type=int, default=10)
    p.add_argument("--held-out", default="", help="comma-separated sites for the unseen part (default: the last site)")
    p.add_argument("--baselines", default="none", help="methods to run (fedavg,fedprox,scaffold,local,central), a results.json, or none")
    p.add_argument("--seed", type=int, default=None, help="the jobs' seed (model initialisation, data order)")
    p.add_argument("--overrides", default="{}", help="JSON preset overrides of every FedSM run, e.g. "
                   "'{\"train\": {\"epochs\": 1}}' (the baselines keep the preset)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "fedsm"))
    args = p.parse_args(argv)
    common = {"overrides": json.loads(args.overrides), "seed": args.seed}  # every FedSM run of every part
    sites = [f"site-{i}" for i in range(1, args.sites + 1)]
    gammas = [float(g) for g in args.gammas.split(",")]
    parts = args.parts.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    key = get_preset(args.preset)["eval"]["key_metric"]
    results: dict[str, Any] = {"rows": {}, "sweeps": {}, "seconds": {}, "traffic": {}, "identification": {}}
    rows = results["rows"]
    log = lambda m: print(m, flush=True)  # noqa: E731
    job_gamma = f"gamma {DEFAULT_GAMMA}"

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if "fedsm" in parts:
            sm, curve, sec, traf = run_fedsm("fedsm", sites, args.rounds, args.preset, work, **common)
            sweep = super_rows(sm, sites, args.preset, sorted(set(gammas) | {DEFAULT_GAMMA}))
            results["sweeps"]["gamma"] = sweep
            results["traffic"]["fedsm"] = traf
            results["identification"]["fedsm"] = site_identification(sm, sites, args.preset)
            rows[f"FedSM (lambda 0.7, {job_gamma})"] = {**sweep[job_gamma], "curve": curve, "curve_x": list(range(len(curve))), "seconds": sec}
            rows["FedSM personalised, each site its own"] = sweep["personalised (own)"]
            rows["FedSM global model (gamma 1)"] = sweep.get("gamma 1.0", {})
            log(f"fedsm: {sec:.0f} s, super client average {rows[f'FedSM (lambda 0.7, {job_gamma})']['client_average']}")
        if "extra" in parts:
            sm, curve, sec, traf = run_fedsm("fedsm_extra", sites, args.rounds, args.preset, work, extra_rounds=args.extra_rounds, **common)
            table = super_rows(sm, sites, args.preset, [DEFAULT_GAMMA, 0.0])
            results["traffic"]["fedsm_extra"] = traf
            rows[f"FedSM-extra ({args.extra_rounds} head rounds, {job_gamma})"] = {**table[job_gamma], "curve": curve, "curve_x": list(range(len(curve))), "seconds": sec}
            rows[f"FedSM-extra ({args.extra_rounds} head rounds, gamma 0)"] = table["gamma 0.0"]
            log(f"fedsm-extra: {sec:.0f} s, client average {table[job_gamma]['client_average']}")
        if "lambda" in parts:
            for lam in [float(x) for x in args.lambdas.split(",")]:
                sm, curve, sec, _ = run_fedsm(f"fedsm_lam{lam}", sites, args.rounds, args.preset, work, lam=lam, **common)
                results["sweeps"].setdefault("lambda", {})[lam] = {**super_rows(sm, sites, args.preset, [DEFAULT_GAMMA])[job_gamma], "seconds": sec}
                log(f"lambda {lam}: {sec:.0f} s, client average {results['sweeps']['lambda'][lam]['client_average']}")
        if "unseen" in parts:
            for held_out in (args.held_out.split(",") if args.held_out else [sites[-1]]):
                train_sites = [s for s in sites if s != held_out]
                sm, _, sec, _ = run_fedsm(f"fedsm_without_{held_out}", train_sites, args.rounds, args.preset, work, **common)
                sweep = super_rows(sm, [held_out], args.preset, gammas)
                sweep.pop("personalised (own)", None)
                if not isinstance(sm.info["gamma"], (int, float)):  # the thresholds per site the run chose
                    sweep[PER_SITE_ROW] = super_row(sm, [held_out], args.preset, sm.info["gamma"])
                seen = super_rows(sm, train_sites, args.preset, [DEFAULT_GAMMA, 1.0])
                results["sweeps"].setdefault("unseen", {})[held_out] = {"sweep": sweep, "seen": seen, "seconds": sec,
                                                                          "identification": site_identification(sm, train_sites, args.preset),
                                                                          "chosen_gamma": sm.info["gamma"], "train_sites": sm.sites,
                                                                          "gamma_choice": GAMMA_CHOICES.get(f"fedsm_without_{held_out}"),
                                                                          "site_sweeps": SWEEP_LINES.get(f"fedsm_without_{held_out}", [])}
                log(f"unseen {held_out}: {sec:.0f} s")

        if args.baselines not in ("", "none"):
            if Path(args.baselines).is_file():
                rows.update(json.loads(Path(args.baselines).read_text()))
            else:
                for method in args.baselines.split(","):
                    rows[method] = (run_fl(method, sites, args.rounds, args.preset, work) if method in FL_JOBS
                                    else run_standalone_row(method, sites, args.rounds, args.preset))
                    log(f"{method}: client average {rows[method]['client_average']}")

    md = [f"Test {key} (x100), {args.sites} synthetic sites, {args.rounds} rounds, preset {args.preset}", "",
          markdown_table({k: v for k, v in rows.items() if v}, metric=key)]
    if "gamma" in results["sweeps"]:
        md += ["", "Gamma sweep of the FedSM super model (gamma 1 = global model only):", "",
               markdown_table({k: v for k, v in results["sweeps"]["gamma"].items() if k.startswith("gamma")}, metric=key),
               "", "Share of each site's test cases sent to its own personalised model, per gamma (%):", ""]
        md += ["| gamma | " + " | ".join(sites) + " |", "|" + "---|" * (len(sites) + 1)]
        for name, t in results["sweeps"]["gamma"].items():
            if "selection" in t:
                md.append(f"| {name.split()[-1]} | " + " | ".join(f"{100 * t['selection'][s][s]:.1f}" for s in sites) + " |")
        ident = results["identification"]["fedsm"]
        md += ["", "Selector site identification on the test splits (argmax typicality = own site, %): "
               + ", ".join(f"{s} {100 * v:.1f}" for s, v in ident.items())]
    for name, traf in results["traffic"].items():
        md += ["", f"Bytes {sites[0]} exchanged per round ({name}; arrays only, before serialisation):", "", traffic_md(traf)]
    if "lambda" in results["sweeps"]:
        md += ["", f"Lambda sweep (super model, {job_gamma}):", "",
               markdown_table({f"lambda {k}": v for k, v in results["sweeps"]["lambda"].items()}, metric=key)]
    for held_out, u in results["sweeps"].get("unseen", {}).items():
        md += ["", f"Unseen site {held_out} (trained without it): test {key} and selection frequency (%) per gamma:", "",
               selection_md(u["sweep"], held_out, key),
               "", _chosen_line(u, held_out, key),
               "", f"The seen sites of that run at {job_gamma} and gamma 1 (global model):", "",
               markdown_table({k: v for k, v in u["seen"].items() if k.startswith("gamma")}, metric=key),
               "", "Own-model share of the seen sites at the job's gamma (%): "
               + ", ".join(f"{s} {100 * u['seen'][job_gamma]['selection'][s][s]:.1f}" for s in u["seen"][job_gamma]["selection"])]
    (out / "table.md").write_text("\n".join(md) + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=2, default=float))
    curves = {k: v for k, v in rows.items() if v.get("curve")}
    if curves:
        plot_curves(curves, out / "curves.png", key)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
