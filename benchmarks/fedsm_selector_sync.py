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
    ccvr               what the job does (medflare.fedsm.calibrate): the selector body stays as initialised,
                       sites send feature mean/covariance once, the server fits the head on Gaussian samples
                       (the same accuracy every round: nothing is trained after round 1)
Writes benchmarks/results/fedsm/selector_sync.md and prints validation accuracy per round.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import numpy as np
from torch.utils.data import Dataset

from medflare.common.payload import load_numpy_state, state_to_numpy
from medflare.common.training import make_loader, make_loss, train_epochs
from medflare.data import load_site
from medflare.fedsm.calibrate import feature_stats, fit_head, selector_features, set_head
from medflare.common.aggregation import weighted_mean
from medflare.fedsm.selector import build_selector
from medflare.presets import get_preset

OUT = Path(__file__).resolve().parent / "results" / "fedsm"


class _WithLabels(Dataset):
    """A site's images with selector labels (one int per case) in place of the segmentation labels."""

    def __init__(self, base: Dataset, labels: list[int]):
        self.base, self.labels = base, labels

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> dict:
        return {"image": self.base[i]["image"], "label": torch.tensor(self.labels[i], dtype=torch.long)}


def adam_moments(optimizer: torch.optim.Adam, model: torch.nn.Module) -> dict[str, np.ndarray]:
    """The Adam state of ``model``'s parameters (empty before the first step)."""
    out, steps = {}, []
    for name, p in model.named_parameters():
        state = optimizer.state.get(p)
        if state:
            out[f"exp_avg.{name}"] = state["exp_avg"].detach().cpu().numpy().copy()
            out[f"exp_avg_sq.{name}"] = state["exp_avg_sq"].detach().cpu().numpy().copy()
            steps.append(float(state["step"]))
    if steps:
        out["step"] = np.asarray(max(steps))
    return out


def load_adam_moments(optimizer: torch.optim.Adam, model: torch.nn.Module, moments) -> None:
    """Replace ``model``'s Adam state with averaged ``moments`` (empty = leave as is)."""
    if not moments:
        return
    for name, p in model.named_parameters():
        if f"exp_avg.{name}" in moments:
            optimizer.state[p] = {"step": torch.tensor(float(moments["step"])),
                                  "exp_avg": torch.as_tensor(moments[f"exp_avg.{name}"]).clone(),
                                  "exp_avg_sq": torch.as_tensor(moments[f"exp_avg_sq.{name}"]).clone()}


def accuracy(model, sites, data) -> float:
    model.eval()
    hits = total = 0
    with torch.no_grad():
        for k, s in enumerate(sites):
            for batch in make_loader(data[s].val, 32, False):
                hits += int((model(batch["image"]).argmax(1) == k).sum())
                total += batch["image"].shape[0]
    return hits / total


def run_ccvr(sites, data, rounds: int, spec: dict, log) -> list[float]:
    torch.manual_seed(0)
    model = build_selector(spec)
    stats = [feature_stats(selector_features(model, (b["image"] for b in make_loader(data[s].train, 32, False))), [k] * len(data[s].train))
             for k, s in enumerate(sites)]
    set_head(model, *fit_head(stats, len(sites)))
    acc = accuracy(model, sites, data)
    log(f"ccvr: val accuracy {acc:.3f}")
    return [acc] * rounds


def run(variant: str, sites, data, rounds: int, lr: float, spec: dict, log) -> list[float]:
    if variant == "ccvr":
        return run_ccvr(sites, data, rounds, spec, log)
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
        curve.append(accuracy(model, sites, data))
        log(f"{variant}: round {r + 1} val accuracy {curve[-1]:.3f}")
    return curve


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="seg_synthetic")
    p.add_argument("-n", type=int, default=4)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--variants", default="adam-epoch-local,adam-epoch-sync,adam-full1-local,adam-full1-sync,adam-full5-sync,ccvr")
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
