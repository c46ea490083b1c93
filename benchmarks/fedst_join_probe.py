"""Does FedST-join's joint generator switch style with the domain vector? Central vs federated, K local steps x R rounds.

    python benchmarks/fedst_join_probe.py --mode fed --local-steps 10 --steps 240 [--preset fedst_tiny]
        [--sites site-1,site-2] [--lr 2e-3] [--domain-lr 2e-2] [--maps 24] [--seed 0] [--out FILE.jsonl]

One process, no FLARE, the package's own modules (``medflare.fedst.diffusion`` / ``conditioning``): the generator of the
preset (``diffusion`` section) is trained on two sites' training images, each with its own one-hot domain vector, for
``--steps`` generator steps in all (the same compute for every mode):

    central  one generator, one Adam, the sites' batches in turn (step i: site i mod 2)
    fed      R = steps / (2 K) rounds; each round every site starts from the global generator, trains K local steps with
             its own Adam (kept between rounds, never shared, as the site's GeneratorTrainingExecutor does) and returns
             its weight diff; the server adds ``participation_mean`` of the diffs (equal weights), as
             FedSTJoinController does. K = 1 is FedAvg's closest match to central training.

Then it draws images from ``--maps`` training label maps of each site with each domain vector and prints the mean
intensity of the drawn images in every label class, next to the real images' means. Style transfer succeeds
("separated") when the images drawn with site A's vector from site B's label maps have, in every class, a mean on
site A's side of the midpoint between the two sites' real means, for both directions. One JSON line per run is appended
to ``--out``. benchmarks/RESULTS_fedst.md, section "FedST-join and the style", holds the measured table.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import numpy as np
import torch

from medflare.common.payload import load_numpy_state, state_to_numpy, weight_diff
from medflare.common.training import make_loader
from medflare.data import load_site
from medflare.data.util import stable_seed
from medflare.fedst.conditioning import participation_mean
from medflare.fedst.config import DiffusionConfig
from medflare.fedst.diffusion import (build_style_generator, cycle, generator_args, generator_optimizer,
                                      sample_images, sampling_scheduler, train_generator, training_scheduler)
from medflare.presets import get_preset


def class_means(images: torch.Tensor, labels: torch.Tensor, num_classes: int) -> list[float]:
    """Mean intensity of ``images`` (N, 1, H, W) inside each label class of ``labels`` (N, 1, H, W)."""
    return [float(images[labels == c].mean()) if (labels == c).any() else float("nan") for c in range(num_classes)]


def separated(drawn: dict, real: dict, sites: list[str]) -> bool:
    """Images drawn with A's vector from B's label maps lie on A's side of the real midpoint in every class, both ways."""
    a, b = sites
    for style, maps in ((a, b), (b, a)):
        other = b if style == a else a
        for c, value in enumerate(drawn[f"{style}<-{maps}"]):
            mid = (real[a][c] + real[b][c]) / 2
            if (value - mid) * (real[style][c] - real[other][c]) <= 0:
                return False
    return True


def _batches(data, batch: int, seed: int, site: str):
    return cycle(lambda epoch: make_loader(data.train, batch, True, seed=stable_seed("fedst-probe", seed, site, epoch)))


def train(args, cfg, datas, sites, num_classes, in_channels) -> tuple[torch.nn.Module, list[float]]:
    diff = DiffusionConfig.from_preset(cfg)
    torch.manual_seed(args.seed)
    gen_args = generator_args(diff, in_channels, num_classes, len(sites))
    scheduler = training_scheduler(diff)
    batches = {s: _batches(datas[s], diff.batch_size, args.seed, s) for s in sites}
    losses: list[float] = []
    if args.mode == "central":
        generator = build_style_generator(gen_args)
        optimizer = generator_optimizer(generator, diff)
        for step in range(args.steps):
            k = step % len(sites)
            losses += train_generator(generator, scheduler, optimizer, batches[sites[k]], 1, domain_index=k,
                                      loss=diff.loss, seed=args.seed * 100003 + step)
        return generator, losses
    glob = build_style_generator(gen_args)
    local = {s: copy.deepcopy(glob) for s in sites}
    optim = {s: generator_optimizer(local[s], diff) for s in sites}
    rounds = max(1, args.steps // (len(sites) * args.local_steps))
    for rnd in range(rounds):
        sent = state_to_numpy(glob)
        diffs = []
        for k, s in enumerate(sites):
            load_numpy_state(local[s], sent)
            losses += train_generator(local[s], scheduler, optim[s], batches[s], args.local_steps, domain_index=k,
                                      loss=diff.loss, seed=args.seed * 100003 + rnd * 97 + k)
            diffs.append(weight_diff(state_to_numpy(local[s]), sent))
        mean = participation_mean(diffs, [1.0] * len(sites))
        load_numpy_state(glob, {name: sent[name] + mean[name] for name in sent})
    return glob, losses


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["central", "fed"], default="fed")
    p.add_argument("--local-steps", type=int, default=10, help="K: local generator steps per site and round (fed)")
    p.add_argument("--steps", type=int, default=240, help="generator steps in all (both sites together)")
    p.add_argument("--preset", default="fedst_tiny")
    p.add_argument("--sites", default="site-1,site-2")
    p.add_argument("--lr", type=float, default=None, help="default: the preset's diffusion.lr")
    p.add_argument("--domain-lr", type=float, default=None, help="default: the preset's diffusion.domain_lr")
    p.add_argument("--maps", type=int, default=24, help="label maps per site drawn with each domain vector")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="append one JSON line per run here")
    args = p.parse_args(argv)

    cfg = get_preset(args.preset, {"diffusion": {**({"lr": args.lr} if args.lr else {}),
                                                 **({"domain_lr": args.domain_lr} if args.domain_lr else {})}})
    sites = args.sites.split(",")
    datas = {s: load_site(s, cfg["data"]) for s in sites}
    first = datas[sites[0]]
    num_classes, in_channels = first.num_classes, first.in_channels
    tic = time.perf_counter()
    generator, losses = train(args, cfg, datas, sites, num_classes, in_channels)
    train_s = time.perf_counter() - tic

    maps, real = {}, {}
    for s in sites:
        items = [datas[s].train[i] for i in range(min(args.maps, len(datas[s].train)))]
        maps[s] = torch.stack([it["label"] for it in items])
        real[s] = class_means(torch.stack([it["image"] for it in items]), maps[s], num_classes)
    drawn = {}
    sampler = sampling_scheduler(DiffusionConfig.from_preset(cfg))
    for k, style in enumerate(sites):
        for s in sites:
            images = sample_images(generator, sampler, maps[s], domain_index=k, seed=args.seed)
            drawn[f"{style}<-{s}"] = class_means(images, maps[s], num_classes)
    row = {"mode": args.mode, "local_steps": args.local_steps if args.mode == "fed" else None,
           "rounds": args.steps // (len(sites) * args.local_steps) if args.mode == "fed" else None,
           "steps": args.steps, "lr": cfg["diffusion"]["lr"], "domain_lr": cfg["diffusion"]["domain_lr"],
           "preset": args.preset, "seed": args.seed, "real": real, "drawn": drawn, "separated": separated(drawn, real, sites),
           "loss_first10": float(np.mean(losses[:10])), "loss_last10": float(np.mean(losses[-10:])),
           "train_s": round(train_s, 1), "load_avg": [round(x, 2) for x in os.getloadavg()]}
    fmt = lambda v: " / ".join(f"{x:.3f}" for x in v)  # noqa: E731
    print(f"{args.mode} K={row['local_steps']} R={row['rounds']} steps={args.steps} lr={row['lr']} domain_lr={row['domain_lr']} "
          f"train {train_s:.0f}s load {row['load_avg']} L {row['loss_first10']:.3f}->{row['loss_last10']:.3f}")
    for s in sites:
        print(f"  real {s}: {fmt(real[s])}")
    for key, value in drawn.items():
        print(f"  drawn {key}: {fmt(value)}")
    print(f"  separated: {row['separated']}")
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
