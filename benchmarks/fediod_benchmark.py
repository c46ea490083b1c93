"""FedIOD benchmark: the paper's Tables 1, 2, 5 and 6 on the synthetic sites, and the messaging overhead of the
federated protocol.

    python benchmarks/fediod_benchmark.py --table cls      [--sites 4] [--rounds R] [--betas 1,0.1]
    python benchmarks/fediod_benchmark.py --table seg      [--seg-sites 6] [--seg-rounds 10] [--seeds 0,1,2] [--variants preset,paper,preset+lambda_gan=20]
    python benchmarks/fediod_benchmark.py --table segdiag  [--seg-sites 6] [--seg-rounds R] [--variants preset,...]
    python benchmarks/fediod_benchmark.py --table ablation [--beta 0.1]
    python benchmarks/fediod_benchmark.py --table dp       [--sigmas 0,1,4,16,64]
    python benchmarks/fediod_benchmark.py --table overhead [--windows 4]
    python benchmarks/fediod_benchmark.py --table curve    [--cls-preset fediod_cls_tiny] [--sites N] [--seeds 0,1]
                                    [--curve-every 80] [--curve-steps 400] [--site2-resnet8] [--curve-data beta=0.2+scale=0.5] [--curve-train epochs=20]
                                    [--variants preset,student_steps=1+replay_size=0,lambda_bn=0]
    python benchmarks/fediod_benchmark.py --table all      (every table but curve with the defaults: about 15 min on 2 CPU cores)
    add --paper for the paper's scale (ResNet-8, K=20, 32x32, 300 rounds; days on a CPU)

FedIOD rows run stage 1 (one teacher per site) and stage 2 in one process through the same site and server code the
FLARE job runs (:class:`medflare.fediod.distill.LocalFederation`; tests/unit/test_fediod_protocol.py shows the two give
the same generator gradients), so a table costs minutes instead of a simulator run per cell. FedAvg runs the shipped
jobs/fedavg in the FLARE simulator on the same preset (data, network, local training), centralised training is
``medflare baseline --mode central``, "standalone" is each site's teacher on the union of the sites' test splits
(Table 1's mean +- std over sites). The overhead table runs the real FLARE job. The curve table is the diagnosis of
benchmarks/RESULTS_fediod.md: the student's accuracy on the union test set every K steps of one classification run, per
named change of the fediod settings and seed, beside the teachers' and their label-weighted ensemble's accuracy (the
numbers that justify the classification presets' deviations from the paper). Writes ``<out>/<table>.md`` and
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
from medflare.fediod.losses import aggregate, ensemble_weights, label_ratio
from medflare.fediod.site_distill import label_counts, site_distiller
from medflare.fediod.teacher import teacher_settings, train_teacher
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

    def __init__(self, preset: str, overrides: Mapping[str, Any] | None, sites: list[str], device, seed: int = 0,
                 teachers: Mapping[str, Mapping[str, Any]] | None = None):
        """``teachers``: ``{site: {"name", "args"}}``, a site's own teacher network in place of the preset's model (what
        the site's ``medflare_site.json`` 'fediod.teacher' chooses in the job; the same :func:`teacher_settings` reads it)."""
        self.preset, self.overrides = preset, dict(overrides or {})
        self.cfg = get_preset(preset, overrides)
        self.sites, self.device, self.seed = sites, device, seed
        self.data = {s: load_site(s, self.cfg["data"]) for s in sites}
        self.task = next(iter(self.data.values())).task
        self.teachers, self.teacher_specs = {}, {}
        tic = time.perf_counter()
        for s, d in self.data.items():
            own = {"fediod": {"teacher": dict(teachers[s])}} if teachers and s in teachers else {}
            spec, train, _, _ = teacher_settings(own, self.cfg, s, d.num_classes, d.in_channels, int(d.train[0]["image"].shape[-1]))
            self.teacher_specs[s] = spec
            self.teachers[s], _ = train_teacher(spec, train, d.train, d.task, device, seed=seed)
        self.teacher_seconds = time.perf_counter() - tic
        self.infos = {s: SiteInfo(label_counts(d.train, d.task, d.num_classes), len(d.train)) for s, d in self.data.items()}

    def score(self, model, split: str = "test") -> dict[str, float]:
        """Metrics of ``model`` on the union of the sites' ``split`` (the paper's global test set)."""
        union = ConcatDataset([getattr(d, split) for d in self.data.values()])
        d0 = next(iter(self.data.values()))
        return evaluate(model, make_loader(union, 64, False), task=d0.task, num_classes=d0.num_classes,
                        metrics=self.cfg["eval"]["metrics"], device=self.device)["mean"]

    def distill(self, rounds: int, fediod: Mapping[str, Any] | None = None, privacy: PrivacySettings | None = None,
                label: str = "fediod", samples_dir: Path | None = None, probe=None, seed: int | None = None,
                curve_split: str = "val") -> dict[str, Any]:
        """Stage 2 for ``rounds`` rounds with ``fediod`` as further overrides of the preset's fediod section (any of its
        keys, checked as a job's overrides are); scores the student on the union of the sites' ``curve_split`` after
        each round (``out["curve"]``; ``probe(self, distiller, federation)`` adds a diagnosis of each round, kept in
        ``out["probes"]``). ``seed`` seeds G, S, the sites' critics and the noise (default: the teachers' seed)."""
        seed = self.seed if seed is None else int(seed)
        cfg = get_preset(self.preset, {**self.overrides, "fediod": {**self.overrides.get("fediod", {}), **(fediod or {})}})
        fcfg = FedIODConfig.from_preset(cfg)
        sites = {s: site_distiller(cfg, fcfg, s, self.teachers[s], self.data[s].train, privacy, seed, self.device) for s in self.sites}
        nets = server_networks(cfg, fcfg, seed)
        labels = None
        if self.task == "segmentation":
            aux = load_site(fcfg.label_source, cfg["data"])
            labels = torch.stack([aux.train[i]["label"] for i in range(len(aux.train))]).long()
        dist = Distiller(nets.generator, nets.student, fcfg, self.task, self.cfg["data"]["num_classes"],
                         total_steps=steps_total(rounds, fcfg), label_maps=labels, device=self.device, seed=seed)
        dist.set_sites(self.infos)
        fed = LocalFederation(sites)
        curve, probes, tic = [], [], time.perf_counter()
        key = self.cfg["eval"]["key_metric"]
        for rnd in range(rounds):
            for _ in range(fcfg.windows_per_round):
                dist.run_window(fed)
            nets.student.eval()
            curve.append(self.score(nets.student, curve_split)[key])
            if probe is not None:
                probes.append(probe(self, dist, fed))
                log(f"{label} round {rnd + 1}: val {curve[-1]:.3f} {probes[-1]}")
            nets.student.train()
            if len(fed.stopped) == len(sites):
                break
        nets.student.eval()
        out = {"label": label, "seed": seed, "rounds": rnd + 1, "steps": dist.steps, "seconds": time.perf_counter() - tic,
               "test": self.score(nets.student), "curve": curve, "probes": probes,
               "per_site": self.per_site(nets.student, self.cfg["eval"]["metrics"]) if self.task == "segmentation" else {},
               "epsilon": {s: site.epsilon() for s, site in sites.items()}, "stopped": dict(fed.stopped)}
        if samples_dir is not None:
            from PIL import Image

            window = dist.preview(16, seed)
            grid = sample_grid(window.inputs()[0], window.labels()[0] if window.y is not None else None)
            samples_dir.mkdir(parents=True, exist_ok=True)
            Image.fromarray(grid.transpose(1, 2, 0)).save(samples_dir / f"{label}.png")
        per_site = "".join(f", {s} {100 * m[key]:.2f}" for s, m in out["per_site"].items())
        log(f"{label}: {out['test']}{per_site} after {out['steps']} steps ({out['seconds']:.0f} s, load {load_avg()})")
        return out

    def per_site(self, model, metrics: list[str] | None = None) -> dict[str, Any]:
        """``model`` on each site's own test split (the report's per-site columns): the key metric, or with ``metrics``
        ``{site: {metric: value}}``."""
        key = self.cfg["eval"]["key_metric"]
        d0 = next(iter(self.data.values()))
        out = {s: evaluate(model, make_loader(d.test, 64, False), task=d0.task, num_classes=d0.num_classes, metrics=metrics or [key],
                           device=self.device)["mean"] for s, d in self.data.items()}
        return out if metrics else {s: m[key] for s, m in out.items()}

    def label_ensemble(self, tau: float = 0.0) -> torch.nn.Module:
        """The teachers' ensemble the server forms with ``ensemble`` "labels" (Eq. 9 with Eq. 8's label factor alone, no
        discriminator factor) at ``ensemble_tau`` ``tau``, as one network: the ceiling of what the student learns from
        them on real images."""
        return LabelEnsemble(list(self.teachers.values()), [self.infos[s].counts for s in self.teachers], tau)

    def standalone(self) -> dict[str, float]:
        """Each teacher on the union test set: mean and std over sites of the key metric (Table 1 'Standalone')."""
        key = self.cfg["eval"]["key_metric"]
        values = [self.score(t)[key] for t in self.teachers.values()]
        return {"mean": statistics.mean(values), "std": statistics.pstdev(values), "per_site": dict(zip(self.teachers, values))}


class LabelEnsemble(torch.nn.Module):
    """``A(x) = sum_k pi_k (.) T_k(x)`` with ``pi_k`` :func:`ensemble_weights` of the sites' :func:`label_ratio` (what
    :class:`Distiller` aggregates with ``ensemble`` "labels"), for :func:`evaluate`."""

    def __init__(self, teachers: list[torch.nn.Module], counts: list[torch.Tensor], tau: float = 0.0):
        super().__init__()
        self.teachers, self.tau = torch.nn.ModuleList(teachers), tau
        self.register_buffer("ratio", label_ratio(torch.stack([torch.as_tensor(c) for c in counts])))

    def combine(self, z: list[torch.Tensor]) -> torch.Tensor:
        """The ensemble of the teachers' outputs ``z`` (one per teacher, in order)."""
        return aggregate(z, ensemble_weights(self.ratio, None), self.tau)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.combine([t(x) for t in self.teachers])


# ---- segmentation diagnosis ----------------------------------------------------------------------
def fg_dice(pred: torch.Tensor, target: torch.Tensor, num_classes: int) -> float:
    """Mean over foreground classes of the Dice of label maps ``pred`` vs ``target`` (both (B, 1, H, W) int), pooled over
    the batch (a class absent from both is left out)."""
    values = []
    for c in range(1, num_classes):
        p, t = pred == c, target == c
        denom = int(p.sum() + t.sum())
        if denom:
            values.append(2.0 * int((p & t).sum()) / denom)
    return sum(values) / len(values) if values else float("nan")


def contrast(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per image: mean intensity inside the labelled object minus outside it ((B, 1, H, W) each -> (B,)); > 0 for the
    normal-contrast sites' images, < 0 for the inverted ones'."""
    fg = (y > 0).float()
    inside = (x * fg).sum((1, 2, 3)) / fg.sum((1, 2, 3)).clamp_min(1)
    outside = (x * (1 - fg)).sum((1, 2, 3)) / (1 - fg).sum((1, 2, 3)).clamp_min(1)
    return inside - outside


def _stack(dataset, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    items = [dataset[i] for i in range(len(dataset) if n is None else min(n, len(dataset)))]
    return torch.stack([torch.as_tensor(i["image"]) for i in items]), torch.stack([torch.as_tensor(i["label"]) for i in items]).long()


def seg_static(fed: Federation, label_source: str) -> dict[str, Any]:
    """What the sites and the server hold before distillation: each teacher on each site's test split (Dice), the
    teachers' label-ratio ensemble (Eq. 8 without D's factor) and plain mean on each site's real test images, the
    object contrast of each site's images and the label maps' class shares of every site and of the server's own."""
    C = fed.cfg["data"]["num_classes"]
    sites = list(fed.teachers)
    matrix = {t: fed.per_site(fed.teachers[t]) for t in sites}
    ensemble = fed.label_ensemble()  # the teachers in ``sites`` order, as z below
    ens_label, ens_mean, real_contrast, shares = {}, {}, {}, {}
    with torch.no_grad():
        for s, d in fed.data.items():
            x, y = _stack(d.test)
            z = [fed.teachers[t](x.to(fed.device)).cpu() for t in sites]
            ens_label[s] = fg_dice(ensemble.combine(z).argmax(1, keepdim=True), y, C)
            ens_mean[s] = fg_dice(torch.stack(z).mean(0).argmax(1, keepdim=True), y, C)
            real_contrast[s] = float(contrast(x, y).mean())
            shares[s] = [float((y == c).float().mean()) for c in range(1, C)]
    aux = load_site(label_source, fed.cfg["data"])
    ya = _stack(aux.train)[1]
    shares[f"{label_source} (server)"] = [float((ya == c).float().mean()) for c in range(1, C)]
    return {"teacher_on_site": matrix, "ensemble_labels_on_real": ens_label, "ensemble_mean_on_real": ens_mean,
            "real_contrast": real_contrast, "label_shares": shares}


def seg_probe(fed: Federation, dist: Distiller, federation: LocalFederation, n: int = 48) -> dict[str, Any]:
    """One round's diagnosis on ``n`` samples of G from a fixed seed: how many are of inverted contrast, how well each
    teacher, the Eq. 8 ensemble and the student segment them as their conditioning label maps, each site's mean Eq. 8
    weight, and the student's Dice on each site's test split. Measurement only: no site's state changes."""
    from medflare.fediod.losses import discriminator_score
    from medflare.nets.gan import one_hot

    C = fed.cfg["data"]["num_classes"]
    sites = sorted(federation.sites)
    window = dist.preview(n, seed=1234)
    x, y = window.inputs()[0], window.labels()[0]
    out: dict[str, Any] = {}
    with torch.no_grad():
        c = contrast(x.cpu(), y.cpu())
        out["g_inverted"] = float((c < 0).float().mean())
        if window.site is not None:  # styled G: the contrast of the inputs drawn for each site
            names = sorted(dist.sites)
            drawn = window.site[0].cpu()
            out["g_inverted_by_site"] = {s: float((c[drawn == k] < 0).float().mean()) for k, s in enumerate(names) if (drawn == k).any()}
            out["own_teacher_dice_vs_y"] = {}
        out["g_contrast"] = float(c.mean())
        z, r = [], []
        for s in sites:
            site = federation.sites[s]
            z.append(site.teacher(x))
            xr, yr = _stack(fed.data[s].train, 16)
            real = discriminator_score(site.disc(torch.cat([one_hot(yr.to(fed.device), C), xr.to(fed.device)], 1))).mean()
            r.append(discriminator_score(site.disc(torch.cat([one_hot(y, C), x], 1))) / real.clamp_min(1e-6))
        out["teacher_dice_vs_y"] = {s: fg_dice(zk.argmax(1, keepdim=True).cpu(), y.cpu(), C) for s, zk in zip(sites, z)}
        if window.site is not None:  # each teacher on the inputs drawn in its own site's style
            for k, (s, zk) in enumerate(zip(sites, z)):
                mine = drawn == names.index(s)
                if mine.any():
                    out["own_teacher_dice_vs_y"][s] = fg_dice(zk.argmax(1, keepdim=True).cpu()[mine], y.cpu()[mine], C)
        w = dist._weights(sites, torch.stack(r), len(x))
        out["site_weight"] = {s: float(w[i].mean()) for i, s in enumerate(sites)}
        out["ensemble_dice_vs_y"] = fg_dice(aggregate(z, w).argmax(1, keepdim=True).cpu(), y.cpu(), C)
        dist.S.eval()
        pred_s, pred_a = dist.S(x).argmax(1, keepdim=True).cpu(), aggregate(z, w).argmax(1, keepdim=True).cpu()
        out["student_dice_vs_y"] = fg_dice(pred_s, y.cpu(), C)
        if window.site is not None:  # per site drawn for: the ensemble, its own teacher's weight, the student
            out["by_site"] = {s: {"ensemble": fg_dice(pred_a[drawn == k], y.cpu()[drawn == k], C),
                                  "own_weight": float(w[sites.index(s)][(drawn == k).to(w.device)].mean()) if s in sites else float("nan"),
                                  "student": fg_dice(pred_s[drawn == k], y.cpu()[drawn == k], C)}
                              for k, s in enumerate(names) if (drawn == k).any()}
    out["student_test"] = fed.per_site(dist.S)
    dist.S.train()
    return out


# ---- baselines ------------------------------------------------------------------------------------
def fedavg_model(preset: str, overrides, sites: list[str], rounds: int, seed: int | None = None) -> torch.nn.Module:
    """jobs/fedavg in the FLARE simulator with the same preset; its final global model."""
    from medflare.common.results import load_result
    from medflare.report.runner import run_job

    with tempfile.TemporaryDirectory() as tmp:
        run = run_job("fedavg", Path(tmp), sites, preset=preset, overrides=overrides, seed=seed,
                      workflow_args={"num_rounds": rounds, "num_clients": len(sites)}, timeout=3600)["run"]
        if run.returncode != 0:
            raise RuntimeError(run.log[-3000:])
        return load_result(run.app_server / "FL_global_model.pt").networks["model"]


def fedavg(preset: str, overrides, sites: list[str], rounds: int, fed: Federation) -> dict[str, float]:
    """jobs/fedavg in the FLARE simulator with the same preset; its final global model on the union test set."""
    return fed.score(fedavg_model(preset, overrides, sites, rounds))


def central(preset: str, overrides, sites: list[str], epochs: int, fed: Federation) -> dict[str, float]:
    from medflare.baselines.standalone import run_standalone

    result = run_standalone("central", preset, sites, epochs=epochs, overrides=overrides, log=lambda m: None)
    return result["global"]


# ---- tables ---------------------------------------------------------------------------------------
def fmt(x: float, pct: bool = True) -> str:
    return f"{100 * x:.2f}" if pct else f"{x:.2f}"


def table_cls(args, device) -> dict:
    rows, md = {}, ["| Method | Model-agnostic | Prerequisite | Runs in | " + " | ".join(f"Dir({b})" for b in args.betas) + " |",
                    "|---|---|---|---|" + "---|" * len(args.betas)]
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
    # which cells are FLARE jobs and which run the same code in one process (issue 32: the table says which is which)
    runs_in = {"standalone": "one process (each site's teacher)", "fedavg": "FLARE simulator (jobs/fedavg)",
               "central": "one process (medflare baseline --mode central)",
               "fediod": "one process (LocalFederation: the job's site and server code)"}
    for name, agnostic, pre in (("standalone", "-", "-"), ("fedavg", "no", "-"), ("central", "-", "all data in one place"), ("fediod", "yes", "none")):
        md.append(f"| {name} | {agnostic} | {pre} | {runs_in[name]} | " + " | ".join(cell(b, name) for b in args.betas) + " |")
    return {"rows": rows, "markdown": "\n".join(md)}


def _site_mean(table: Mapping[str, Mapping[str, float]], key: str) -> float:
    return statistics.mean(m[key] for m in table.values())


def table_seg(args, device) -> dict:
    """Table 2 layout per site, on the report's segmentation sites (``--sites``, default all six, two of inverted
    contrast), for each seed of ``--seeds``: FedIOD-seg as the preset ships it and each variant of ``--variants`` (in one
    process, :class:`Federation`), FedAvg (the shipped jobs/fedavg in the FLARE simulator, the report's local work:
    ``--fedavg-epochs`` a round for ``--fedavg-rounds`` rounds; left out where nvflare is not installed), centralised
    training for as many passes over the data, and each site's own teacher on its own test split."""
    preset, sites = args.seg_preset, sites_of(args.seg_sites)
    keys = ("dice", "sensitivity", "specificity", "hd95")
    from medflare.baselines.standalone import run_standalone

    fediod_rows = [name if name != "preset" else "FedIOD-seg" for name in args.variants]
    rows: dict[str, dict[int, dict[str, dict[str, float]]]] = {n: {} for n in ["teacher (own site)", *fediod_rows, "FedAvg", "centralised"]}
    try:
        import nvflare  # noqa: F401 - FedAvg runs in the FLARE simulator
        with_fedavg = not args.no_fedavg
    except ImportError:
        with_fedavg = False
    passes = args.fedavg_rounds * args.fedavg_epochs
    for seed in args.seeds:
        fed = Federation(preset, {}, sites, device, seed=seed)
        rows["teacher (own site)"][seed] = {s: fed.per_site(t, list(keys))[s] for s, t in fed.teachers.items()}
        central_run = run_standalone("central", preset, sites, epochs=passes, seed=seed, device=str(device), log=lambda m: None,
                                     overrides={"eval": {"metrics": list(keys)}})
        rows["centralised"][seed] = central_run["sites"]
        log(f"centralised seed {seed}: " + ", ".join(f"{s} {100 * m['dice']:.2f}" for s, m in central_run["sites"].items()))
        if with_fedavg:
            model = fedavg_model(preset, {"train": {"epochs": args.fedavg_epochs}}, sites, args.fedavg_rounds, seed)
            rows["FedAvg"][seed] = fed.per_site(model, list(keys))
        for name, row in zip(args.variants, fediod_rows):
            run = fed.distill(args.seg_rounds, fediod=seg_overrides(fed.cfg, seg_variant(name)), label=f"{row}_seed{seed}",
                              samples_dir=args.out / "samples")
            rows[row][seed] = run["per_site"]
        log(f"seed {seed}: " + ", ".join(f"{n} {100 * _site_mean(r[seed], 'dice'):.2f}" for n, r in rows.items() if seed in r))
    rows = {n: r for n, r in rows.items() if r}
    md = [f"Sites {', '.join(sites)}; preset {preset}; FedIOD {args.seg_rounds} rounds; FedAvg {args.fedavg_rounds} rounds x "
          f"{args.fedavg_epochs} epochs, centralised {passes} epochs; seeds {', '.join(map(str, args.seeds))} (mean over seeds; "
          "client average +- std over seeds)", "",
          "| method | " + " | ".join(sites) + " | client avg Dice | Sens. | Spec. | HD95 (px) |", "|---|" + "---|" * (len(sites) + 4)]
    summary = {}
    for name, per_seed in rows.items():
        seeds = sorted(per_seed)
        dice = [_site_mean(per_seed[sd], "dice") for sd in seeds]
        summary[name] = {"client_average_dice": statistics.mean(dice), "std": statistics.pstdev(dice), "per_seed": dice,
                         "per_site": {s: statistics.mean(per_seed[sd][s]["dice"] for sd in seeds) for s in sites}}
        cells = [f"{100 * summary[name]['per_site'][s]:.2f}" for s in sites]
        other = [statistics.mean(_site_mean(per_seed[sd], k) for sd in seeds) for k in keys[1:]]
        md.append(f"| {name} | " + " | ".join(cells) + f" | {100 * statistics.mean(dice):.2f} +- {100 * statistics.pstdev(dice):.2f} | "
                  f"{100 * other[0]:.2f} | {100 * other[1]:.2f} | {other[2]:.2f} |")
    return {"rows": rows, "summary": summary, "markdown": "\n".join(md)}


#: the segmentation run of the report (session 24): the paper's losses and Algorithm 1's student, as fediod_seg had them
SEG_PAPER: dict[str, Any] = {"styles": 0, "lambda_label": 0.0, "student_label": 0.0, "student_steps": 1, "replay_size": 0,
                             "mimic_tau": 0.0, "lambda_gan": 1.0, "lambda_conf": 1.0, "lambda_unique": 1.0, "lambda_mimic": 1.0,
                             "lr_generator": 1e-3, "lr_discriminator": 1e-3, "lr_student": 1e-3}
#: candidate causes / fixes of the segmentation student (--variants), each a change of SEG_PAPER ("preset" = the shipped
#: preset as it is): "styles" N gives the label generator N style codes, one site per generated input, judged by that
#: site's critic alone; "weights" the classification CPU presets' loss weights (tau = 1 KL for L_mimic, realism weighted
#: up); "label" G's label term (lambda_label), "student_label" the student's; "replay" the student's replay
_SEG_CHANGES: dict[str, dict[str, Any]] = {
    "styles": {"styles": 8},
    "weights": {"mimic_tau": 1.0, "lambda_gan": 5.0, "lambda_conf": 0.2, "lambda_unique": 0.2, "lambda_mimic": 0.5},
    "label": {"lambda_label": 1.0},
    "student_label": {"student_label": 1.0},
    "label3": {"lambda_label": 3.0},
    "student_label3": {"student_label": 3.0},
    "replay": {"student_steps": 6, "replay_size": 2048, "lr_generator": 2e-3, "lr_discriminator": 2e-3, "lr_student": 3e-3},
    "2x": {"windows_per_round": 8},
}


def seg_variant(name: str) -> dict[str, Any]:
    """The fediod changes of ``name``: "+"-joined parts on SEG_PAPER, or on the shipped preset when the first part is
    "preset" ("preset" alone = the shipped fediod_seg). A part is "paper", a name of :data:`_SEG_CHANGES` (e.g.
    ``weights+styles+label3+student_label3+replay``, what the shipped fediod_seg changes of the paper) or a
    ``key=value`` override of the fediod section (``preset+lambda_gan=20``; ``styles``, ``upsample``, ``width`` and
    ``blocks`` set the generator's arguments)."""
    parts = name.split("+")
    out = {} if parts[0] == "preset" else dict(SEG_PAPER)
    for part in parts[1:] if parts[0] == "preset" else parts:
        if part == "paper":
            continue
        if "=" in part:
            out.update(parse_overrides(part))
        elif part in _SEG_CHANGES:
            out.update(_SEG_CHANGES[part])
        else:
            raise SystemExit(f"unknown variant part '{part}' in '{name}' (known: paper, preset (first only), key=value, {', '.join(_SEG_CHANGES)})")
    return out


#: variant keys that are arguments of the label generator, not of the fediod section
_GENERATOR_ARGS = ("styles", "upsample", "width", "blocks")


def seg_overrides(cfg: Mapping[str, Any], variant: Mapping[str, Any]) -> dict[str, Any]:
    """A variant (:func:`seg_variant`) as a fediod section override of ``cfg``'s preset."""
    ov = dict(variant)
    gen_args = {k: ov.pop(k) for k in _GENERATOR_ARGS if k in ov}
    if gen_args:
        gen = cfg["fediod"]["generator"]
        ov["generator"] = {"name": gen["name"], "args": {**gen.get("args", {}), **gen_args}}
    return ov


def _probe_cells(p: Mapping[str, Any], inverted: list[str]) -> str:
    inv = ", ".join(f"{100 * p['student_test'][s]:.1f}" for s in inverted)
    tmax = max(p["teacher_dice_vs_y"].values())
    return (f"{100 * p['g_inverted']:.0f} % | {p['g_contrast']:+.3f} | {100 * tmax:.1f} | {100 * p['ensemble_dice_vs_y']:.1f} | "
            f"{100 * p['student_dice_vs_y']:.1f} | {100 * statistics.mean(p['student_test'].values()):.1f} | {inv}")


def table_seg_diagnosis(args, device) -> dict:
    """Why the segmentation student fails: what the teachers and label maps are (static), then per round of each
    variant in ``--variants`` what G draws and what the teachers, the Eq. 8 ensemble and the student make of it."""
    preset, sites = args.seg_preset, sites_of(args.seg_sites)
    fed = Federation(preset, {}, sites, device, seed=args.seed)
    fcfg = FedIODConfig.from_preset(fed.cfg)
    static = seg_static(fed, fcfg.label_source)
    inverted = [s for s, c in static["real_contrast"].items() if c < 0]
    md = [f"Sites {', '.join(sites)} (inverted contrast: {', '.join(inverted) or 'none'}); preset {preset}; seed {args.seed}.", "",
          "| teacher \\ test site | " + " | ".join(sites) + " |", "|---|" + "---|" * len(sites)]
    for t, row in static["teacher_on_site"].items():
        md.append(f"| {t} | " + " | ".join(f"{100 * row[s]:.1f}" for s in sites) + " |")
    for name in ("ensemble_labels_on_real", "ensemble_mean_on_real"):
        md.append(f"| {name} | " + " | ".join(f"{100 * static[name][s]:.1f}" for s in sites) + " |")
    md.append("| object contrast of the real images | " + " | ".join(f"{static['real_contrast'][s]:+.3f}" for s in sites) + " |")
    md += ["", "| label maps of | " + " | ".join(f"class {c} share" for c in range(1, fed.cfg['data']['num_classes'])) + " |",
           "|---|" + "---|" * (fed.cfg["data"]["num_classes"] - 1)]
    for who, sh in static["label_shares"].items():
        md.append(f"| {who} | " + " | ".join(f"{v:.3f}" for v in sh) + " |")
    md += ["", "| variant | round | G inverted | G contrast | best teacher Dice vs y on G | Eq.8 ensemble Dice vs y | student Dice vs y on G | "
           f"student client avg | student on {', '.join(inverted)} | Eq.8 weight per site ({', '.join(sites)}) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    runs = {}
    for name in args.variants:
        run = fed.distill(args.seg_rounds, fediod=seg_overrides(fed.cfg, seg_variant(name)), label=name, probe=seg_probe,
                          samples_dir=args.out / "samples")
        runs[name] = run
        for rnd, p in enumerate(run["probes"], 1):
            if rnd in (1, len(run["probes"])) or rnd % max(1, args.seg_rounds // 4) == 0:
                md.append(f"| {name} | {rnd} | {_probe_cells(p, inverted)} | " + " / ".join(f"{p['site_weight'][s]:.2f}" for s in sites) + " |")
    styled = {name: run["probes"][-1] for name, run in runs.items() if run["probes"] and "by_site" in run["probes"][-1]}
    if styled:  # a styled G: per site it drew for, at the last round
        md += ["", "Last round, by the site each generated input was drawn for (styled generator): share of inverted contrast, "
               "that site's own teacher, the Eq. 8 ensemble and the student (Dice vs the conditioning label map, %), the "
               "ensemble weight of that site's teacher, and the student on the site's real test split (Dice, %).", "",
               "| variant | site | G inverted | own teacher vs y | ensemble vs y | own teacher's Eq. 8 weight | student vs y | student on real |",
               "|---|---|---|---|---|---|---|---|"]
        for name, p in styled.items():
            for s in sites:
                b = p["by_site"].get(s)
                if b is None:
                    continue
                md.append(f"| {name} | {s} | {100 * p['g_inverted_by_site'][s]:.0f} % | {100 * p['own_teacher_dice_vs_y'][s]:.1f} | "
                          f"{100 * b['ensemble']:.1f} | {b['own_weight']:.2f} | {100 * b['student']:.1f} | {100 * p['student_test'][s]:.1f} |")
    return {"static": static, "runs": runs, "markdown": "\n".join(md)}


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


# ---- classification curves ------------------------------------------------------------------------
#: the e2e test's second teacher architecture (tests/e2e/test_fediod.py SECOND_TEACHER), for --site2-resnet8
SITE2_RESNET8 = {"name": "resnet8", "args": {"widths": [8, 16, 32]}}


def parse_overrides(text: str) -> dict[str, Any]:
    """``"key=value+key=value"`` -> ``{key: value}``, each value read as JSON where it parses (``10``, ``5e-3``,
    ``true``, ``[8, 16]``) and as a string otherwise; "preset" (or "") -> ``{}``. The keys are checked where they are
    used, as a job's overrides are (:func:`get_preset`)."""
    out: dict[str, Any] = {}
    if text in ("", "preset"):
        return out
    for part in text.split("+"):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"'{part}' in '{text}' is not key=value")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


#: temperatures of the teachers' probability mixture whose accuracy on real images the curve table prints (ensemble_tau)
ENSEMBLE_TAUS = (1.0, 2.0, 4.0)


def table_curve(args, device) -> dict:
    """The student's accuracy on the union of the sites' test splits every ``--curve-every`` steps of one FedIOD
    classification run of ``--curve-steps`` steps (the cosine schedules over that length), in one process, for each
    variant of ``--variants`` ("preset", or '+'-joined key=value overrides of the fediod section) and each seed of
    ``--seeds`` (G, S, the critics and the noise; the teachers are trained once with ``--seed``). With the teachers'
    accuracies on the same test set and their label-weighted ensemble's (the ceiling of what the student learns)."""
    preset = args.curve_preset
    data = parse_overrides(args.curve_data)
    if args.curve_sites:
        data["num_sites"] = args.curve_sites
    overrides = {k: v for k, v in (("data", data), ("train", parse_overrides(args.curve_train))) if v}
    cfg = get_preset(preset, overrides)
    sites = sites_of(int(cfg["data"]["num_sites"]))
    fcfg = FedIODConfig.from_preset(cfg)
    every, total, M = args.curve_every, args.curve_steps, fcfg.steps_per_window
    if every % M or total % every:
        raise SystemExit(f"--curve-every ({every}) must be a multiple of the preset's steps_per_window ({M}) and divide "
                         f"--curve-steps ({total})")
    for name in args.variants:  # a mistyped key fails here, not after the teachers' training
        FedIODConfig.from_preset(get_preset(preset, {**overrides, "fediod": parse_overrides(name)}))
    teachers = {"site-2": SITE2_RESNET8} if args.site2_resnet8 else None
    fed = Federation(preset, overrides, sites, device, seed=args.seed, teachers=teachers)
    key = fed.cfg["eval"]["key_metric"]
    on_union = {s: fed.score(t)[key] for s, t in fed.teachers.items()}
    ensemble, *mixed = [fed.score(fed.label_ensemble(t))[key] for t in (0.0, *ENSEMBLE_TAUS)]  # Eq. 9, then the mixtures
    of_probabilities = dict(zip(ENSEMBLE_TAUS, mixed))
    mixtures = ", ".join(f"{v:.3f} at ensemble_tau {t:g}" for t, v in of_probabilities.items())
    log(f"teachers on the union test set {on_union}; label-weighted ensemble {ensemble:.3f} (Eq. 9), {mixtures} (teachers "
        f"{fed.teacher_seconds:.0f} s)")
    columns = list(range(every, total + 1, every))
    md = [f"Preset {preset}" + "".join(f", {k} {v}" for k, v in overrides.items()) + f"; sites {', '.join(sites)}; teachers "
          + ", ".join(f"{s} {fed.teacher_specs[s]['name']}" + (f" {fed.teacher_specs[s]['args'].get('widths')}" if "widths" in
                      fed.teacher_specs[s]["args"] else "") for s in sites)
          + f" (seed {args.seed}, {fed.teacher_seconds:.0f} s); {fed.task}, {key} on the union of the sites' test splits "
          f"({sum(len(d.test) for d in fed.data.values())} images); B = {fcfg.batch_size}, M = {M}; cosine over {total} steps.", "",
          "Teachers: " + " / ".join(f"{on_union[s]:.3f}" for s in sites) + f"; label-weighted ensemble {ensemble:.3f} of their logits "
          f"(Eq. 9); of their probabilities {mixtures}.", "",
          "| variant | seed | " + " | ".join(map(str, columns)) + " steps | seconds | load (1/5/15 min) |", "|---|---|" + "---|" * (len(columns) + 2)]
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    for name in args.variants:
        for seed in args.seeds:
            # one round = --curve-every steps, so the round loop scores the student at each column
            run = fed.distill(total // every, fediod={"windows_per_round": every // M, **parse_overrides(name)}, seed=seed,
                              label=f"{name} seed {seed}", curve_split="test")
            run["load_average"] = load_avg()
            runs.setdefault(name, {})[seed] = run
            log(f"curve {name} seed {seed}: " + " / ".join(f"{v:.3f}" for v in run["curve"]) + f" at {columns[:len(run['curve'])]} steps")
            md.append(f"| {name} | {seed} | " + " | ".join(f"{v:.3f}" for v in run["curve"]) + " | " * (len(columns) - len(run["curve"]))
                      + f" | {run['seconds']:.0f} | {run['load_average']} |")
    return {"preset": preset, "overrides": overrides, "sites": sites, "teachers": fed.teacher_specs, "teachers_on_union": on_union,
            "label_ensemble": ensemble, "label_ensemble_of_probabilities": {str(t): v for t, v in of_probabilities.items()}, "steps": columns, "runs": runs, "markdown": "\n".join(md)}


def sites_of(n: int) -> list[str]:
    return [f"site-{i}" for i in range(1, n + 1)]


TABLES = {"cls": table_cls, "seg": table_seg, "segdiag": table_seg_diagnosis, "ablation": table_ablation, "dp": table_dp, "overhead": table_overhead,
          "curve": table_curve}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table", default="all", choices=[*TABLES, "all"])
    p.add_argument("--sites", type=int, default=None, help="classification sites (default 4; curve: the preset's)")
    p.add_argument("--rounds", type=int, default=8, help="FedIOD rounds (classification)")
    p.add_argument("--seg-rounds", type=int, default=10, help="FedIOD rounds (segmentation; the report's 10)")
    p.add_argument("--seeds", default="0", help="seg, curve: seeds (curve: of the distillation; the teachers use --seed)")
    p.add_argument("--seg-sites", type=int, default=6, help="seg, segdiag: sites site-1..N (the report's 6; site-2, site-6 inverted)")
    p.add_argument("--fedavg-rounds", type=int, default=10, help="seg: FedAvg rounds (the report's 10)")
    p.add_argument("--fedavg-epochs", type=int, default=2, help="seg: FedAvg local epochs a round (the report's 2)")
    p.add_argument("--no-fedavg", action="store_true", help="seg: leave FedAvg out")
    p.add_argument("--betas", default="1,0.1")
    p.add_argument("--beta", type=float, default=0.1, help="ablation split")
    p.add_argument("--dp-beta", type=float, default=1.0)
    p.add_argument("--sigmas", default="0,1,4,16,64")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--noise-outputs", action="store_true")
    p.add_argument("--windows", type=int, default=4, help="windows per round in the overhead table")
    p.add_argument("--cls-preset", default=None, help="classification preset (default fediod_cls; curve: fediod_cls_tiny)")
    p.add_argument("--curve-every", type=int, default=80, help="curve: score the student every K steps (a multiple of M)")
    p.add_argument("--curve-steps", type=int, default=400, help="curve: the run's steps (the cosine schedules' length)")
    p.add_argument("--curve-data", default="", help="curve: '+'-joined key=value overrides of the data section (beta=0.5+scale=0.5)")
    p.add_argument("--curve-train", default="", help="curve: '+'-joined key=value overrides of the teachers' train section (epochs=10)")
    p.add_argument("--site2-resnet8", action="store_true", help="curve: site-2's teacher a ResNet-8 8/16/32 (the e2e test's)")
    p.add_argument("--seg-preset", default="fediod_seg")
    p.add_argument("--variants", default="preset", help="seg, segdiag: comma-separated FedIOD-seg variants: preset, paper, or "
                   f"'+'-joined changes of the paper's settings ({', '.join(_SEG_CHANGES)}) or key=value overrides, on the "
                   "paper's settings or after 'preset' (preset+lambda_gan=20); see seg_variant. curve: preset, or "
                   "'+'-joined key=value overrides of the fediod section (student_steps=1+replay_size=0); see parse_overrides")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--paper", action="store_true", help="paper scale: fediod_cls_paper / fediod_seg_paper, 20 sites, 300 rounds")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    args.betas = [float(b) for b in args.betas.split(",")]
    args.sigmas = [float(s) for s in args.sigmas.split(",")]
    args.variants = args.variants.split(",")
    args.seeds = [int(x) for x in args.seeds.split(",")]
    args.curve_sites, args.curve_preset = args.sites, args.cls_preset or "fediod_cls_tiny"
    args.sites, args.cls_preset = args.sites or 4, args.cls_preset or "fediod_cls"
    if args.paper:
        args.cls_preset, args.seg_preset, args.sites, args.rounds, args.seg_rounds = "fediod_cls_paper", "fediod_seg_paper", 20, 300, 400
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    device = pick_device(args.device)
    for name in ([t for t in TABLES if t != "curve"] if args.table == "all" else [args.table]):
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
