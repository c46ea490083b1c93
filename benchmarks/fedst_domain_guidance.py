"""Does domain guidance make a trained FedST-join generator follow the sites' styles? A screen on a saved generator.

    python benchmarks/fedst_domain_guidance.py RUN/FedST_join_generator.pt [--preset fedst] [--weights 0,1,2,4]
        [--maps 8] [--seed 0]

Loads the joint generator a FedST-join run saved (the server's ``FedST_join_generator.pt``), draws every site's first
``--maps`` training label maps in every other site's style with ``diffusion.domain_guidance`` w (each w in
``--weights``: :func:`medflare.fedst.diffusion.domain_guided`, ``f(x, d) + w (f(x, d) - f(x, d_mix))``) and prints,
per w, the probe's style error (mean |drawn - real| class mean over every style/maps pair), the share of pairs
identified (drawn class means nearest to the style site's real ones) and each style's drawn class contrast against
its real one (benchmarks/fedst_join_probe.py's measures; the real images come from the preset's data section). Only
sampling: no training, no FLARE. benchmarks/RESULTS_fedst.md, "Domain guidance", holds what it measured.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from fedst_join_probe import class_means, identified, mixture_error, real_maps_and_means, style_error
from medflare.data import load_site
from medflare.fedst.diffusion import sample_images, sampling_scheduler
from medflare.fedst.results import JOIN_GENERATOR, load_fedst_result
from medflare.presets import get_preset


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("generator", type=Path, help="a FedST-join run's FedST_join_generator.pt")
    p.add_argument("--preset", default="fedst", help="the run's preset (its data section regenerates the real sites)")
    p.add_argument("--weights", default="0,1,2,4", help="comma-separated guidance weights to screen")
    p.add_argument("--maps", type=int, default=8, help="training label maps per site to draw from")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling noise")
    args = p.parse_args(argv)
    cfg = get_preset(args.preset)
    saved = load_fedst_result(args.generator)
    if saved.kind != JOIN_GENERATOR:
        p.error(f"{args.generator} is a {saved.kind}, not a FedST-join generator")
    sites = saved.domains
    generator = saved.networks["generator"]
    sampler = sampling_scheduler(saved.diffusion)  # the sampler the run's sites used
    datas = {s: load_site(s, cfg["data"]) for s in sites}
    num_classes = datas[sites[0]].num_classes
    maps, real = {}, {}
    for s in sites:
        maps[s], real[s] = real_maps_and_means(datas[s], args.maps)
    fmt = lambda v: " / ".join(f"{x:.2f}" for x in v)  # noqa: E731 - a table cell
    print(f"{args.generator} (round {saved.info.get('round')}), sites {sites}, {args.maps} maps each, sampling seed {args.seed}")
    print(f"mixture style error (a generator that ignores its domain vector): {mixture_error(real, sites):.3f}")
    for s in sites:
        print(f"  real {s}: {fmt(real[s])} (contrast {max(real[s]) - min(real[s]):.2f})")
    print("| w | style error | identified | drawn contrast per style (" + " / ".join(sites) + ") | s |")
    print("|---|---|---|---|---|")
    for w in (float(x) for x in args.weights.split(",")):
        tic, drawn = time.perf_counter(), {}
        for k, style in enumerate(sites):
            for s in sites:
                if s != style:
                    images = sample_images(generator, sampler, maps[s], domain_index=k, seed=args.seed, guidance=w)
                    drawn[f"{style}<-{s}"] = class_means(images, maps[s], num_classes)
        contrast = [np.mean([max(v) - min(v) for key, v in drawn.items() if key.startswith(f"{style}<-")]) for style in sites]
        print(f"| {w:g} | {style_error(drawn, real, sites):.3f} | {identified(drawn, real, sites):.2f} | {fmt(contrast)} | "
              f"{time.perf_counter() - tic:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
