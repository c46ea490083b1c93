"""FedVCK vs FedAvg, FedProx, SCAFFOLD, local and centralised on the synthetic classification sites; Table 4 ablations;
upload bytes per site and round against FedAvg's model size; condensation wall time per site and round.

    python benchmarks/fedvck_benchmark.py [--sites 10] [--rounds 10] [--betas 0.05,0.02] [--preset fedvck_synthetic]
        [--methods fedvck,no_lrc,no_pw,no_latent,fedavg,fedprox,scaffold,local,central] [--overrides JSON]
        [--out benchmarks/results/fedvck]

Every method sees the same sites (Dir(beta) label skew over ``--sites`` sites, the preset's synthetic pool), the same
network and the same number of rounds. The federated jobs run in the FLARE simulator exactly as shipped in jobs/
(only preset, overrides, rounds and site count changed; FedVCK's ablations only flip one key of the preset's
``fedvck`` section):

    fedvck     FedVCK as shipped
    no_lrc     w/o L_rc              (fedvck.contrastive_weight = 0)
    no_pw      w/o P_w               (fedvck.importance = false: uniform real batches)
    no_latent  w/o latent constraints (fedvck.latent_constraints = false: each batch with its own BN statistics)
    no_lrc_pw  w/o L_rc and P_w, the paper's "w.o. L_rc + P_w" row
    no_all     w/o all three (FedDM-like distribution matching), the paper's "w.o. all" row

Local-only and centralised train the preset's network with its ``train`` section for ``rounds x train.epochs`` epochs.
Accuracy is that of the final model on every site's test split: ``global`` pools every test image (the 10 sites'
test splits together are nearly class-balanced, like the paper's global test set), ``client avg`` weighs sites
equally. Upload bytes and condensation times are read from the FedVCK run's TensorBoard scalars (what the server
received after the sites' filters; ``time/condense_s`` per site). Writes table.md and results.json to --out.
The machine's load average is recorded with every run (timings on a shared CPU are noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_baselines import run_fl, run_standalone_row, score_sites  # noqa: E402

from medflare.common.payload import nbytes, state_to_numpy  # noqa: E402
from medflare.common.persistence import model_from_preset  # noqa: E402
from medflare.common.results import load_result  # noqa: E402
from medflare.fedvck.persistor import RESULT_FILE  # noqa: E402
from medflare.presets import get_preset  # noqa: E402
from medflare.report.runner import run_job  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ABLATIONS = {
    "fedvck": {},
    "no_lrc": {"contrastive_weight": 0.0},
    "no_pw": {"importance": False},
    "no_latent": {"latent_constraints": False},
    "no_lrc_pw": {"contrastive_weight": 0.0, "importance": False},
    "no_all": {"contrastive_weight": 0.0, "importance": False, "latent_constraints": False},
}
LABELS = {"fedvck": "FedVCK", "no_lrc": "FedVCK w/o L_rc", "no_pw": "FedVCK w/o P_w", "no_latent": "FedVCK w/o latent constraints",
          "no_lrc_pw": "FedVCK w/o L_rc + P_w", "no_all": "FedVCK w/o all (FedDM-like)", "fedavg": "FedAvg", "fedprox": "FedProx", "scaffold": "SCAFFOLD",
          "local": "local only", "central": "centralised"}


def merge(base: dict, extra: dict) -> dict:
    out = json.loads(json.dumps(base))
    for k, v in extra.items():
        out[k] = merge(out.get(k, {}), v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def run_fedvck(name: str, sites: list[str], rounds: int, preset: str, overrides: dict, work: Path) -> dict[str, Any]:
    """One FedVCK simulator run; the test table of its final global model, traffic and condensation times."""

    load_before = os.getloadavg()[0]
    run = run_job("fedvck", work / name, sites, preset=preset, overrides=overrides, workflow_args={"num_rounds": rounds},
                  timeout=4 * 3600)["run"]
    result_file = run.app_server / RESULT_FILE
    if run.returncode != 0 or not result_file.is_file() or "EXECUTION_EXCEPTION" in run.log:
        raise RuntimeError(f"{name} failed:\n{run.log[-3000:]}")
    result = load_result(result_file)
    table = score_sites(result.networks["global"], sites, preset, overrides=overrides)
    scalars = run.scalars()
    server = next(v for k, v in scalars.items() if k not in sites)
    upload = [v for s in sites for _, v in server.get(f"upload_bytes/{s}", [])]
    condense_s = [v for s in sites for _, v in scalars.get(s, {}).get("time/condense_s", [])]
    pooled = dict(server.get("val_accuracy_pooled", []))
    table.update(
        seconds=run.seconds, load=[load_before, os.getloadavg()[0]],
        curve=[pooled.get(r, float("nan")) for r in range(rounds)], curve_x=list(range(rounds)),
        upload_bytes={"mean": statistics.fmean(upload), "max": max(upload), "min": min(upload)} if upload else {},
        condense_s={"mean": statistics.fmean(condense_s), "median": statistics.median(condense_s), "max": max(condense_s)} if condense_s else {},
        update_s=statistics.fmean(v for _, v in server.get("time/update_s", [])) if server.get("time/update_s") else None,
        audit=copy_audit(result, sites, preset, overrides),
    )
    return table


def copy_audit(result, sites: list[str], preset: str, overrides: dict) -> dict[str, float]:
    """Nearest-real-image RMS distance of every condensed image of the last kept round (to its own site's training
    images) against the sites' own spacing (median distance of a real image to its nearest other one)."""
    from medflare.data import load_site
    from medflare.fedvck.audit import nearest_distances
    from medflare.fedvck.condense import stack_dataset

    data = get_preset(preset, overrides)["data"]
    last = result.condensed[max(result.condensed, key=int)]
    ratios, dists, spacings = [], [], []
    for site, part in last.items():
        if not len(part["labels"]):
            continue
        real, _ = stack_dataset(load_site(site, data).train)
        d = nearest_distances(part["images"].float() / 255.0, real)
        spacing = float(nearest_distances(real, real, exclude_self=True).median())
        dists += d.tolist()
        spacings.append(spacing)
        ratios.append(float(d.min()) / spacing)
    return {"min_distance": min(dists), "median_distance": statistics.median(dists), "median_spacing": statistics.median(spacings),
            "min_ratio": min(ratios), "images": len(dists)}


def row_cells(row: dict[str, Any]) -> tuple[str, str]:
    return f"{100 * row['global']['accuracy']:.2f}", f"{100 * row['client_average']['accuracy']:.2f}"


def write_tables(rows: dict[str, dict[str, dict[str, Any]]], args, model_bytes: int, out: Path) -> str:
    betas = list(rows)
    lines = [f"Test accuracy x100 of the final model, {args.sites} sites, {args.rounds} rounds, preset {args.preset}"
             + (f", overrides {args.overrides}" if args.overrides else "") + "; global = pooled test images (client avg)", "",
             "| method | " + " | ".join(f"Dir({b}) global (client avg)" for b in betas) + " |", "|---|" + "---|" * len(betas)]
    methods = [m for m in LABELS if any(m in rows[b] for b in betas)]
    for m in methods:
        cells = [("{} ({})".format(*row_cells(rows[b][m])) if m in rows[b] else "-") for b in betas]
        lines.append(f"| {LABELS[m]} | " + " | ".join(cells) + " |")
    lines += ["", f"FedAvg uploads the whole model per site and round: {model_bytes:,} B (float32).", "",
              "| run | upload B/site/round mean (min-max) | x FedAvg | condensation s/site/round mean (max) | server update s/round | wall s | load avg start-end |",
              "|---|---|---|---|---|---|---|"]
    for b in betas:
        for m in methods:
            r = rows[b].get(m, {})
            if "upload_bytes" not in r:
                continue
            up, cs = r["upload_bytes"], r["condense_s"]
            lines.append(f"| {LABELS[m]}, Dir({b}) | {up['mean']:,.0f} ({up['min']:,.0f}-{up['max']:,.0f}) | {up['mean'] / model_bytes:.3f} | "
                         f"{cs['mean']:.1f} ({cs['max']:.1f}) | {r['update_s']:.1f} | {r['seconds']:.0f} | {r['load'][0]:.1f}-{r['load'][1]:.1f} |")
    lines += ["", "Condensed images vs the real images of their own site (last round; RMS pixel distance in [0, 1] units; a copy would be <= 0.002):", "",
              "| run | condensed images | nearest-real distance min (median) | real spacing median | min / spacing |", "|---|---|---|---|---|"]
    for b in betas:
        for m in methods:
            a = rows[b].get(m, {}).get("audit")
            if a:
                lines.append(f"| {LABELS[m]}, Dir({b}) | {a['images']} | {a['min_distance']:.3f} ({a['median_distance']:.3f}) | "
                             f"{a['median_spacing']:.3f} | {a['min_ratio']:.2f} |")
    text = "\n".join(lines) + "\n"
    (out / "table.md").write_text(text)
    (out / "results.json").write_text(json.dumps(rows, indent=2, default=float))
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sites", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--betas", default="0.05,0.02", help="Dirichlet concentrations of the label skew")
    parser.add_argument("--preset", default="fedvck_synthetic")
    parser.add_argument("--overrides", default="", help='JSON merged into the preset for every method, e.g. \'{"fedvck": {"iterations": 20}}\'')
    parser.add_argument("--methods", default="fedvck,no_lrc,no_pw,no_latent,fedavg,fedprox,scaffold,local,central")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "fedvck"))
    args = parser.parse_args(argv)
    sites = [f"site-{i}" for i in range(1, args.sites + 1)]
    base = json.loads(args.overrides) if args.overrides else {}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_bytes = nbytes(state_to_numpy(model_from_preset(args.preset, base or None)))
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    if (out / "results.json").is_file():  # resume: keep what an earlier (interrupted) run measured
        rows = json.loads((out / "results.json").read_text())
    for beta in args.betas.split(","):
        overrides = merge(base, {"data": {"beta": float(beta), "num_sites": args.sites}})
        rows.setdefault(beta, {})
        for method in args.methods.split(","):
            if method in rows[beta]:
                print(f"Dir({beta}) {method}: kept from {out / 'results.json'}", flush=True)
                continue
            tic = time.perf_counter()
            with tempfile.TemporaryDirectory() as tmp:
                if method in ABLATIONS:
                    ov = merge(overrides, {"fedvck": ABLATIONS[method]}) if ABLATIONS[method] else overrides
                    rows[beta][method] = run_fedvck(method, sites, args.rounds, args.preset, ov, Path(tmp))
                elif method in ("fedavg", "fedprox", "scaffold"):
                    rows[beta][method] = run_fl(method, sites, args.rounds, args.preset, Path(tmp), overrides=overrides)
                else:
                    rows[beta][method] = run_standalone_row(method, sites, args.rounds, args.preset, overrides=overrides)
            print(f"Dir({beta}) {method}: global accuracy {rows[beta][method]['global']['accuracy']:.4f} "
                  f"({time.perf_counter() - tic:.0f} s, load {os.getloadavg()[0]:.1f})", flush=True)
            write_tables(rows, args, model_bytes, out)
    print(write_tables(rows, args, model_bytes, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
