"""Does outlier exposure make the FedIOD teachers' ensemble right where the label skew is strong? Each site's teacher
trained as stage 1 trains it (``medflare.fediod.teacher.train_teacher`` with the site's seed) at each weight of
``--weights`` (``fediod.teacher_outliers``; 0 = the paper's teacher), then on the union of the sites' test splits:
the teachers' label-weighted ensemble (Eq. 8's label factor, what ``fediod_benchmark.py --table curve`` calls the
ceiling of what the student learns) with Eq. 9 and as a probability mixture at ``ensemble_tau`` 1 and 2, for each
exponent of ``--confidence`` (``fediod.ensemble_confidence``: the weights times each teacher's top probability on the
image to that power; 0 = Eq. 8's label factor alone), and each teacher's mean top probability on the test images of
the classes its site does not hold. Two routes no ensemble can take, as bounds on what routing alone could reach:
"holder" asks, for each test image, the teacher of the site with the most training images of its true class;
"any" counts an image right when one teacher's argmax is right. Last, each teacher's own accuracy on the union test set.

Used for benchmarks/RESULTS_fediod.md, "Teachers that know what they do not know", "A teacher's confidence" and "Routing,
not knowledge".

    PYTHONPATH=custom python benchmarks/teacher_outliers.py --preset fediod_cls --sites 4 --data beta=0.1 --seeds 0,1,2,3,4 --weights 0,0.5,1
    PYTHONPATH=custom python benchmarks/teacher_outliers.py --preset fediod_cls --sites 4 --data beta=0.1 --seeds 0,1,2,3,4 --weights 0.5 --confidence 0,1,4,8

``--data`` is a '+'-joined list of ``key=value`` overrides of the preset's data section, read as ``medflare run --set``
reads them. Training runs on the CPU.
"""

from __future__ import annotations

import time

import torch

from medflare.fediod.losses import aggregate, confidence, ensemble_weights, label_ratio
from medflare.fediod.site_distill import label_counts
from medflare.fediod.teacher import teacher_settings, train_teacher
from medflare.fedvck.condense import stack_dataset
from teacher_batchnorm import load_sites, parser  # benchmarks/ is the script's folder

TAUS = (0.0, 1.0, 2.0)  # Eq. 9, then the probability mixtures


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--weights", default="0,0.5", help="comma-separated outlier weights (fediod.teacher_outliers)")
    ap.add_argument("--confidence", default="0", help="comma-separated exponents p of the teachers' confidence factor "
                                                      "(fediod.ensemble_confidence; 0 = without it)")
    args = ap.parse_args()
    powers = [float(p) for p in args.confidence.split(",")]
    cfg, sites = load_sites(args)
    names = list(sites)
    x_test, y_test = (torch.cat(t) for t in zip(*(stack_dataset(s.test) for s in sites.values())))
    counts = torch.stack([label_counts(s.train, s.task, s.num_classes) for s in sites.values()])  # the counts a site sends (noised there under DP)
    ratio = label_ratio(counts)
    foreign = {n: ~torch.isin(y_test, torch.nonzero(counts[i]).flatten()) for i, n in enumerate(names)}
    columns = [("Eq. 9" if tau == 0 else f"tau {tau:g}") + (f", confidence^{p:g}" if p else "") for p in powers for tau in TAUS]
    columns += ["holder", "any"]
    holder = counts.argmax(0)[y_test]  # per test image: the site with the most training images of its true class
    print(f"| seed | outliers | {' | '.join(columns)} | mean top probability on classes the site lacks, per teacher | each teacher alone | s |\n"
          f"|---|---|{'---|' * len(columns)}---|---|---|")
    for seed in (int(s) for s in args.seeds.split(",")):
        for weight in (float(w) for w in args.weights.split(",")):
            tic = time.perf_counter()
            logits = []
            for name, site in sites.items():
                own = {"fediod": {"teacher_train": {"outliers": weight}}}
                spec, train, _, _ = teacher_settings(own, cfg, name, site.num_classes, site.in_channels, int(site.train[0]["image"].shape[-1]))
                teacher, _ = train_teacher(spec, train, site.train, site.task, torch.device("cpu"), seed=seed)
                with torch.no_grad():
                    logits.append(teacher(x_test))
            accuracy = []
            sure = torch.stack([confidence(z) for z in logits])
            for p in powers:
                factor = sure ** p if p else None
                weights = ensemble_weights(ratio, factor).expand(len(names), len(y_test), -1)
                accuracy += [float((aggregate(logits, weights, tau).argmax(1) == y_test).float().mean()) for tau in TAUS]
            right = torch.stack([z.argmax(1) == y_test for z in logits])  # teachers x images
            accuracy += [float(right[holder, torch.arange(len(y_test))].float().mean()), float(right.any(0).float().mean())]
            unsure = [float(z[foreign[n]].softmax(1).max(1).values.mean()) if foreign[n].any() else float("nan")
                      for z, n in zip(logits, names)]
            print(f"| {seed} | {weight:g} | " + " | ".join(f"{a:.3f}" for a in accuracy) + " | "
                  + " / ".join(f"{u:.2f}" for u in unsure) + " | " + " / ".join(f"{float(r.float().mean()):.3f}" for r in right)
                  + f" | {time.perf_counter() - tic:.0f} |", flush=True)


if __name__ == "__main__":
    main()
