"""Does a FedIOD teacher fit its own data in eval mode? Each site's teacher trained as stage 1 trains it
(``medflare.fediod.teacher.train_teacher`` with the site's seed), scored on the site's own training images in eval mode,
without and with the recomputation of its BatchNorm statistics over those images
(``medflare.common.training.recompute_batchnorm``, what ``train_teacher`` now does).

Used for benchmarks/RESULTS_fediod.md, "The teachers' BatchNorm statistics": a teacher whose train-mode loss ended
near 0 scored 0.36 in eval mode on its running statistics, 0.98 on recomputed ones.

    PYTHONPATH=custom python benchmarks/teacher_batchnorm.py --preset fediod_cls --sites 4 --data beta=0.1 --seeds 0,1,2,3,4

``--data`` is a '+'-joined list of ``key=value`` overrides of the preset's data section, read as ``medflare run --set``
reads them. Training runs on the CPU; which seeds fail can depend on the number of torch threads (the float order).
"""

from __future__ import annotations

import argparse
from unittest import mock

import torch

from medflare.common.training import make_loader
from medflare.data import load_site
from medflare.fediod import teacher as stage1
from medflare.metrics import evaluate
from medflare.presets import get_preset, overrides_from_assignments


def own_accuracy(model: torch.nn.Module, site) -> float:
    """``model``'s accuracy on ``site``'s training images, in eval mode."""
    loader = make_loader(site.train, 256, False)
    return float(evaluate(model, loader, task=site.task, num_classes=site.num_classes, metrics=["accuracy"], device="cpu")["mean"]["accuracy"])


def parser(description: str) -> argparse.ArgumentParser:
    """The arguments the teacher scans share: ``--preset``, ``--sites``, ``--data`` and ``--seeds``."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="fediod_cls")
    ap.add_argument("--sites", type=int, default=0, help="sites site-1..N (default: the preset's num_sites)")
    ap.add_argument("--data", default="", help="'+'-joined data overrides, e.g. beta=0.1+scale=1.0")
    ap.add_argument("--seeds", default="0", help="comma-separated teacher seeds (the job's --seed)")
    return ap


def load_sites(args, only: str = "") -> tuple[dict, dict]:
    """(the resolved preset, {site: its data}) for the parsed ``args``; ``only`` = comma-separated sites (default all).
    Each site is loaded once: every seed trains on the same data."""
    data = overrides_from_assignments(filter(None, args.data.split("+")))
    if args.sites:
        data["num_sites"] = args.sites
    cfg = get_preset(args.preset, {"data": data})  # an unknown key is an error, as in a job
    names = only.split(",") if only else [f"site-{k}" for k in range(1, int(cfg["data"]["num_sites"]) + 1)]
    return cfg, {name: load_site(name, cfg["data"]) for name in names}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--only", default="", help="comma-separated sites to train (default: all)")
    args = ap.parse_args()
    cfg, sites = load_sites(args, args.only)
    names = list(sites)
    print(f"| seed | {' | '.join(names)} |\n|---|{'---|' * len(names)}")
    for seed in (int(s) for s in args.seeds.split(",")):
        cells = []
        for name, site in sites.items():
            spec, train, _, _ = stage1.teacher_settings({}, cfg, name, site.num_classes, site.in_channels, int(site.train[0]["image"].shape[-1]))
            with mock.patch.object(stage1, "recompute_batchnorm", lambda *a, **k: False):
                without, _ = stage1.train_teacher(spec, train, site.train, site.task, torch.device("cpu"), seed=seed)
            with_pass, _ = stage1.train_teacher(spec, train, site.train, site.task, torch.device("cpu"), seed=seed)
            cells.append(f"{own_accuracy(without, site):.3f} -> {own_accuracy(with_pass, site):.3f}")
        print(f"| {seed} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
