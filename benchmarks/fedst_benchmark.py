"""FedST-separate and FedST-join vs FedAvg, FedProx, SCAFFOLD and FedSM on sites of inverted contrast (the paper's
CT vs MR setting, Table 1), a 6-site run, communication cost vs number of sites (Fig. 9c), generator quality per
sampler, and time per round.

    python benchmarks/fedst_benchmark.py [--preset fedst] [--rounds 8] [--parts pair,six,comm,quality]
        [--pair site-1,site-2] [--sites 6] [--methods fedavg,fedprox,scaffold,fedsm,fedst_separate,fedst_join]
        [--six-methods fedavg,fedst_separate,fedst_join] [--comm-sites 2,3,4] [--quality-steps 10,20,50]
        [--seed 0] [--out benchmarks/results/fedst]

The reduced run of benchmarks/RESULTS_fedst.md uses ``--preset fedst_small`` (32x32); the full one is the default
``--preset fedst`` (64x64, the job as shipped) or ``fedst_paper`` on a GPU.

Parts (each method one FLARE simulator run of its job folder as shipped; only preset, rounds and sites changed;
every method uses the same preset: segmentation network, focal + Dice loss, optimiser, epochs per round):
    pair     --pair sites (default site-1, bright, and site-2, inverted CT-like): every --methods row, test VI / Dice /
             MPA per site of the final segmentation model (FedSM: its super model at gamma 0.9), validation curves,
             seconds, and FedST's time per round (generator training, sampling, segmentation) from the sites' logs
    six      site-1..site-N (--sites): the --six-methods rows
    comm     FedST-separate and FedST-join on --comm-sites site counts with the preset's networks but minimal training
             (one generator step, 2 label maps drawn): bytes measured by the server's ledger vs the formula, then
             extrapolated to 200 sites at 50 rounds with Eq. 4 (Fig. 9c)
    quality  the generator alone (no FLARE): DDPM (epsilon, Eq. 2) with DDIM sampling vs rectified flow at several
             sampling steps, scored by a segmentation model trained on the real images of the generator's site
             (Dice against the label maps the images were drawn from, and against shuffled ones = chance)
--seed goes to every job (the recipes' ``seed``: model initialisation, data order, generator noise and sampling) and
to the quality part's models; the data sets stay the preset's. Writes table.md, results.json, comm.png and curves.png to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_baselines import FL_JOBS, plot_curves, run_fl, score_sites  # noqa: E402
from fedsm_benchmark import run_fedsm  # noqa: E402

from medflare.common.training import make_loader, make_loss, make_optimizer, train_epochs  # noqa: E402
from medflare.data import load_site  # noqa: E402
from medflare.fedst import comm  # noqa: E402
from medflare.fedst.config import DiffusionConfig  # noqa: E402
from medflare.fedst.diffusion import (build_style_generator, cycle, generator_args, generator_optimizer,  # noqa: E402
                                      sample_images, sampling_scheduler, train_generator, training_scheduler)
from medflare.fedst.persistor import FILE_OF  # noqa: E402
from medflare.fedst.results import load_fedst_result  # noqa: E402
from medflare.metrics import dice  # noqa: E402
from medflare.metrics.site_mean import label_classes, site_mean  # noqa: E402
from medflare.nets import build_from_spec  # noqa: E402
from medflare.presets import get_preset  # noqa: E402
from medflare.report.runner import run_job  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TIMES = ("time/generator_train_s", "time/generator_step_s", "time/sample_s", "time/seg_train_s", "time/validate_s")


def run_fedst(variant: str, sites: list[str], rounds: int, preset: str, work: Path, overrides: dict | None = None,
              tag: str = "", seed: int | None = None) -> dict[str, Any]:
    """Run jobs/fedst_<variant> (``seed``: the job's seed, None = the job's own); returns the test table of its
    segmentation model, its curve, ledger and timings."""
    name = f"fedst_{variant}{tag}"
    run = run_job(f"fedst_{variant}", work / name, sites, preset=preset, overrides=overrides,
                  workflow_args={"num_rounds": rounds}, seed=seed, timeout=6 * 3600)["run"]
    path = run.app_server / FILE_OF[variant]
    if run.returncode != 0 or not path.is_file() or "EXECUTION_EXCEPTION" in run.log:
        raise RuntimeError(f"{name} failed:\n{run.log[-3000:]}")
    scalars = run.scalars()
    key = get_preset(preset, overrides)["eval"]["key_metric"]
    steps = sorted({step for s in sites for step, _ in scalars[s].get(f"val_global/{key}", [])})
    curve = [float(np.mean([dict(scalars[s][f"val_global/{key}"]).get(r, np.nan) for s in sites])) for r in steps]
    timing = {t: {s: float(np.mean([v for _, v in scalars[s][t]])) for s in sites if t in scalars[s]} for t in TIMES}
    table = score_sites(load_fedst_result(path).segmentation, sites, preset) if overrides is None else {}
    ledger = json.loads((run.app_server / "communication.json").read_text())
    return {**table, "curve": curve, "curve_x": list(range(len(curve))), "seconds": run.seconds, "timing": timing,
            "communication": ledger["summary"], "per_site_round_bytes": ledger["per_site_round"]}


def run_method(method: str, sites: list[str], rounds: int, preset: str, work: Path, seed: int | None = None) -> dict[str, Any]:
    tic = time.perf_counter()
    if method in FL_JOBS:
        row = run_fl(method, sites, rounds, preset, work, seed=seed)
    elif method == "fedsm":
        sm, curve, seconds, _ = run_fedsm("fedsm", sites, rounds, preset, work, seed=seed)
        row = {**score_sites(None, sites, preset, predict=sm.predictor(0.9)), "curve": curve, "curve_x": list(range(len(curve))),
               "seconds": seconds}
        row.pop("choices", None)
    else:
        row = run_fedst(method.split("_", 1)[1], sites, rounds, preset, work, seed=seed)
    print(f"{method} on {sites}: client average {row['client_average']} ({time.perf_counter() - tic:.0f} s)", flush=True)
    return row


def comm_part(site_counts: list[int], preset: str, work: Path, seed: int | None = None) -> dict[str, Any]:
    """Measured generator / segmentation bytes per variant and site count (minimal training, same networks)."""
    quick = {"diffusion": {"warmup_steps": 1, "steps_per_round": 1, "warmup_rounds": 1, "num_synthetic": 2}}
    out: dict[str, Any] = {}
    for k in site_counts:
        sites = [f"site-{i}" for i in range(1, k + 1)]
        for variant in ("separate", "join"):
            row = run_fedst(variant, sites, 2, preset, work, overrides=quick, tag=f"_comm{k}", seed=seed)
            out.setdefault(variant, {})[k] = row["communication"]
            print(f"comm {variant} K={k}: {row['communication']}", flush=True)
    return out


def comm_extrapolation(generator_bytes: int, rounds: int = 50, max_sites: int = 200) -> dict[str, list]:
    ks = list(range(2, max_sites + 1))
    return {"sites": ks, "separate": [comm.separate_generator_bytes(k, generator_bytes) for k in ks],
            "join": [comm.join_generator_bytes(k, rounds, generator_bytes) for k in ks],
            "join_paper": [comm.paper_join_bytes(k, rounds, generator_bytes) for k in ks]}


def plot_comm(ext: dict[str, list], measured: dict[str, Any], path: Path, rounds: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    gb = 1024 ** 3
    ax.plot(ext["sites"], np.array(ext["separate"]) / gb, label="separate: c^2 G")
    ax.plot(ext["sites"], np.array(ext["join"]) / gb, label=f"join: 2 c m G (m={rounds})")
    ax.plot(ext["sites"], np.array(ext["join_paper"]) / gb, ls="--", label="join, Eq. 4 counting: c (2m+1) G")
    for variant, marker in (("separate", "o"), ("join", "s")):
        pts = measured.get(variant, {})
        if pts:  # measured at 2 rounds: scale join to m rounds per the formula's per-round cost (2 c G per round)
            xs = sorted(int(k) for k in pts)
            ys = [pts[k]["measured_generator_bytes"] / gb if variant == "separate"
                  else pts[k]["measured_generator_bytes"] / pts[k]["generator_rounds"] * rounds / gb for k in xs]
            ax.scatter(xs, ys, marker=marker, zorder=3, label=f"{variant}, measured (K={xs})")
    ax.set_xlabel("number of sites c")
    ax.set_ylabel("generator traffic of the whole job (GiB)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def quality_part(preset: str, style: str, labels_of: str, configs: list[tuple[str, int]], train_steps: int, seed: int = 0) -> dict[str, Any]:
    """Generator quality per (scheduler, sampling steps): Dice of a model trained on ``style``'s real images on images
    drawn in ``style`` from ``labels_of``'s label maps, vs the drawn-from label maps and vs shuffled ones."""
    cfg = get_preset(preset)
    styled, labelled = load_site(style, cfg["data"]), load_site(labels_of, cfg["data"])
    real = [styled.train[i] for i in range(len(styled.train))] + [styled.val[i] for i in range(len(styled.val))]
    torch.manual_seed(seed)
    seg = build_from_spec(cfg["model"])
    train_epochs(seg, make_loader(real, cfg["train"]["batch_size"], True), make_loss(cfg["train"]["loss"], "segmentation"),
                 make_optimizer("adam", seg.parameters(), cfg["train"]["lr"]), epochs=30)
    seg.eval()
    test_x = torch.stack([styled.test[i]["image"] for i in range(len(styled.test))])
    test_y = torch.stack([styled.test[i]["label"] for i in range(len(styled.test))])
    labels = torch.stack([labelled.train[i]["label"] for i in range(len(labelled.train))])

    def score(images, target):
        with torch.no_grad():
            pred = seg(images).argmax(1, keepdim=True)
            return site_mean(dice(pred, target, styled.num_classes), label_classes(target, styled.num_classes)).mean

    out: dict[str, Any] = {"real_test_dice": score(test_x, test_y), "rows": {}}
    trained: dict[str, Any] = {}
    for scheduler, steps in configs:
        dcfg = DiffusionConfig.from_preset(cfg).replace(scheduler=scheduler)
        if scheduler not in trained:
            torch.manual_seed(seed)
            gen = build_style_generator(generator_args(dcfg, styled.in_channels, styled.num_classes))
            tic = time.perf_counter()
            losses = train_generator(gen, training_scheduler(dcfg), generator_optimizer(gen, dcfg),
                                     cycle(lambda e: make_loader(styled.train, dcfg.batch_size, True, seed=e)), train_steps)
            trained[scheduler] = (gen, time.perf_counter() - tic, losses)
        gen, train_s, losses = trained[scheduler]
        tic = time.perf_counter()
        images = sample_images(gen, sampling_scheduler(dcfg, steps), labels, seed=seed + 1, batch_size=dcfg.sample_batch)
        name = f"{scheduler} ({'DDIM' if scheduler == 'ddpm' else 'Euler'}) {steps} steps"
        out["rows"][name] = {"dice_matched": score(images, labels), "dice_shuffled": score(images, labels.roll(1, dims=0)),
                             "sample_s": time.perf_counter() - tic, "train_s": train_s, "loss_first": float(np.mean(losses[:20])),
                             "loss_last": float(np.mean(losses[-20:]))}
        print(f"quality {name}: {out['rows'][name]}", flush=True)
    return out


def table1(rows: dict[str, dict[str, Any]], sites: list[str]) -> str:
    """Table 1 layout: VI (lower is better), Dice and MPA per site and their client average (x100 for Dice/MPA)."""
    head = "| method | " + " | ".join(f"{s} VI | {s} Dice | {s} MPA" for s in [*sites, "average"]) + " |"
    lines = [head, "|" + "---|" * (1 + 3 * (len(sites) + 1))]
    for method, row in rows.items():
        if "sites" not in row:
            continue
        cells = []
        for s in [*sites, "average"]:
            m = row["client_average"] if s == "average" else row["sites"][s]
            cells += [f"{m.get('vi', float('nan')):.4f}", f"{100 * m['dice']:.2f}", f"{100 * m.get('mpa', float('nan')):.2f}"]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="fedst")
    p.add_argument("--rounds", type=int, default=None, help="segmentation rounds (default: the preset's fedst.rounds)")
    p.add_argument("--parts", default="pair,six,comm,quality")
    p.add_argument("--pair", default="site-1,site-2")
    p.add_argument("--sites", type=int, default=6)
    p.add_argument("--methods", default="fedavg,fedprox,scaffold,fedsm,fedst_separate,fedst_join")
    p.add_argument("--six-methods", default="fedavg,fedst_separate,fedst_join")
    p.add_argument("--comm-sites", default="2,3,4")
    p.add_argument("--quality-steps", default="10,20,50")
    p.add_argument("--quality-train-steps", type=int, default=None, help="generator steps (default: the preset's warmup_steps)")
    p.add_argument("--seed", type=int, default=0, help="every job's seed (model initialisation, data order, "
                   "generator noise and sampling; the jobs as shipped use 0) and the quality part's")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "fedst"))
    args = p.parse_args(argv)
    rounds = args.rounds or int(get_preset(args.preset).get("fedst", {}).get("rounds", 10))
    parts = args.parts.split(",")
    pair = args.pair.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_file = out / "results.json"
    results: dict[str, Any] = json.loads(results_file.read_text()) if results_file.is_file() else {}
    results["setting"] = {"preset": args.preset, "rounds": rounds, "pair": pair, "sites": args.sites, "seed": args.seed}

    def save():
        results_file.write_text(json.dumps(results, indent=2, default=float))

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if "pair" in parts:
            results["pair"] = {m: run_method(m, pair, rounds, args.preset, work, args.seed) for m in args.methods.split(",")}
            save()
        if "six" in parts:
            six = [f"site-{i}" for i in range(1, args.sites + 1)]
            results["six"] = {m: run_method(m, six, rounds, args.preset, work / "six", args.seed) for m in args.six_methods.split(",")}
            save()
        if "comm" in parts:
            results["comm"] = comm_part([int(k) for k in args.comm_sites.split(",")], args.preset, work / "comm", args.seed)
            save()
    if "quality" in parts:
        steps = [int(s) for s in args.quality_steps.split(",")]
        train_steps = args.quality_train_steps or get_preset(args.preset)["diffusion"]["warmup_steps"]
        results["quality"] = quality_part(args.preset, pair[1], pair[0], [(s, n) for s in ("ddpm", "rflow") for n in steps], train_steps,
                                         seed=args.seed)
        results["quality"]["train_steps"] = train_steps
        save()

    md = [f"# FedST benchmark (preset {args.preset}, {rounds} segmentation rounds, seed {args.seed})", ""]
    if "pair" in results:
        md += [f"## Two sites of inverted contrast ({', '.join(pair)}): test metrics of the final model", "",
               table1(results["pair"], pair), ""]
        plot_curves({k: v for k, v in results["pair"].items() if v.get("curve")}, out / "curves.png", "dice")
    if "six" in results:
        six = [f"site-{i}" for i in range(1, args.sites + 1)]
        md += [f"## {len(six)} sites", "", table1(results["six"], six), ""]
    if "comm" in results:
        g = next(iter(results["comm"]["separate"].values()))["generator_bytes_each"]
        ext = comm_extrapolation(int(g))
        results["comm_extrapolation"] = ext
        plot_comm(ext, results["comm"], out / "comm.png", 50)
        md += ["## Communication (generator bytes, measured vs formula)", "", "| variant | sites | rounds | measured | predicted |", "|---|---|---|---|---|"]
        for variant, per_k in results["comm"].items():
            for k, s in sorted(per_k.items(), key=lambda kv: int(kv[0])):
                md.append(f"| {variant} | {k} | {s.get('generator_rounds', s['segmentation_rounds'])} | {s['measured_generator_bytes']} | {s['predicted_generator_bytes']} |")
        md.append("")
        save()
    if "quality" in results:
        q = results["quality"]
        md += [f"## Generator quality ({q['train_steps']} training steps; real test Dice of the scoring model {q['real_test_dice']:.3f})", "",
               "| sampler | Dice vs drawn-from labels | Dice vs shuffled labels | sampling s |", "|---|---|---|---|"]
        md += [f"| {n} | {r['dice_matched']:.3f} | {r['dice_shuffled']:.3f} | {r['sample_s']:.1f} |" for n, r in q["rows"].items()]
    (out / "table.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
