"""Where each round's time goes: wall per round, the sites' compute (train / validate), FLARE's overhead, memory.

    python benchmarks/speed_benchmark.py [--rows fedavg,fedsm,fedavg_paper,fedsm_paper] [--sites 4] [--rounds 5]
        [--modes after,capped,before] [--before-ref 3e1440b] [--out benchmarks/results/speed]

Each row is one job of jobs/ run in the FLARE simulator exactly as a user runs it (``-n N -t N``, a fresh
workspace; only preset, overrides and rounds changed), in up to three modes:
    after   this tree: every site process takes its share of the cores (medflare.common.compute)
    capped  this tree with ``OMP_NUM_THREADS=1`` set by hand (the issue's reference: threads capped by hand)
    before  the tree at ``--before-ref`` (git archive into a temporary folder, put first on PYTHONPATH): no cap
For each run:
    wall s/round     from a round's ROUND_STARTED event on the server to the next one's (rounds 1 to R-2:
                     round 0's model building and first-batch warm-up and the last round's final
                     validation are left out), from a RoundClock widget (round_clock.py) added to the job
    compute s/round  in the same rounds, the slowest site's task compute (what the site executor logs:
                     "task 'train' round r: compute X s (validate Y s, ...)"), its validate part and the rest
                     (training, payload conversion); not logged by the code of ``before`` (shown as n/a)
    overhead s/round wall minus compute: FLARE's messaging and polling, plus the server's own work between
                     rounds (aggregation, FedSM's selector calibration)
    peak MB / site   the largest peak resident memory of a site process (psutil, polled every 0.5 s)
    load             the 1-minute load average before and after the run (the machine may be shared)
    GPU util         mean and 95th percentile of ``nvidia-smi``'s utilisation of GPU 0 over the run, polled with
                     the memory; where there is no ``nvidia-smi`` the columns say so (this script was written
                     and run on a CPU-only machine: the GPU polling has not been exercised on a GPU yet)

Rows are a registry (:data:`ROWS`): a job that lands later (FedVCK, FedIOD, FedST) adds its rows with
:func:`add_row` (job folder, preset, overrides, workflow arguments) and runs with ``--rows``.
Writes speed.csv, speed.md and speed.png to --out.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from medflare.jobs.customize import customize_job
from medflare.jobs.simulate import run_simulator

REPO = Path(__file__).resolve().parents[1]
NO_GPU = "not measured (no GPU in this task)"
BENCH = Path(__file__).resolve().parent
RECORDER = {"id": "round_clock", "path": "round_clock.RoundClock", "args": {}}
_TASK_LINE = re.compile(r"site '([^']+)' task '(\w+)' round (\d+): compute ([\d.]+) s \(validate ([\d.]+) s")


@dataclass
class Row:
    """One benchmark row: a job folder under jobs/, its preset and overrides, extra workflow arguments, a note."""

    job: str
    preset: str
    overrides: dict[str, Any] = field(default_factory=dict)
    workflow_args: dict[str, Any] = field(default_factory=dict)
    note: str = ""


ROWS: dict[str, Row] = {}


def add_row(name: str, row: Row) -> None:
    """Register a row (the hook for jobs that land later: FedVCK, FedIOD, FedST)."""
    ROWS[name] = row


# The paper preset is 256x256 with the FedSM reference UNet; on a 2-core CPU its full data takes minutes per
# round, so its rows use a tenth of the cases (data.scale 0.1) and say so.
_PAPER_SMALL = {"data": {"scale": 0.1}}
add_row("fedavg", Row("fedavg", "seg_synthetic", workflow_args={"num_clients": "{sites}"}))
add_row("fedsm", Row("fedsm", "seg_synthetic"))
add_row("fedavg_paper", Row("fedavg", "seg_paper", _PAPER_SMALL, {"num_clients": "{sites}"}, "seg_paper, data.scale 0.1"))
add_row("fedsm_paper", Row("fedsm", "seg_paper", _PAPER_SMALL, note="seg_paper, data.scale 0.1"))


def _job_args(args: dict[str, Any], sites: int, rounds: int) -> dict[str, Any]:
    out = {k: (sites if v == "{sites}" else v) for k, v in args.items()}
    out["num_rounds"] = rounds
    return out


def _export_tree(ref: str, dst: Path) -> Path:
    """The repository at git ``ref`` (its custom/ and jobs/) in ``dst``."""
    dst.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, "custom", "jobs"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dst)], input=archive, check=True)
    return dst


def _gpu_utilisation() -> float | None:
    """GPU 0's current utilisation in percent from nvidia-smi, or None without one."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=5).stdout
        return float(out.strip().splitlines()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


class _MemoryWatch(threading.Thread):
    """Peak RSS of every site process of one simulator run (processes whose command line holds the workspace),
    and GPU utilisation samples when there is a GPU."""

    def __init__(self, workspace: Path):
        super().__init__(daemon=True)
        self.workspace, self.peak, self.gpu, self.stop = str(workspace), {}, [], threading.Event()

    def gpu_stats(self) -> tuple[Any, Any]:
        if not self.gpu:
            return NO_GPU, NO_GPU
        ordered = sorted(self.gpu)
        return statistics.mean(ordered), ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]

    def run(self):
        while not self.stop.is_set():
            if (util := _gpu_utilisation()) is not None:
                self.gpu.append(util)
            for proc in psutil.process_iter(["pid", "cmdline", "memory_info"]):
                cmd = " ".join(proc.info["cmdline"] or [])
                if "simulator_worker" in cmd and self.workspace in cmd and proc.info["memory_info"]:
                    site = cmd.split("--client ")[1].split()[0] if "--client " in cmd else str(proc.info["pid"])
                    self.peak[site] = max(self.peak.get(site, 0), proc.info["memory_info"].rss)
            self.stop.wait(0.5)


def _round_walls(events_file: Path) -> dict[int, float]:
    """{round: seconds from its start to the next round's start}, from round 1 on (round 0 too when only it is timed)."""
    starts = {}
    for line in events_file.read_text().splitlines():
        e = json.loads(line)
        starts.setdefault(int(e["round"]), e["time"])
    rounds = sorted(starts)
    walls = {a: starts[b] - starts[a] for a, b in zip(rounds, rounds[1:])}
    return {r: w for r, w in walls.items() if r >= 1} or walls


def _compute_per_round(log: str) -> dict[int, tuple[float, float]]:
    """{round: (compute, validate)} of the slowest site's 'train' task in each round."""
    out: dict[int, tuple[float, float]] = {}
    for _site, task, rnd, compute, validate in _TASK_LINE.findall(log):
        if task != "train":
            continue
        r, c, v = int(rnd), float(compute), float(validate)
        if r not in out or c > out[r][0]:
            out[r] = (c, v)
    return out


def measure(name: str, mode: str, sites: int, rounds: int, work: Path, before_tree: Path | None) -> dict[str, Any]:
    row = ROWS[name]
    tree = before_tree if mode == "before" else REPO
    job = customize_job(tree / "jobs" / row.job, work / f"{name}_{mode}", preset=row.preset, overrides=row.overrides,
                        workflow_args=_job_args(row.workflow_args, sites, rounds), server_components=[RECORDER])
    # the job's package (this tree's, or the old one for "before") and the benchmark's RoundClock widget
    env = {"PYTHONPATH": os.pathsep.join([str(tree / "custom"), str(BENCH)])}
    if mode == "capped":
        env["OMP_NUM_THREADS"] = "1"
    ws = work / f"ws_{name}_{mode}"
    load_before = os.getloadavg()[0]
    watch = _MemoryWatch(ws)
    watch.start()
    try:
        run = run_simulator(job, ws, sites, timeout=3600, env=env)
    finally:
        watch.stop.set()
        watch.join()
    load_after = os.getloadavg()[0]
    events = run.server_dir / "round_times.jsonl"
    if run.returncode != 0 or not events.is_file():
        raise RuntimeError(f"{name} ({mode}) failed:\n{run.log[-3000:]}")
    walls = _round_walls(events)
    per_round = _compute_per_round(run.log)
    timed = [r for r in walls if r in per_round]  # the same rounds for wall and compute
    compute = statistics.mean(per_round[r][0] for r in timed) if timed else float("nan")
    validate = statistics.mean(per_round[r][1] for r in timed) if timed else float("nan")
    wall = statistics.mean(walls.values()) if walls else float("nan")
    gpu_mean, gpu_p95 = watch.gpu_stats()
    return {
        "row": name, "mode": mode, "job": row.job, "preset": row.preset, "note": row.note, "sites": sites, "rounds": rounds,
        "wall_s_per_round": wall, "compute_s_per_round": compute, "validate_s_per_round": validate,
        "train_s_per_round": compute - validate, "overhead_s_per_round": wall - compute,
        "peak_mb_per_site": max(watch.peak.values(), default=0) / 2**20, "total_s": run.seconds,
        "load_before": load_before, "load_after": load_after, "gpu_util_mean": gpu_mean, "gpu_util_p95": gpu_p95,
    }


def _f(value: Any, digits: int = 2) -> str:
    if isinstance(value, float):
        return "n/a" if value != value else f"{value:.{digits}f}"
    return str(value)


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ["row", "mode", "wall s/round", "compute s/round", "train s", "validate s", "overhead s/round",
            "wall / (compute + 0.2 s)", "peak MB/site", "total s", "load before/after", "GPU util mean / p95"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ratio = r["wall_s_per_round"] / (r["compute_s_per_round"] + 0.2)
        lines.append("| " + " | ".join([
            f"{r['row']}" + (f" ({r['note']})" if r["note"] else ""), r["mode"], _f(r["wall_s_per_round"]),
            _f(r["compute_s_per_round"]), _f(r["train_s_per_round"]), _f(r["validate_s_per_round"]),
            _f(r["overhead_s_per_round"]), _f(ratio), _f(r["peak_mb_per_site"], 0), _f(r["total_s"], 1),
            f"{r['load_before']:.1f} / {r['load_after']:.1f}",
            r["gpu_util_mean"] if r["gpu_util_mean"] == NO_GPU else f"{r['gpu_util_mean']:.0f}% / {r['gpu_util_p95']:.0f}%",
        ]) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['row']}\n{r['mode']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 4))
    xs = range(len(rows))
    ax.bar(xs, [r["wall_s_per_round"] for r in rows], color="#cccccc", label="wall per round")
    train = [r["train_s_per_round"] if r["train_s_per_round"] == r["train_s_per_round"] else 0 for r in rows]
    val = [r["validate_s_per_round"] if r["validate_s_per_round"] == r["validate_s_per_round"] else 0 for r in rows]
    ax.bar(xs, train, width=0.4, color="#4477aa", label="train (slowest site)")
    ax.bar(xs, val, width=0.4, bottom=train, color="#ee6677", label="validate (slowest site)")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("seconds per round")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="fedavg,fedsm,fedavg_paper,fedsm_paper", help=f"comma-separated, of {sorted(ROWS)}")
    parser.add_argument("--modes", default="after,capped,before")
    parser.add_argument("--sites", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--before-ref", default="3e1440b", help="git ref of the code before the thread cap (default: main before issue 11)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "speed"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    results = []
    with tempfile.TemporaryDirectory(prefix="medflare-speed-") as tmp:
        tmp = Path(tmp)
        before_tree = _export_tree(args.before_ref, tmp / "before") if "before" in modes else None
        for name in [r.strip() for r in args.rows.split(",") if r.strip()]:
            for mode in modes:
                result = measure(name, mode, args.sites, args.rounds, tmp, before_tree)
                print(json.dumps({k: v for k, v in result.items() if not k.startswith("gpu")}), flush=True)
                results.append(result)
                with open(out / "speed.csv", "w", newline="") as f:
                    writer = csv.DictWriter(f, fieldnames=list(results[0]))
                    writer.writeheader()
                    writer.writerows(results)
                (out / "speed.md").write_text(markdown(results))
    plot(results, out / "speed.png")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
