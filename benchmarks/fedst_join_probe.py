"""Does FedST-join's joint generator switch style with the domain vector? Central vs federated, K local steps x R rounds.

    python benchmarks/fedst_join_probe.py --mode fed --local-steps 10 --steps 240 [--preset fedst_tiny]
        [--sites site-1,site-2] [--lr 2e-3] [--domain-lr 2e-2] [--maps 24] [--seed 0] [--out FILE.jsonl]
        [--full-every 40 --sync-layers domain] [--prox-mu 1] [--keep-other-domains 1] [--exchange-dtype float16]
        [--domain-init-std 1.0] [--quantize-bits 4]

One process, no FLARE, the package's own modules (``medflare.fedst.diffusion`` / ``conditioning``): the generator of the
preset (``diffusion`` section) is trained on the ``--sites``' training images (N sites, two by default), each with its
own one-hot domain vector, for ``--steps`` generator steps in all (the same compute for every mode):

    central  one generator, one Adam, the sites' batches in turn (step i: site i mod N)
    fed      R = steps / (N K) rounds; each round every site starts from the global generator, trains K local steps with
             its own Adam (kept between rounds, never shared, as the site's GeneratorTrainingExecutor does) and returns
             its weight diff; the server adds ``participation_mean`` of the diffs (equal weights), as
             FedSTJoinController does. K = 1 is FedAvg's closest match to central training.
             Cheaper routes (issue 32): ``--sync-layers domain --full-every F`` averages only the domain modulation
             every K steps and the whole generator every F steps (``diffusion.sync_layers``; R = steps / (N F)); with
             ``--full-every F`` alone a round of F steps is split into exchanges of K steps that move the whole generator;
             ``--prox-mu`` adds FedProx's proximal term on the shared layers (``diffusion.prox_mu``), and
             ``--keep-other-domains W`` keeps the generator's predictions for the other domain at those of the generator
             last received (weight W; :func:`medflare.fedst.diffusion.other_domain_term`); ``--exchange-dtype float16``
             sends the generator and the diffs in float16 (``diffusion.exchange_dtype``); ``--quantize-bits B``
             (B = 8 or 4; the job's ``diffusion.exchange_dtype`` int8 / int4 and its codec) sends both ways only B-bit diffs instead, blockwise absmax-scaled
             (64 values per float16 scale), with error feedback: the server sends the global generator minus what the
             sites hold, a site sends its generator minus what it received plus what its last upload's rounding lost.
             The generator bytes one site sent and received are printed (``bytes_per_site``).

Then it draws images from ``--maps`` training label maps of each site with each domain vector and prints the mean
intensity of the drawn images in every label class, next to the real images' means. Style transfer succeeds
("separated") when the images drawn with site A's vector from site B's label maps have, in every class, a mean on
site A's side of the midpoint between the two sites' real means, for both directions (two sites). For any number of
sites it prints the style error (mean |drawn - real| class mean of site A over every pair A, B != A; the mixture's
error, what a generator that ignores its domain vector scores, beside it) and the share of pairs whose drawn means
are nearest to site A's real ones (``identified``). One JSON line per run is appended to ``--out``. benchmarks/RESULTS_fedst.md, section "FedST-join and the style", holds the measured table.
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

from medflare.common.payload import load_numpy_state, nbytes, payload_bytes, state_to_numpy, weight_diff
from medflare.common.quantize import ErrorFeedback, decode, encode
from medflare.common.training import make_loader
from medflare.data import load_site
from medflare.data.util import stable_seed
from medflare.fedst.conditioning import participation_mean
from medflare.fedst.config import DiffusionConfig
from medflare.fedst.diffusion import (ALL, build_style_generator, cycle, exchange_plan, generator_args, generator_nbytes,
                                      frozen_copy, generator_optimizer, in_exchange_dtype, proximal_anchor, sample_images, sampling_scheduler, select_entries,
                                      train_generator, training_scheduler)
from medflare.presets import get_preset


def class_means(images: torch.Tensor, labels: torch.Tensor, num_classes: int) -> list[float]:
    """Mean intensity of ``images`` (N, 1, H, W) inside each label class of ``labels`` (N, 1, H, W)."""
    return [float(images[labels == c].mean()) if (labels == c).any() else float("nan") for c in range(num_classes)]


def real_maps_and_means(site_data, count: int) -> tuple[torch.Tensor, list[float]]:
    """The label maps of a site's first ``count`` training cases and its real images' :func:`class_means` on them."""
    items = [site_data.train[i] for i in range(min(count, len(site_data.train)))]
    maps = torch.stack([torch.as_tensor(it["label"]) for it in items])
    images = torch.stack([torch.as_tensor(it["image"]) for it in items])
    return maps, class_means(images, maps, site_data.num_classes)


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


def style_error(drawn: dict, real: dict, sites: list[str]) -> float:
    """Mean |drawn - real| class mean over every (style A, maps B != A) pair: 0 when every domain vector draws its
    site's class means on the other sites' label maps (any number of sites)."""
    gaps = [abs(value - real[a][c]) for a in sites for b in sites if b != a
            for c, value in enumerate(drawn[f"{a}<-{b}"])]
    return float(np.mean(gaps))


def mixture_error(real: dict, sites: list[str]) -> float:
    """:func:`style_error` of a generator that draws the sites' mean class means for every domain vector (the
    reference a federated generator that ignores its domain vector scores)."""
    mixture = np.mean([real[s] for s in sites], axis=0)
    return style_error({f"{a}<-{b}": list(mixture) for a in sites for b in sites if b != a}, real, sites)


def identified(drawn: dict, real: dict, sites: list[str]) -> float:
    """Share of (style A, maps B != A) pairs whose drawn class means are nearest (Euclidean) to site A's real ones
    among all sites' (chance 1 / number of sites)."""
    hits = [min(sites, key=lambda s: np.linalg.norm(np.subtract(drawn[f"{a}<-{b}"], real[s]))) == a
            for a in sites for b in sites if b != a]
    return float(np.mean(hits))


def _batches(data, batch: int, seed: int, site: str):
    return cycle(lambda epoch: make_loader(data.train, batch, True, seed=stable_seed("fedst-probe", seed, site, epoch)))


def _quantized(diff: dict, bits: int, feedback: ErrorFeedback | None = None) -> tuple[dict, int]:
    """``diff`` as it arrives over ``--quantize-bits``' wire (:mod:`medflare.common.quantize`, the job's codec; with
    ``feedback`` a site's sender, which adds what its last send lost) and its bytes."""
    sent = feedback.send(diff) if feedback else encode(diff, bits)
    return decode(sent, bits), payload_bytes(sent)


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
    plan = exchange_plan(diff)  # steps_per_round = --full-every, sync_steps = --local-steps (see main)
    rounds = max(1, args.steps // (len(sites) * diff.steps_per_round))
    base = {s: state_to_numpy(glob) for s in sites}  # what each site last received, entry by entry
    anchor: dict = {}
    reference: dict = {}
    args.bytes_per_site = 0
    feedback = {s: ErrorFeedback(args.quantize_bits) for s in sites} if args.quantize_bits else {}
    for rnd in range(rounds):
        for ex, (steps, down, up) in enumerate(plan):
            if args.quantize_bits:
                if down != ALL or up != ALL:
                    raise SystemExit("--quantize-bits needs --sync-layers all")
                held = base[sites[0]]  # every site holds the same copy: the sum of what the server sent
                sent_diff, sent_bytes = _quantized(weight_diff(state_to_numpy(glob), held), args.quantize_bits)
                sent = {name: held[name] + sent_diff[name] for name in sent_diff}
            else:
                sent = in_exchange_dtype(select_entries(state_to_numpy(glob), down), args.exchange_dtype)
                sent_bytes = nbytes(sent)
            diffs = []
            for k, s in enumerate(sites):
                base[s].update(sent)
                load_numpy_state(local[s], {**state_to_numpy(local[s]), **sent})
                if down == ALL:
                    anchor[s] = proximal_anchor(local[s])
                    reference[s] = frozen_copy(local[s]) if args.keep_other_domains > 0 else None
                losses += train_generator(local[s], scheduler, optim[s], batches[s], steps, domain_index=k, loss=diff.loss,
                                          seed=args.seed * 100003 + (rnd * len(plan) + ex) * 97 + k,
                                          prox_mu=diff.prox_mu, anchor=anchor[s],
                                          keep_other_domains=args.keep_other_domains, reference=reference[s])
                change = weight_diff(select_entries(state_to_numpy(local[s]), up), base[s])
                if args.quantize_bits:
                    got, up_bytes = _quantized(change, args.quantize_bits, feedback[s])
                    diffs.append(got)
                else:
                    diffs.append(in_exchange_dtype(change, args.exchange_dtype))
                    up_bytes = nbytes(diffs[-1])
            mean = participation_mean(diffs, [1.0] * len(sites))
            now = state_to_numpy(glob)
            load_numpy_state(glob, {**now, **{name: now[name] + mean[name] for name in mean}})
            args.bytes_per_site += sent_bytes + up_bytes
    return glob, losses


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["central", "fed"], default="fed")
    p.add_argument("--local-steps", type=int, default=10, help="K: local generator steps per site and exchange (fed)")
    p.add_argument("--full-every", type=int, default=None,
                   help="local steps per site between two averagings of the whole generator (fed; default K)")
    p.add_argument("--sync-layers", choices=["all", "domain"], default="all",
                   help="what an exchange within a round averages: the whole generator, or the domain modulation only "
                        "(then the whole generator every --full-every steps); diffusion.sync_layers")
    p.add_argument("--prox-mu", type=float, default=0.0, help="diffusion.prox_mu: proximal term on the shared layers (fed)")
    p.add_argument("--keep-other-domains", type=float, default=0.0,
                   help="weight of the term that keeps the other domains' predictions at the received generator's (fed)")
    p.add_argument("--exchange-dtype", choices=["float32", "float16"], default="float32",
                   help="diffusion.exchange_dtype: the float type the generator and the diffs travel in (fed)")
    p.add_argument("--quantize-bits", type=int, choices=[0, 4, 8], default=0,
                   help="send B-bit blockwise diffs both ways with error feedback instead of --exchange-dtype (fed; 0 = off)")
    p.add_argument("--steps", type=int, default=240, help="generator steps in all (both sites together)")
    p.add_argument("--preset", default="fedst_tiny")
    p.add_argument("--sites", default="site-1,site-2")
    p.add_argument("--lr", type=float, default=None, help="default: the preset's diffusion.lr")
    p.add_argument("--domain-lr", type=float, default=None, help="default: the preset's diffusion.domain_lr")
    p.add_argument("--domain-init-std", type=float, default=None,
                   help="diffusion.generator.domain_init_std: initial weight std of the domain modulation (default: the preset's)")
    p.add_argument("--maps", type=int, default=24, help="label maps per site drawn with each domain vector")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="append one JSON line per run here")
    args = p.parse_args(argv)

    full_every = args.full_every or args.local_steps
    cfg = get_preset(args.preset, {"diffusion": {**({"lr": args.lr} if args.lr else {}),
                                                 **({"domain_lr": args.domain_lr} if args.domain_lr else {}),
                                                 **({"generator": {"domain_init_std": args.domain_init_std}}
                                                    if args.domain_init_std is not None else {}),
                                                 "steps_per_round": full_every, "sync_steps": args.local_steps,
                                                 "sync_layers": args.sync_layers, "prox_mu": args.prox_mu}})
    diffusion = DiffusionConfig.from_preset(cfg)
    sites = args.sites.split(",")
    datas = {s: load_site(s, cfg["data"]) for s in sites}
    first = datas[sites[0]]
    num_classes, in_channels = first.num_classes, first.in_channels
    tic = time.perf_counter()
    generator, losses = train(args, cfg, datas, sites, num_classes, in_channels)
    train_s = time.perf_counter() - tic

    maps, real = {}, {}
    for s in sites:
        maps[s], real[s] = real_maps_and_means(datas[s], args.maps)
    drawn = {}
    sampler = sampling_scheduler(diffusion)
    for k, style in enumerate(sites):
        for s in sites:
            images = sample_images(generator, sampler, maps[s], domain_index=k, seed=args.seed)
            drawn[f"{style}<-{s}"] = class_means(images, maps[s], num_classes)
    fed = args.mode == "fed"
    row = {"mode": args.mode, "local_steps": args.local_steps if fed else None,
           "full_every": full_every if fed else None, "sync_layers": args.sync_layers if fed else None,
           "prox_mu": args.prox_mu if fed else None, "keep_other_domains": args.keep_other_domains if fed else None,
           "exchange_dtype": args.exchange_dtype if fed else None, "quantize_bits": args.quantize_bits if fed else None,
           "rounds": args.steps // (len(sites) * full_every) if fed else None,
           "generator_bytes": generator_nbytes(generator),
           "bytes_per_site": getattr(args, "bytes_per_site", 0) if fed else None,
           "steps": args.steps, "lr": cfg["diffusion"]["lr"], "domain_lr": cfg["diffusion"]["domain_lr"],
           "domain_init_std": diffusion.generator["domain_init_std"],
           "preset": args.preset, "seed": args.seed, "sites": sites, "real": real, "drawn": drawn,
           "separated": separated(drawn, real, sites) if len(sites) == 2 else None,
           "style_error": style_error(drawn, real, sites), "mixture_error": mixture_error(real, sites),
           "identified": identified(drawn, real, sites),
           "loss_first10": float(np.mean(losses[:10])), "loss_last10": float(np.mean(losses[-10:])),
           "train_s": round(train_s, 1), "load_avg": [round(x, 2) for x in os.getloadavg()]}
    fmt = lambda v: " / ".join(f"{x:.3f}" for x in v)  # noqa: E731
    print(f"{args.mode} K={row['local_steps']} full_every={row['full_every']} sync_layers={row['sync_layers']} "
          f"prox_mu={row['prox_mu']} keep_other_domains={row['keep_other_domains']} R={row['rounds']} steps={args.steps} lr={row['lr']} domain_lr={row['domain_lr']} "
          f"domain_init_std={row['domain_init_std']} "
          f"train {train_s:.0f}s load {row['load_avg']} L {row['loss_first10']:.3f}->{row['loss_last10']:.3f} "
          f"generator bytes per site {row['bytes_per_site']} (G = {row['generator_bytes']})")
    for s in sites:
        print(f"  real {s}: {fmt(real[s])}")
    for key, value in drawn.items():
        print(f"  drawn {key}: {fmt(value)}")
    print(f"  separated: {row['separated']}  style error {row['style_error']:.3f} (mixture {row['mixture_error']:.3f})  "
          f"identified {row['identified']:.2f} (chance {1 / len(sites):.2f})")
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
