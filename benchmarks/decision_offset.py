"""How a saved segmentation model's Dice moves with its decision offset: for each offset the background logit is lowered
by (``medflare.fediod.calibration``), the client-average Dice on the sites' validation and test splits, and the offset the
validation picks (the rule of ``fediod.calibrate_offsets``: the best mean over the sites, ties to the offset nearest 0),
and for comparison the pick of the median over the sites and the client average when each site picks its own offset
on its own validation split.

Used for jobs/fediod_seg/README.md, "The decision offset": FedIOD-seg students (the offset lifts their test Dice)
against FedAvg global models of the same sites (it does not).

    PYTHONPATH=custom python benchmarks/decision_offset.py -n 6 RESULT.pt [RESULT.pt ...]
        [--offsets -1,-0.5,0,0.5,1,1.5,2,3,4] [--out offsets.json]

Each RESULT is any file ``medflare evaluate`` scores (its first predictor); a FedIOD student saved with a decision
offset is scored as saved (its offset on top of the folded one). Sites: ``-n N`` (site-1..site-N) or ``--sites a,b``,
their configured or embedded data as ``medflare evaluate`` finds it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from medflare.common.training import make_loader
from medflare.evaluation import open_result, sources
from medflare.fediod.calibration import best_offset, scores_at_offsets, split_logits

SPLITS = ("validation", "testing")


def offset_table(path: str, sites: list[str], offsets: list[float]) -> dict:
    """``{"offsets": {offset: {split: {site: dice %}}}, "chosen": offset}`` for the result file at ``path``."""
    result, _ = open_result(path, None, "cpu")
    _, predictor = result.predictors({})[0]
    if isinstance(predictor, torch.nn.Module):
        predictor.eval()
    data_cfg = result.description["data"]
    scores = {split: {site: scores_at_offsets(split_logits(predictor, make_loader(ds, 16, False)), offsets, "dice", n)
                      for site, (ds, _, n) in sources(data_cfg, split, sites=sites).items()}
              for split in SPLITS}
    table = {d: {split: {site: 100 * by_offset[d] for site, by_offset in scores[split].items()} for split in SPLITS}
             for d in offsets}
    means = {d: sum(row["validation"].values()) / len(sites) for d, row in table.items()}
    medians = {d: float(np.median(list(row["validation"].values()))) for d, row in table.items()}
    own = {site: best_offset({d: row["validation"][site] for d, row in table.items()}) for site in sites}
    return {"offsets": table, "chosen": best_offset(means), "chosen_by_median": best_offset(medians), "own_offsets": own,
            "own_offsets_test": sum(table[own[site]]["testing"][site] for site in sites) / len(sites)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+")
    p.add_argument("-n", type=int, default=0, help="sites site-1..site-N")
    p.add_argument("--sites", default="", help="comma-separated site names (instead of -n)")
    p.add_argument("--offsets", default="-1,-0.5,0,0.5,1,1.5,2,3,4")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    sites = [s for s in a.sites.split(",") if s] or [f"site-{i}" for i in range(1, a.n + 1)]
    if not sites:
        p.error("give -n N or --sites")
    offsets = [float(v) for v in a.offsets.split(",")]
    report = {}
    for path in a.results:
        res = report[path] = offset_table(path, sites, offsets)
        print(f"\n{path}\n| offset | val client avg | test client avg | test per site ({', '.join(sites)}) |\n|---|---|---|---|")
        for d, row in res["offsets"].items():
            mark = " (chosen)" if d == res["chosen"] else ""
            val, test = (sum(row[s].values()) / len(sites) for s in SPLITS)
            print(f"| {d:g}{mark} | {val:.2f} | {test:.2f} | " + " / ".join(f"{row['testing'][s]:.2f}" for s in sites) + " |")
        by_median = res["chosen_by_median"]
        print(f"picked by the median over the sites instead of the mean: {by_median:g} (test client average "
              f"{sum(res['offsets'][by_median]['testing'].values()) / len(sites):.2f}); each site its own offset on its own "
              f"validation split ({', '.join(f'{s} {d:g}' for s, d in res['own_offsets'].items())}): {res['own_offsets_test']:.2f}")
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
