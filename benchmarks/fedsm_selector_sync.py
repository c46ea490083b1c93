"""Why FedSM's selector needs care: each site sees only its own label (Eq. 2). Federated selector training
in plain torch (no FLARE), with the job's own pieces, comparing how the selector's optimiser state is handled.

    python benchmarks/fedsm_selector_sync.py [--preset seg_synthetic] [-n 4] [--rounds 10]

Variants (each: R rounds; per round every site trains from the averaged selector, the server takes the
n_k-weighted mean of the weights and, with "sync", of the Adam moments):
    adam-epoch-local   Adam, one pass of mini-batches per round, each site keeps its own moments
    adam-epoch-sync    the same, moments averaged by the server
    adam-full1-local   one full-batch Adam step per round (the reference's schedule), own moments
    adam-full1-sync    one full-batch Adam step per round, moments averaged (the reference)
    adam-fullN-sync    N full-batch Adam steps per round, moments averaged
    adam-stepsN-sync   at most N mini-batch Adam steps per round, moments averaged
    sgd-full1-exact    one full-batch plain-SGD step per round: the n_k-weighted mean of the sites' steps is
                       exactly one centralised full-batch gradient step (no optimiser state to sync)
Writes benchmarks/results/fedsm/selector_sync.md and prints validation accuracy per round.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from medflare.common.payload import load_numpy_state, state_to_numpy
from medflare.common.training import make_loader, make_loss, train_epochs
from medflare.data import load_site
from medflare.fedsm.executor import _WithLabels
from medflare.fedsm.protocol import adam_moments, load_adam_moments
from medflare.fedsm.softpull import weighted_mean
from medflare.fedsm.selector import build_selector
from medflare.presets import get_preset

OUT = Path(__file__).resolve().parent / "results" / "fedsm"


def run(variant: str, sites, data, rounds: int, lr: float, spec: dict, log) -> list[float]:
    mode, sync = variant.split("-")[1], variant.endswith("sync")
    torch.manual_seed(0)
    model = build_selector(spec)
    state, moments = state_to_numpy(model), {}
    nets = {s: build_selector(spec) for s in sites}
    make = (lambda p: torch.optim.Adam(p, lr=lr)) if variant.startswith("adam") else (lambda p: torch.optim.SGD(p, lr=lr))
    opts = {s: make(nets[s].parameters()) for s in sites}
    ce = make_loss("ce", "classification")
    curve = []
    for r in range(rounds):
        states, moms, weights = [], [], []
        for k, s in enumerate(sites):
            net, opt, train = nets[s], opts[s], data[s].train
            load_numpy_state(net, state)
            if sync and variant.startswith("adam"):
                load_adam_moments(opt, net, moments)
            labelled = _WithLabels(train, [k] * len(train))
            if mode == "epoch":
                train_epochs(net, make_loader(labelled, 8, True, seed=r), ce, opt, epochs=1)
            elif mode.startswith("steps"):
                train_epochs(net, make_loader(labelled, 8, True, seed=r), ce, opt, epochs=1, max_steps=int(mode[5:]))
            else:
                steps = 1 if mode == "full1" else int(mode[4:])
                train_epochs(net, make_loader(labelled, len(train), True, seed=r), ce, opt, epochs=steps)
            states.append(state_to_numpy(net))
            moms.append(adam_moments(opt, net))
            weights.append(len(train))
        state = weighted_mean(states, weights)
        if sync and variant.startswith("adam"):
            moments = weighted_mean(moms, weights)
        load_numpy_state(model, state)
        model.eval()
        hits = total = 0
        with torch.no_grad():
            for k, s in enumerate(sites):
                for batch in make_loader(data[s].val, 32, False):
                    hits += int((model(batch["image"]).argmax(1) == k).sum())
                    total += batch["image"].shape[0]
        curve.append(hits / total)
        log(f"{variant}: round {r + 1} val accuracy {curve[-1]:.3f}")
    return curve


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="seg_synthetic")
    p.add_argument("-n", type=int, default=4)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--variants", default="adam-epoch-local,adam-epoch-sync,adam-full1-local,adam-full1-sync,adam-full5-sync")
    p.add_argument("--selector", default='{"name": "style_selector", "args": {}}', help="selector spec as JSON")
    args = p.parse_args()
    torch.set_num_threads(1)
    cfg = get_preset(args.preset)
    sites = [f"site-{i}" for i in range(1, args.n + 1)]
    data = {s: load_site(s, cfg["data"]) for s in sites}
    spec = json.loads(args.selector)
    spec["args"].update(in_channels=cfg["model"]["args"].get("in_channels", 1), num_classes=args.n)
    rows = []
    for variant in args.variants.split(","):
        start = time.perf_counter()
        curve = run(variant, sites, data, args.rounds, args.lr, spec, print)
        rows.append((variant, curve, time.perf_counter() - start))
    OUT.mkdir(parents=True, exist_ok=True)
    lines = [f"Selector validation accuracy, {args.preset}, {args.n} sites, lr {args.lr}, selector {args.selector}, chance {1 / args.n:.2f}", "",
             "| variant | " + " | ".join(f"r{i + 1}" for i in range(args.rounds)) + " | s |", "|---" * (args.rounds + 2) + "|"]
    lines += [f"| {v} | " + " | ".join(f"{a:.2f}" for a in c) + f" | {t:.0f} |" for v, c, t in rows]
    (OUT / "selector_sync.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
