"""Peak memory and time of a site's volume data under each ``data.cache`` mode, for two data set sizes.

    python benchmarks/data_memory.py [--volumes 12 48] [--shape 128 128 40] [--out benchmarks/results/data_memory]

Writes NIfTI volumes (float32, anisotropic, non-RAS) as a hospital stores them, then, in a fresh process per
(mode, size) so that peaks do not mix, loads the site with preset ``seg_volumes_2d`` (reoriented to RAS,
percentile scaling, in-plane size 128 x 128, augmentation off), runs one shuffled epoch over the 2D slices
(batch 8, loading only: no model) and one pass over the whole validation volumes, and reports the process's peak resident
memory (``ru_maxrss``) and the seconds each step took. "memory" (MONAI CacheDataset, rate 1) holds every
preprocessed volume in RAM, so its peak grows with the data set; "disk" (MONAI PersistentDataset) holds one
volume at a time, so its peak should not grow; its first load writes the cache (volumes and, for 2D, their
slices), the second reads it. ("none" re-preprocesses a volume for every slice read and is left out.) The
machine's load average is recorded with the numbers: timings on a shared machine vary with it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _measure(data_dir: str, mode: str, cache_dir: str) -> dict:
    """Run in a child process: load the site, one epoch of slices, one pass of volumes; peak RSS and times."""
    import torch

    from medflare.common.training import make_loader
    from medflare.data import load_site
    from medflare.presets import get_preset

    os.environ["MEDFLARE_DATA"] = data_dir
    cache = {"mode": mode, "rate": 1.0, "dir": cache_dir if mode == "disk" else None}
    no_aug = {"flip": 0.0, "rotate": 0.0, "intensity": 0.0, "contrast": 0.0, "prob": 0.0}  # loading only
    data = get_preset("seg_volumes_2d", {"data": {"cache": cache, "augment": no_aug}})["data"]
    out = {"mode": mode, "rss_imports_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    tic = time.perf_counter()
    site = load_site("site-1", data)
    out["load_s"] = time.perf_counter() - tic
    out["rss_after_load_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    tic = time.perf_counter()
    slices = 0
    for batch in make_loader(site.train, 8, True, seed=0):
        slices += batch["image"].shape[0]
    out["epoch_s"], out["slices"] = time.perf_counter() - tic, slices
    tic = time.perf_counter()
    voxels = 0
    for batch in site.whole_volumes.loader("val"):
        voxels += batch["image"].numel()
    out["val_pass_s"] = time.perf_counter() - tic
    first = site.whole_volumes.datasets["val"][0]
    content = json.loads((Path(data_dir) / "site-1.json").read_text())
    volumes = sum(len(content[k]) for k in ("training", "validation", "testing"))
    out["data_mb"] = round(volumes * (first["image"].nbytes + first["label"].numel()) / 2**20)  # label kept as uint8
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    del torch
    return out


def _write_site(folder: Path, n: int, shape: tuple[int, int, int]) -> None:
    """``n`` volumes under ``folder`` with datalist ``folder/site-1.json``."""
    from medflare.testing.hospital_data import write_volume_site

    if not (folder / "site-1.json").is_file():
        write_volume_site(folder / "vols", n, shape=shape, datalist=folder / "site-1.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--volumes", type=int, nargs="+", default=[12, 48])
    parser.add_argument("--shape", type=int, nargs=3, default=[128, 128, 40])
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "data_memory"))
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_measure(*args.child)))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in args.volumes:
        folder = out / f"site_{n}"
        _write_site(folder, n, tuple(args.shape))
        for mode, label in (("memory", "memory"), ("disk", "disk (first: writes cache)"), ("disk", "disk (cached)")):
            env = {**os.environ, "OMP_NUM_THREADS": "1", "MEDFLARE_CACHE": str(out / "cache")}
            load = os.getloadavg()[0]
            proc = subprocess.run([sys.executable, __file__, "--child", str(folder), mode, str(folder / "disk_cache")],
                                  env=env, capture_output=True, text=True, check=True)
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            row.update(volumes=n, label=label, load_avg=round(load, 1))
            rows.append(row)
            print(row, flush=True)
        if (folder / "disk_cache").exists():
            import shutil

            shutil.rmtree(folder / "disk_cache")
    lines = [f"# data.cache: peak memory and time ({datetime.now():%Y-%m-%d %H:%M}, shape {args.shape}, "
             "seg_volumes_2d at 128 x 128)", "",
             "| volumes | preprocessed MB | cache | peak RSS MB | of which imports MB | load s | epoch of slices s | val volumes s | slices | load avg |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['volumes']} | {r['data_mb']} | {r['label']} | {r['peak_rss_mb']:.0f} | {r['rss_imports_mb']:.0f} | {r['load_s']:.1f} | "
              f"{r['epoch_s']:.1f} | {r['val_pass_s']:.1f} | {r['slices']} | {r['load_avg']} |" for r in rows]
    (out / "data_memory.md").write_text("\n".join(lines) + "\n")
    (out / "data_memory.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
