"""How much the sites' labels overlap: two statistics of a classification split over sites, from the per-class label
counts FedIOD's sites already send for Eq. 8's label factor (``medflare.fediod.site_distill.label_counts``).

- effective classes per site / C: exp of the entropy of a site's label histogram, averaged over sites weighted by
  their size, over the number of classes C (1 = every site holds every class equally, 1/C = one class a site);
- effective holders per class / K: ``1 / sum_k w_kc^2`` with Eq. 8's weights ``w_kc = n_kc / sum_k n_kc``, averaged
  over classes weighted by their frequency, over the number of sites K.

Used for benchmarks/RESULTS_fediod.md, "An ensemble of probabilities": whether the server could choose
``fediod.ensemble_tau`` from these counts (it could not: two splits with the same overlap want opposite settings).

    PYTHONPATH=custom python benchmarks/label_overlap.py --preset fediod_cls --sites 4 --data beta=0.1 [--data ...]

``--data`` is a '+'-joined list of ``key=value`` overrides of the preset's data section, read as ``medflare run --set``
reads them (repeat for several splits).
"""

from __future__ import annotations

import argparse

import numpy as np
from scipy.stats import entropy

from medflare.data import load_site
from medflare.fediod.site_distill import label_counts
from medflare.presets import get_preset, overrides_from_assignments


def overlap(counts: np.ndarray) -> dict[str, float]:
    """The two statistics of a ``(K, C)`` array of per-site label counts."""
    counts = np.asarray(counts, dtype=float)
    sizes = counts.sum(axis=1)
    classes = float(np.sum(np.exp(entropy(counts, axis=1)) * sizes) / sizes.sum())
    w = counts / np.maximum(counts.sum(axis=0, keepdims=True), 1)
    holders_per_class = 1.0 / np.maximum(np.sum(w**2, axis=0), 1e-12)
    frequency = counts.sum(axis=0) / counts.sum()
    holders = float(np.sum(holders_per_class * frequency))
    k, c = counts.shape
    return {"classes_per_site": classes, "classes_per_site_fraction": classes / c,
            "holders_per_class": holders, "holders_per_class_fraction": holders / k}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="fediod_cls")
    ap.add_argument("--sites", type=int, default=0, help="sites site-1..N (default: the preset's num_sites)")
    ap.add_argument("--data", action="append", default=None, help="'+'-joined data overrides; repeat for more splits")
    args = ap.parse_args()
    for text in args.data or [""]:
        data = overrides_from_assignments(filter(None, text.split("+")))
        if args.sites:
            data["num_sites"] = args.sites
        data = get_preset(args.preset, {"data": data})["data"]  # an unknown key is an error, as in a job
        counts = []
        for k in range(1, int(data["num_sites"]) + 1):
            site = load_site(f"site-{k}", data)
            counts.append(np.asarray(label_counts(site.train, site.task, site.num_classes)))
        stats = overlap(np.stack(counts))
        print(f"{args.preset} {text or '(preset data)'} K={data['num_sites']}: effective classes per site "
              f"{stats['classes_per_site']:.2f} ({stats['classes_per_site_fraction']:.2f} of C), effective holders "
              f"per class {stats['holders_per_class']:.2f} ({stats['holders_per_class_fraction']:.2f} of K)")


if __name__ == "__main__":
    main()
