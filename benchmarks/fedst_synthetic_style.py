"""Which style did a FedST run's generators draw? The synthetic images each site holds, against the real sites' images.

    python benchmarks/fedst_synthetic_style.py WORKSPACE [--preset fedst] [--holders site-1,site-3] [--real-images 60]

WORKSPACE is a finished FedST-separate or FedST-join simulator workspace (e.g. a report run's
``runs/seg/fedst_join_seed0/ws``). Every site keeps the images drawn for it in the other sites' styles in
``fedst_site/synthetic/<style site>.pt`` (images, label maps, the round they were drawn in); nothing here leaves a site
that the run did not already keep there. For each holder and each style it prints the mean intensity of the drawn
images inside every label class, next to the same means of that style site's real training images (the preset's
data, regenerated from its seed), and the class contrast (largest minus smallest class mean): a generator that
follows a site's style draws that site's class means and contrast; one that draws the sites' mixture draws means
between the sites' and a smaller contrast. benchmarks/RESULTS_fedst.md, "Full scale", holds what it measured.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from fedst_join_probe import class_means, real_maps_and_means
from medflare.data import load_site
from medflare.presets import get_preset


def _contrast(means: list[float]) -> float:
    return max(means) - min(means)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workspace", type=Path)
    p.add_argument("--preset", default="fedst", help="the run's preset (its data section regenerates the real sites)")
    p.add_argument("--holders", default=None, help="comma-separated sites whose stores to read (default: every site)")
    p.add_argument("--real-images", type=int, default=60, help="real training images per site for the real means")
    args = p.parse_args(argv)
    cfg = get_preset(args.preset)
    stores = sorted(args.workspace.glob("*/simulate_job/app_*/fedst_site/synthetic/*.pt"))
    if args.holders:
        wanted = set(args.holders.split(","))
        stores = [s for s in stores if s.parents[4].name in wanted]
    if not stores:
        print(f"no synthetic stores under {args.workspace}", file=sys.stderr)
        return 1
    real: dict[str, tuple[int, list[float]]] = {}  # style site -> (classes, its real images' class means)
    print("| holder | style of | drawn in round | drawn class means | real class means | drawn / real contrast |")
    print("|---|---|---:|---|---|---|")
    for path in stores:
        holder, style = path.parents[4].name, path.stem
        store = torch.load(path, weights_only=False)
        if style not in real:
            site = load_site(style, cfg["data"])
            real[style] = (site.num_classes, real_maps_and_means(site, args.real_images)[1])
        num_classes, real_means = real[style]
        drawn = class_means(store["images"].float(), store["labels"].long(), num_classes)
        fmt = lambda v: " / ".join(f"{x:.2f}" for x in v)  # noqa: E731 - a table cell
        print(f"| {holder} | {style} | {store.get('round')} | {fmt(drawn)} | {fmt(real_means)} | "
              f"{_contrast(drawn):.2f} / {_contrast(real_means):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
