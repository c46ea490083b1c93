"""FLARE's per-round overhead: wall time per round minus the clients' own compute, with a trivial model.

    python benchmarks/flare_overhead.py [--rounds 10] [--out benchmarks/results/overhead]

Runs jobs/fedavg in the simulator with 2 clients and a near-empty model/step budget under several
timing settings, and reports for each: wall seconds per round (between the server's "Round N started"
lines), the slowest client's compute per round (the whole task, as the site executor logs it),
and their difference, the overhead, with the 1-minute load average before and after each run (the machine may
be shared). Writes overhead.md and overhead.csv.

The settings compared:
  stock   : FLARE's timings: the server asks idle clients to retry in ``server.task_request_interval`` = 2 s
            and checks task status every ``task_check_period`` = 0.5 s; clients' first poll waits 0.5 s.
  polling : 0.1 s for each (medflare's timings before the next-task wait), plain FLARE polling.
  tight   : 0.02 s for each, plain polling, to see what polling still costs.
  medflare: what our jobs ship (see jobs/*/app/config): sites that wait for their next task
            (medflare.common.task_wait) instead of polling into FLARE's retry sleeps, then ask for it
            after 0.02 s; the workflow's task monitor really checks every 0.02 s (FLARE 2.9 ignores a
            workflow's task_check_period and checks every 0.2 s; the wait's server component fixes that).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import sys
import tempfile
from datetime import datetime
from pathlib import Path

from medflare.jobs.customize import customize_job
from medflare.jobs.simulate import run_simulator

REPO = Path(__file__).resolve().parents[1]
TRIVIAL = {
    "model": {"args": {"in_channels": 1, "out_channels": 3, "channels": [2, 4], "strides": [2]}},
    "train": {"max_steps": 1, "epochs": 1},
}
#: name -> (server config, workflow args, client config, keep the next-task wait of medflare.common.task_wait)
SETTINGS = {
    "stock": ({"server": {"task_request_interval": 2.0}}, {"task_check_period": 0.5}, {"default_task_fetch_interval": 0.5}, False),
    "polling": ({"server": {"task_request_interval": 0.1}}, {"task_check_period": 0.1}, {"default_task_fetch_interval": 0.1}, False),
    "tight": ({"server": {"task_request_interval": 0.02}}, {"task_check_period": 0.02}, {"default_task_fetch_interval": 0.02}, False),
    "medflare": ({"server": {"task_request_interval": 0.02}}, {"task_check_period": 0.02}, {"default_task_fetch_interval": 0.02}, True),
}
WAIT_COMPONENTS = ("task_ready", "wait_for_next_task")


def _without_wait(job: Path) -> None:
    """Drop the next-task wait components from a job copy (FLARE's plain polling)."""
    for path in job.glob("*/config/config_fed_*.json"):
        config = json.loads(path.read_text())
        config["components"] = [c for c in config.get("components", []) if c.get("id") not in WAIT_COMPONENTS]
        path.write_text(json.dumps(config, indent=2))
_STAMP = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})"


def _banner_times(log: str, text: str) -> list[datetime]:
    """Timestamps of FLARE's centred banner messages ("Round 3 started.") which span three log lines."""
    found = re.findall(_STAMP + r" - \w+ - \s*\n[-=]+\n\s*" + text, log)
    return [datetime.strptime(m, "%Y-%m-%d %H:%M:%S,%f") for m in found]


def measure(name: str, rounds: int, work: Path) -> dict:
    server, workflow, client, wait = SETTINGS[name]
    job = customize_job(
        REPO / "jobs" / "fedavg", work / name, preset="seg_synthetic_tiny", overrides=TRIVIAL,
        workflow_args={"num_rounds": rounds, "num_clients": 2, **workflow},
        server_settings=server, client_settings=client,
    )
    if not wait:
        _without_wait(job)
    load_before = os.getloadavg()[0]  # the machine may be shared: every timing comes with its load
    run = run_simulator(job, work / f"ws_{name}", 2, timeout=900)
    load_after = os.getloadavg()[0]
    starts = _banner_times(run.log, r"Round \d+ started")
    end = _banner_times(run.log, r"Finished FedAvg")
    if run.returncode != 0 or len(starts) != rounds or not end:
        raise RuntimeError(f"{name}: simulator run failed:\n{run.log[-3000:]}")
    # From round 1 on: round 0 also pays for loading the sites' data and building models.
    wall = (end[0] - starts[1]).total_seconds() / (rounds - 1)
    per_round: dict[str, float] = {}  # the slowest client's validate + train seconds in each round
    for rnd, compute_s in re.findall(r"task 'train' round (\d+): compute ([\d.]+) s", run.log):
        per_round[rnd] = max(per_round.get(rnd, 0.0), float(compute_s))
    per_round.pop("0", None)
    per_round_compute = sum(per_round.values()) / max(1, len(per_round))
    return {"setting": name, "rounds": rounds, "wall_s_per_round": wall, "compute_s_per_round": per_round_compute,
            "overhead_s_per_round": wall - per_round_compute, "total_s": run.seconds,
            "load_before": load_before, "load_after": load_after}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {list(SETTINGS)}")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "overhead"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(name.strip(), args.rounds, Path(tmp)) for name in args.settings.split(",") if name.strip()]
    with open(out / "overhead.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| setting | wall s/round | client compute s/round | FLARE overhead s/round | total s | load before/after |",
             "|---|---|---|---|---|---|"]
    lines += [
        f"| {r['setting']} | {r['wall_s_per_round']:.2f} | {r['compute_s_per_round']:.2f} | {r['overhead_s_per_round']:.2f} | {r['total_s']:.1f} "
        f"| {r['load_before']:.1f} / {r['load_after']:.1f} |"
        for r in rows
    ]
    (out / "overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
