"""FedIOD benchmark: the paper's Tables 1, 2, 5 and 6 on the synthetic sites, and the messaging overhead of the
federated protocol.

    python benchmarks/fediod_benchmark.py --table cls      [--sites 4] [--rounds R] [--betas 1,0.1]
    python benchmarks/fediod_benchmark.py --table seg      [--sites 4] [--rounds R]
    python benchmarks/fediod_benchmark.py --table ablation [--beta 0.1]
    python benchmarks/fediod_benchmark.py --table dp       [--sigmas 0,1,4,16,64]
    python benchmarks/fediod_benchmark.py --table overhead [--windows 4]
    python benchmarks/fediod_benchmark.py --table all      (every table with the defaults: about 15 min on 2 CPU cores)
    add --paper for the paper's scale (ResNet-8, K=20, 32x32, 300 rounds; days on a CPU)

FedIOD rows run stage 1 (one teacher per site) and stage 2 in one process through the same site and server code the
FLARE job runs (:class:`medflare.fediod.distill.LocalFederation`; tests/unit/test_fediod_protocol.py shows the two give
the same generator gradients), so a table costs minutes instead of a simulator run per cell. FedAvg runs the shipped
jobs/fedavg in the FLARE simulator on the same preset (data, network, local training), centralised training is
``medflare baseline --mode central``, "standalone" is each site's teacher on the union of the sites' test splits
(Table 1's mean +- std over sites). The overhead table runs the real FLARE job. Writes ``<out>/<table>.md`` and
``<out>/<table>.json``; generated samples of each FedIOD run as PNG.
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
from typing import Any, Mapping

import torch
from torch.utils.data import ConcatDataset

from medflare.common.training import make_loader, pick_device
from medflare.data import load_site
from medflare.fediod.networks import server_networks
from medflare.fediod.config import FedIODConfig
from medflare.fediod.privacy import PrivacySettings
from medflare.fediod.samples import sample_grid
from medflare.fediod.distill import Distiller, LocalFederation, SiteInfo, steps_total
from medflare.fediod.site_distill import label_counts, site_distiller
from medflare.fediod.teacher import data_args, train_teacher
from medflare.metrics import evaluate
from medflare.presets import get_preset

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results" / "fediod"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_avg() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


# ---- one FedIOD run in one process ---------------------------------------------------------------
class Federation:
    """Sites' data and teachers for one preset (teachers trained once per preset and kept in memory)."""

    def __init__(self, preset: str, overrides: Mapping[str, Any] | None, sites: list[str], device, seed: int = 0):
        self.preset, self.overrides = preset, dict(overrides or {})
        self.cfg = get_preset(preset, overrides)
        self.sites, self.device, self.seed = sites, device, seed
        self.data = {s: load_site(s, self.cfg["data"]) for s in sites}
        self.task = next(iter(self.data.values())).task
        self.teachers = {}
        tic = time.perf_counter()
        spec = self.cfg["model"]
        for s, d in self.data.items():
            size = int(d.train[0]["image"].shape[-1])
            full = {"name": spec["name"], "args": {**spec.get("args", {}), **data_args(spec["name"], d.in_channels, d.num_classes, size)}}
            self.teachers[s], _ = train_teacher(full, self.cfg["train"], d.train, d.task, device, seed=seed)
        self.teacher_seconds = time.perf_counter() - tic
        self.infos = {s: SiteInfo(label_counts(d.train, d.task, d.num_classes), len(d.train)) for s, d in self.data.items()}

    def score(self, model, split: str = "test") -> dict[str, float]:
        """Metrics of ``model`` on the union of the sites' ``split`` (the paper's global test set)."""
        union = ConcatDataset([getattr(d, split) for d in self.data.values()])
        d0 = next(iter(self.data.values()))
        return evaluate(model, make_loader(union, 64, False), task=d0.task, num_classes=d0.num_classes,
                        metrics=self.cfg["eval"]["metrics"], device=self.device)["mean"]

    def distill(self, rounds: int, fediod: Mapping[str, Any] | None = None, privacy: PrivacySettings | None = None,
                label: str = "fediod", samples_dir: Path | None = None) -> dict[str, Any]:
        """Stage 2 for ``rounds`` rounds with ``fediod`` as further overrides of the preset's fediod section (any of its
        keys, checked as a job's overrides are); scores after each round."""
        cfg = get_preset(self.preset, {**self.overrides, "fediod": {**self.overrides.get("fediod", {}), **(fediod or {})}})
        fcfg = FedIODConfig.from_preset(cfg)
        sites = {s: site_distiller(cfg, fcfg, s, self.teachers[s], self.data[s].train, privacy, self.seed, self.device) for s in self.sites}
        nets = server_networks(cfg, fcfg, self.seed)
        labels = None
        if self.task == "segmentation":
            aux = load_site(fcfg.label_source, cfg["data"])
            labels = torch.stack([aux.train[i]["label"] for i in range(len(aux.train))]).long()
        dist = Distiller(nets.generator, nets.student, fcfg, self.task, self.cfg["data"]["num_classes"],
                         total_steps=steps_total(rounds, fcfg), label_maps=labels, device=self.device, seed=self.seed)
        dist.set_sites(self.infos)
        fed = LocalFederation(sites)
        curve, tic = [], time.perf_counter()
        key = self.cfg["eval"]["key_metric"]
        for rnd in range(rounds):
            for _ in range(fcfg.windows_per_round):
                dist.run_window(fed)
            nets.student.eval()
            curve.append(self.score(nets.student, "val")[key])
            nets.student.train()
            if len(fed.stopped) == len(sites):
                break
        nets.student.eval()
        out = {"label": label, "rounds": rnd + 1, "steps": dist.steps, "seconds": time.perf_counter() - tic,
               "test": self.score(nets.student), "curve": curve,
               "epsilon": {s: site.epsilon() for s, site in sites.items()}, "stopped": dict(fed.stopped)}
        if samples_dir is not None:
            from PIL import Image

            window = dist.preview(16, self.seed)
            grid = sample_grid(window.inputs()[0], window.labels()[0] if window.y is not None else None)
            samples_dir.mkdir(parents=True, exist_ok=True)
            Image.fromarray(grid.transpose(1, 2, 0)).save(samples_dir / f"{label}.png")
        log(f"{label}: {out['test']} after {out['steps']} steps ({out['seconds']:.0f} s, load {load_avg()})")
        return out

    def standalone(self) -> dict[str, float]:
        """Each teacher on the union test set: mean and std over sites of the key metric (Table 1 'Standalone')."""
        key = self.cfg["eval"]["key_metric"]
        values = [self.score(t)[key] for t in self.teachers.values()]
        return {"mean": statistics.mean(values), "std": statistics.pstdev(values), "per_site": dict(zip(self.teachers, values))}


# ---- baselines ------------------------------------------------------------------------------------
def fedavg(preset: str, overrides, sites: list[str], rounds: int, fed: Federation) -> dict[str, float]:
    """jobs/fedavg in the FLARE simulator with the same preset; its final global model on the union test set."""
    from medflare.common.results import load_result
    from medflare.report.runner import run_job

    with tempfile.TemporaryDirectory() as tmp:
        run = run_job("fedavg", Path(tmp), sites, preset=preset, overrides=overrides,
                      workflow_args={"num_rounds": rounds, "num_clients": len(sites)}, timeout=3600)["run"]
        if run.returncode != 0:
            raise RuntimeError(run.log[-3000:])
        model = load_result(run.app_server / "FL_global_model.pt").networks["model"]
        return fed.score(model)


def central(preset: str, overrides, sites: list[str], epochs: int, fed: Federation) -> dict[str, float]:
    from medflare.baselines.standalone import run_standalone

    result = run_standalone("central", preset, sites, epochs=epochs, overrides=overrides, log=lambda m: None)
    return result["global"]


# ---- tables ---------------------------------------------------------------------------------------
def fmt(x: float, pct: bool = True) -> str:
    return f"{100 * x:.2f}" if pct else f"{x:.2f}"


def table_cls(args, device) -> dict:
    rows, md = {}, ["| Method | Model-agnostic | Prerequisite | " + " | ".join(f"Dir({b})" for b in args.betas) + " |", "|---|---|---|" + "---|" * len(args.betas)]
    preset = args.cls_preset
    for beta in args.betas:
        ov = {"data": {"beta": beta, "num_sites": args.sites}}
        fed = Federation(preset, ov, sites_of(args.sites), device)
        res = {"standalone": fed.standalone(), "fediod": fed.distill(args.rounds, samples_dir=args.out / "samples", label=f"fediod_beta{beta}")}
        epochs = args.rounds  # FedAvg / centralised: as many passes over the data as FedIOD has rounds
        res["fedavg"] = fedavg(preset, {**ov, "train": {"epochs": 1}}, sites_of(args.sites), epochs, fed)
        res["central"] = central(preset, ov, sites_of(args.sites), epochs, fed)
        rows[beta] = res
    def cell(beta, name):
        r = rows[beta][name]
        if name == "standalone":
            return f"{fmt(r['mean'])} +- {fmt(r['std'])}"
        return fmt((r["test"] if name == "fediod" else r)["accuracy"])
    for name, agnostic, pre in (("standalone", "-", "-"), ("fedavg", "no", "-"), ("central", "-", "all data in one place"), ("fediod", "yes", "none")):
        md.append(f"| {name} | {agnostic} | {pre} | " + " | ".join(cell(b, name) for b in args.betas) + " |")
    return {"rows": rows, "markdown": "\n".join(md)}


def table_seg(args, device) -> dict:
    preset = args.seg_preset
    ov = {}
    fed = Federation(preset, ov, sites_of(args.sites, seg=True), device)
    res = {"standalone": {s: fed.score(t) for s, t in fed.teachers.items()},
           "fediod": fed.distill(args.seg_rounds, samples_dir=args.out / "samples", label="fediod_seg")["test"]}
    res["fedavg"] = fedavg(preset, {"train": {"epochs": 1}}, sites_of(args.sites, seg=True), args.seg_rounds, fed)
    res["central"] = central(preset, ov, sites_of(args.sites, seg=True), args.seg_rounds, fed)
    keys = ("dice", "sensitivity", "specificity", "hd95")
    md = ["| | Dice(%) | Sens.(%) | Spec.(%) | HD95(pixel) |", "|---|---|---|---|---|"]
    sa = {k: [m[k] for m in res["standalone"].values()] for k in keys}
    md.append("| Standalone | " + " | ".join(f"{fmt(statistics.mean(sa[k]), k != 'hd95')} +- {fmt(statistics.pstdev(sa[k]), k != 'hd95')}" for k in keys) + " |")
    for name in ("central", "fedavg", "fediod"):
        md.append(f"| {name} | " + " | ".join(fmt(res[name][k], k != "hd95") for k in keys) + " |")
    return {"rows": res, "markdown": "\n".join(md)}


ABLATIONS = {  # Table 6: L_gan weighting, the L_mimic ensemble, L_conf, L_unique; our BN prior and replay (not in the paper)
    "L_gan avg, no L_conf/L_unique, ensemble *": {"gan_weighting": "uniform", "ensemble": "labels", "lambda_conf": 0, "lambda_unique": 0},
    "L_gan Eq.2, no L_conf/L_unique, ensemble *": {"ensemble": "labels", "lambda_conf": 0, "lambda_unique": 0},
    "L_gan Eq.2, Eq.8, no L_conf/L_unique": {"lambda_conf": 0, "lambda_unique": 0},
    "L_gan Eq.2, Eq.8, L_conf": {"lambda_unique": 0},
    "L_gan Eq.2, Eq.8, L_unique": {"lambda_conf": 0},
    "L_gan Eq.2, Eq.8, L_conf, L_unique (FedIOD)": {},
    "FedIOD + the teachers' BN prior (lambda_bn 10)": {"lambda_bn": 10.0},
    "FedIOD, Algorithm 1's one student step per batch (no replay)": {"student_steps": 1, "replay_size": 0},
}


def _replay_cell(overrides) -> str:
    if "student_steps" not in overrides:
        return "preset"
    return f"{overrides['student_steps']} ({overrides.get('replay_size', 0)})"


def table_ablation(args, device) -> dict:
    fed = Federation(args.cls_preset, {"data": {"beta": args.beta, "num_sites": args.sites}}, sites_of(args.sites), device)
    rows = {name: fed.distill(args.rounds, fediod=ov, label=name)["test"]["accuracy"] for name, ov in ABLATIONS.items()}
    md = ["| L_gan weighting | L_mimic ensemble | L_conf | L_unique | lambda_bn | student steps (replay) | Acc. (%) |",
          "|---|---|---|---|---|---|---|"]
    for name, ov in ABLATIONS.items():
        md.append(f"| {'Avg' if ov.get('gan_weighting') == 'uniform' else 'Eq.2'} | {'*' if ov.get('ensemble') == 'labels' else 'Eq.8'} | "
                  f"{'x' if ov.get('lambda_conf') == 0 else 'yes'} | {'x' if ov.get('lambda_unique') == 0 else 'yes'} | "
                  f"{ov.get('lambda_bn', 'preset')} | {_replay_cell(ov)} | {fmt(rows[name])} |")
    return {"rows": rows, "markdown": "\n".join(md)}


def table_dp(args, device) -> dict:
    fed = Federation(args.cls_preset, {"data": {"beta": args.dp_beta, "num_sites": args.sites}}, sites_of(args.sites), device)
    rows = {}
    md = ["| noise multiplier | clip | epsilon (delta 1e-5) | protects | Acc. (%) |", "|---|---|---|---|---|"]
    for sigma in args.sigmas:
        privacy = PrivacySettings(noise_multiplier=sigma, clip_norm=args.clip, noise_outputs=args.noise_outputs) if sigma > 0 else \
            PrivacySettings(clip_norm=args.clip)
        r = fed.distill(args.rounds, privacy=privacy, label=f"sigma{sigma}")
        eps = max(r["epsilon"].values())
        rows[sigma] = {"epsilon": eps, "accuracy": r["test"]["accuracy"]}
        md.append(f"| {sigma} | {args.clip} | {'inf' if sigma == 0 else f'{eps:.4g}'} | {privacy.scope} | {fmt(r['test']['accuracy'])} |")
    return {"rows": rows, "markdown": "\n".join(md)}


def table_overhead(args, device) -> dict:
    """(federated step wall time) / (the same step in one process), default job preset, steady-state windows."""
    from medflare.jobs.customize import customize_job
    from medflare.jobs.simulate import run_simulator

    preset, sites = args.cls_preset, sites_of(args.sites)
    fed = Federation(preset, {"data": {"num_sites": args.sites}}, sites, device)
    fcfg = FedIODConfig.from_preset(fed.cfg)
    single = fed.distill(1, fediod={"windows_per_round": args.windows}, label="one process")
    single_step = single["seconds"] / single["steps"]
    with tempfile.TemporaryDirectory() as tmp:
        job = customize_job(REPO / "jobs" / "fediod", Path(tmp) / "job", preset=preset,
                            overrides={"data": {"num_sites": args.sites}, "fediod": {"windows_per_round": args.windows}},
                            workflow_args={"num_rounds": 2, "validate_every": 0, "num_samples": 0})
        run = run_simulator(job, Path(tmp) / "ws", len(sites), clients=sites, timeout=3600,
                            local_files={"medflare_site.json": {"fediod": {"checkpoint_dir": str(Path(tmp) / "teachers")}}})
        if run.returncode != 0:
            raise RuntimeError(run.log[-3000:])
        # the second round's wall time (stage 1 and start-up excluded), from the controller's round log
        times = [float(line.split(" steps, ")[1].split(" s;")[0]) for line in run.log.splitlines() if "steps, " in line and " s; losses" in line]
    fed_step = times[-1] / (args.windows * fcfg.steps_per_window)
    md = ["| steps per window (M) | one process s/step | FLARE s/step | ratio | load average |", "|---|---|---|---|---|",
          f"| {fcfg.steps_per_window} | {single_step:.3f} | {fed_step:.3f} | {fed_step / single_step:.2f} | {load_avg()} |"]
    return {"rows": {"single_step": single_step, "federated_step": fed_step, "ratio": fed_step / single_step,
                     "steps_per_window": fcfg.steps_per_window}, "markdown": "\n".join(md)}


def sites_of(n: int, seg: bool = False) -> list[str]:
    return [f"site-{i}" for i in range(1, n + 1)]


TABLES = {"cls": table_cls, "seg": table_seg, "ablation": table_ablation, "dp": table_dp, "overhead": table_overhead}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table", default="all", choices=[*TABLES, "all"])
    p.add_argument("--sites", type=int, default=4)
    p.add_argument("--rounds", type=int, default=8, help="FedIOD rounds (classification)")
    p.add_argument("--seg-rounds", type=int, default=6)
    p.add_argument("--betas", default="1,0.1")
    p.add_argument("--beta", type=float, default=0.1, help="ablation split")
    p.add_argument("--dp-beta", type=float, default=1.0)
    p.add_argument("--sigmas", default="0,1,4,16,64")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--noise-outputs", action="store_true")
    p.add_argument("--windows", type=int, default=4, help="windows per round in the overhead table")
    p.add_argument("--cls-preset", default="fediod_cls")
    p.add_argument("--seg-preset", default="fediod_seg")
    p.add_argument("--paper", action="store_true", help="paper scale: fediod_cls_paper / fediod_seg_paper, 20 sites, 300 rounds")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    args.betas = [float(b) for b in args.betas.split(",")]
    args.sigmas = [float(s) for s in args.sigmas.split(",")]
    if args.paper:
        args.cls_preset, args.seg_preset, args.sites, args.rounds, args.seg_rounds = "fediod_cls_paper", "fediod_seg_paper", 20, 300, 400
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    device = pick_device(args.device)
    for name in (TABLES if args.table == "all" else [args.table]):
        tic = time.perf_counter()
        log(f"table {name} (load {load_avg()})")
        result = TABLES[name](args, device)
        result["seconds"] = time.perf_counter() - tic
        result["load_average"] = load_avg()
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=2, default=float))
        (args.out / f"{name}.md").write_text(result["markdown"] + "\n")
        print(f"\n## {name} ({result['seconds']:.0f} s, load {load_avg()})\n{result['markdown']}\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
