"""Two methods scored at the same seeds: how far apart, and how sure.

Issue 32 asks for "at or above FedAvg" or "within FedST-separate's seed spread", and the report compares means with
their sample standard deviations. With a handful of seeds, and runs paired by seed (same sites, same data split, same
initialisation where the methods share a network), the paired differences say more: their mean, a Student-t 95 %
interval for it, how many seeds each method wins, and the Wilcoxon signed-rank test's two-sided p (scipy). The inputs
are the per-seed numbers the RESULTS files record (each run's `medflare report` record or `medflare evaluate` output);
this script only does the arithmetic, so that every interval quoted in benchmarks/RESULTS_report.md has its command.

    python benchmarks/paired_seeds.py --a "FedIOD-seg=66.81,72.89,73.93" --b "FedAvg=71.23,72.78,73.87"
    python benchmarks/paired_seeds.py --a ... --b ... --seeds 0,1,2 --margin 0.81   # b's spread as a margin
"""

from __future__ import annotations

import argparse
import math
import statistics

from scipy import stats


def parse(text: str) -> tuple[str, list[float]]:
    """``"NAME=v1,v2,..."`` -> (NAME, [v1, v2, ...])."""
    name, sep, values = text.partition("=")
    if not sep or not values:
        raise SystemExit(f"'{text}' is not NAME=v1,v2,...")
    return name.strip(), [float(v) for v in values.split(",")]


def paired(a: list[float], b: list[float]) -> dict[str, float]:
    """Summary of the paired differences a - b: mean, sample std, t interval (95 %), wins of a, Wilcoxon p."""
    if len(a) != len(b) or len(a) < 2:
        raise SystemExit(f"need two equally long lists of at least 2 seeds, got {len(a)} and {len(b)}")
    d = [x - y for x, y in zip(a, b)]
    n, mean, sd = len(d), statistics.fmean(d), statistics.stdev(d)
    half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    p = float(stats.wilcoxon(d).pvalue) if any(d) else 1.0
    return {"n": n, "mean": mean, "sd": sd, "low": mean - half, "high": mean + half, "wins": sum(x > 0 for x in d),
            "p_wilcoxon": p, "diffs": d}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, help="NAME=v1,v2,... (the method under test)")
    ap.add_argument("--b", required=True, help="NAME=v1,v2,... (the reference, same seeds in the same order)")
    ap.add_argument("--seeds", default="", help="labels of the seeds, comma-separated (for the printout only)")
    ap.add_argument("--margin", type=float, default=0.0,
                    help="also say whether the interval's lower end is above -margin (e.g. the reference's seed std)")
    args = ap.parse_args()
    (na, a), (nb, b) = parse(args.a), parse(args.b)
    r = paired(a, b)
    seeds = args.seeds.split(",") if args.seeds else [str(i) for i in range(len(a))]
    print(f"{na} - {nb}, paired by seed ({r['n']} seeds)")
    print("  per seed: " + " / ".join(f"{s}: {x:+.2f}" for s, x in zip(seeds, r["diffs"])))
    print(f"  means: {na} {statistics.fmean(a):.2f} +- {statistics.stdev(a):.2f}, {nb} {statistics.fmean(b):.2f} +- "
          f"{statistics.stdev(b):.2f} (sample std)")
    print(f"  paired difference: {r['mean']:+.2f} +- {r['sd']:.2f} (sample std); 95 % t interval "
          f"[{r['low']:+.2f}, {r['high']:+.2f}]; {na} wins {r['wins']} of {r['n']}; Wilcoxon p = {r['p_wilcoxon']:.3f}")
    if args.margin:
        verdict = "above" if r["low"] > -args.margin else "not above"
        print(f"  lower end {r['low']:+.2f} is {verdict} -{args.margin:.2f}")


if __name__ == "__main__":
    main()
