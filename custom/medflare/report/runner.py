"""One way to run a report row and record what it measured; the report and the benchmark scripts share it.

:func:`run_job` runs one shipped job (exported from its recipe, customised with a preset, rounds and workflow
arguments) in the FLARE simulator with a :class:`~medflare.report.traffic.TrafficMeter` on the server, while
:class:`PeakMemory` samples the resident memory of every process of the run. :func:`run_row` turns a
:class:`~medflare.report.methods.Method` into a record (a JSON-able dict): scores from
:func:`medflare.evaluation.evaluate_result` (what ``medflare evaluate`` computes) on the sites' test splits (the same
scoring for every row), the learning curve, bytes each way per site and round,
every channel's bytes each site sent (the egress recorder's, :func:`~medflare.report.traffic.summarize_egress`),
what kinds of payload left the sites, wall time, compute on the critical path and FLARE overhead (see
:mod:`medflare.report.traffic`), peak memory per site process, each site's epsilon where the result holds
one, and the :func:`environment` it ran in (a row's scores reproduce to the digit only there). A record is
written to disk and reused by the next run unless ``rerun`` (resume after an interruption).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from medflare import MedflareError
from medflare.common.compute import available_cores
from medflare.presets import get_preset
from medflare.report.compute import budget, compute_of, steps_per_site
from medflare.report.methods import METHODS, SCORE_METRICS, Method, method_mode, task_data
from medflare.report.traffic import LEDGER, meter_filters, read_ledger, summarize, summarize_egress


class _Polling:
    """Calls :meth:`poll` every ``interval`` s in a daemon thread while the context is open (and once at exit)."""

    def __init__(self, interval: float = 1.0):
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(Exception):
            self.poll()

    def poll(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # a process may end, a file may be half written, between polls
                self.poll()
            self._stop.wait(self.interval)


class PeakMemory(_Polling):
    """Peak resident memory (MB) of each process whose command line names ``marker`` (the run's workspace) or whose
    working folder is in it, sampled every ``interval`` s in a thread: ``{client name or "server": MB}`` (a simulator
    site's worker is ``--client <name>`` and works in ``<workspace>/<name>``; the simulator's own processes, which host
    the server, count as "server"). The working folder finds a site process started by a fork, whose command line is
    its parent's (the test suite's fork server, :func:`medflare.jobs.simulate.start_fork_server`)."""

    def __init__(self, marker: str, interval: float = 1.0):
        super().__init__(interval)
        self.marker = marker
        self.peak: dict[str, float] = {}

    def poll(self) -> None:
        import psutil

        root = Path(self.marker)
        for proc in psutil.process_iter(["cmdline", "memory_info", "cwd"]):
            cmd, cwd = proc.info.get("cmdline") or [], proc.info.get("cwd") or ""
            mem = proc.info.get("memory_info")
            if mem is None:
                continue
            if any(self.marker in part for part in cmd):
                name = cmd[cmd.index("--client") + 1] if "--client" in cmd[:-1] else "server"
            elif cwd and Path(cwd).is_relative_to(root):
                name = (Path(cwd).relative_to(root).parts or ("server",))[0]
            else:
                continue
            self.peak[name] = max(self.peak.get(name, 0.0), mem.rss / 2**20)


class RoundProgress(_Polling):
    """Calls ``on_round(r)`` once for each new round the job hands tasks out in, read from the traffic meter's
    ledger as it grows (FLARE's round number, 0-based, of every task the server sends): the report's terminal
    progress inside a job, the same for every algorithm because every job's server carries the meter."""

    def __init__(self, ledger: Path, on_round: Callable[[int], None], interval: float = 2.0):
        super().__init__(interval)
        self.ledger, self.on_round = Path(ledger), on_round
        self.latest: int | None = None
        self._offset = 0

    def poll(self) -> None:
        if not self.ledger.is_file():
            return
        with open(self.ledger, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next poll
        self._offset += len(complete)
        for line in complete.decode().splitlines():
            row = json.loads(line)
            rnd = row.get("round")
            if row.get("dir") == "down" and isinstance(rnd, int) and (self.latest is None or rnd > self.latest):
                self.latest = rnd
                self.on_round(rnd)


def export_job(name: str, dst: Path, *, preset: str, overrides: Mapping[str, Any] | None, workflow_args: Mapping[str, Any],
               seed: int | None = None) -> Path:
    """The recipe's job folder (as shipped under jobs/, exported with ``seed``: its persistor, executors and workflow)
    customised for one run, with the traffic meters added on the server."""
    from medflare.jobs.customize import customize_job
    from medflare.jobs.export import export

    with tempfile.TemporaryDirectory() as tmp:
        job = customize_job(export(name, Path(tmp), seed), dst, preset=preset, overrides=overrides, workflow_args=workflow_args)
    for path in job.glob("app*/config/config_fed_server.json"):
        config = json.loads(path.read_text())
        meter_filters(config)
        path.write_text(json.dumps(config, indent=2))
    return job


def run_job(name: str, work: Path, sites: list[str], *, preset: str, overrides: Mapping[str, Any] | None = None,
            workflow_args: Mapping[str, Any] | None = None, seed: int | None = None, timeout: float = 6 * 3600,
            env: Mapping[str, str] | None = None, on_round: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Run job ``name`` in the simulator on ``sites``; returns the SimRun, traffic summary and peak memory.
    The run carries the egress recorder at every site (``audit``): the traffic summary's ``egress`` counts what the
    sites sent on every channel, not only task results (None when nothing was recorded).
    ``on_round(r)`` is called as the server starts handing out round ``r``'s tasks (:class:`RoundProgress`)."""
    from medflare.jobs.egress import FILE_NAME as EGRESS_FILE
    from medflare.jobs.simulate import run_simulator, server_dir

    job = export_job(name, work / "job", preset=preset, overrides=overrides, workflow_args=workflow_args or {}, seed=seed)
    ws = work / "ws"
    ledger = server_dir(ws) / "app_server" / LEDGER
    ledger.unlink(missing_ok=True)  # a rerun's progress must not be read from the last run's ledger
    for old in ws.glob(f"*/simulate_job/{EGRESS_FILE}"):  # nor its bytes from the last run's egress records (appended)
        old.unlink()
    with PeakMemory(str(ws)) as memory, RoundProgress(ledger, on_round or (lambda r: None)):
        run = run_simulator(job, ws, len(sites), clients=sites, timeout=timeout, env=dict(env or {}), audit=True)
    if run.returncode != 0 or "EXECUTION_EXCEPTION" in run.log:
        raise MedflareError(f"job '{name}' failed in the simulator (workspace {ws}):\n{run.log[-3000:]}")
    traffic = summarize(read_ledger(run.app_server / LEDGER))
    traffic["egress"] = summarize_egress(run.egress(), {s: len(r) for s, r in traffic["per_site"].items()})
    return {"run": run, "traffic": traffic, "peak_mb": memory.peak}


@dataclass(frozen=True)
class Row:
    """What to run: a method on a task's sites at one skew (classification) and seed, for ``rounds`` rounds.
    ``match``: the method (full name, e.g. ``fedvck``) whose optimisation steps per round this baseline row gets
    (``--match-compute``): ``steps`` per site and round, resolved from that row's record when the row runs
    (:func:`resolve_match`). ``settings``: overrides merged over the task's data block (a benchmark's own sites and
    model), the same for every row it builds."""

    method: Method
    sites: tuple[str, ...]
    rounds: int
    mode: str = "quick"
    seed: int = 0
    skew: float | None = None
    match: str | None = None
    steps: int | None = None
    settings: Mapping[str, Any] | None = field(default=None, hash=False, compare=False)

    @property
    def preset(self) -> str:
        return self.method.presets[self.mode]

    @property
    def name(self) -> str:
        """The record's method name: the method's, with ``_match_<reference>`` for a row at another's budget."""
        return self.method.name + (f"_match_{self.match}" if self.match else "")

    @property
    def label(self) -> str:
        return self.method.label + (f" (steps of {METHODS[self.match].label})" if self.match else "")

    @property
    def overrides(self) -> dict[str, Any]:
        data = task_data(self.method.task, self.mode)  # every row of a task reads the same data, whatever its preset
        if self.skew is not None:  # same Dirichlet split of the same synthetic pool for every classification row
            data.update(beta=self.skew, num_sites=max(len(self.sites), 2))
        out = merge({**copy.deepcopy(self.method.overrides), "data": data}, self.settings or {})
        if self.steps is not None:  # exactly this many steps per round: at least and at most
            out = merge(out, {"train": {"min_steps": self.steps, "max_steps": self.steps}})
        return out

    @property
    def recorded_settings(self) -> dict[str, Any]:
        """``settings`` as a record's JSON holds them (tuples read back as lists): what a record keeps and is compared
        with when it is reused (:func:`reusable`)."""
        return json.loads(json.dumps(dict(self.settings or {}), default=float))

    @property
    def key(self) -> str:
        skew = f"_beta{self.skew:g}" if self.skew is not None else ""
        return f"{self.method.task}{skew}/{self.name}_seed{self.seed}"

    def reference(self) -> "Row":
        """The row whose step budget a matched row gets: the reference method on the same sites, skew and seed."""
        return replace(self, method=METHODS[self.match], match=None, steps=None)


def merge(base: Mapping[str, Any], more: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``more`` merged in, nested dicts key by key (a copy; neither argument changes)."""
    out = dict(base)
    for k, v in more.items():
        out[k] = merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out


def resolve_match(row: Row, out: Path) -> Row:
    """A matched row with its ``steps`` per site: the reference row's budget (every site's plus the server's steps per
    round, :func:`medflare.report.compute.budget`) split evenly over this row's sites; the reference must have run."""
    if row.match is None or row.steps is not None:
        return row
    path = record_path(out, row.reference())
    if not path.is_file():
        raise MedflareError(f"row '{row.key}' runs at the steps of '{row.reference().key}', which has no record yet "
                            f"({path}): run that row first (the report plans it before the matched rows)")
    try:
        total = budget(json.loads(path.read_text()))
    except ValueError as e:
        raise MedflareError(f"row '{row.key}': {e} ({path})") from e
    return replace(row, steps=steps_per_site(total, len(row.sites)))


def record_path(out: Path, row: Row) -> Path:
    return out / "records" / f"{row.key}.json"


def run_row(row: Row, out: Path, *, rerun: bool = False, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The row's record: read from ``out/records`` when it is there (unless ``rerun``), else measured and written."""
    path = record_path(out, row)
    if path.is_file() and not rerun:
        return reusable(json.loads(path.read_text()), row, path)
    row = resolve_match(row, out)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    record = _standalone(row) if row.method.standalone else _federated(row, out / "runs" / row.key, log)
    record.update(method=row.name, label=row.label, task=row.method.task, skew=row.skew, seed=row.seed,
                  sites=list(row.sites), rounds=row.rounds, mode=row.mode, preset=row.preset,
                  local_epochs=get_preset(row.preset, row.overrides)["train"].get("epochs"),
                  seconds=time.perf_counter() - start, load=[load, os.getloadavg()[0]], device=device_name(),
                  match=row.match, steps_per_site=row.steps, settings=row.recorded_settings,
                  environment=environment())
    compute = record["traffic"]["compute_s"] if record.get("traffic") else record["seconds"]  # no federation: all compute
    record.update(compute_s=compute, overhead_s=record["seconds"] - compute)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=float))
    return record


def reusable(record: dict[str, Any], row: Row, path: Path) -> dict[str, Any]:
    """``record`` if it was run with ``row``'s settings (``medflare report --set``), else MedflareError: a record's
    path names the method, task, skew and seed only, so a folder of rows run on other data (``--set data.scale=0.25``)
    would otherwise fill this report's tables without a word. Records from before settings were recorded had none."""
    ran, asked = record.get("settings") or {}, row.recorded_settings
    if ran != asked:
        raise MedflareError(f"{path} was run with settings {json.dumps(ran)}, this report asks for {json.dumps(asked)}: "
                            "write to another --out, or pass --rerun to run the row again")
    return record


def environment() -> dict[str, Any]:
    """What a row's numbers depend on besides the code, the data and the seed: the CPU, the library versions (CUDA's
    too, ``None`` for a CPU build of torch) and the torch threads.

    Runs are deterministic for one environment, not across them: the float reductions of a convolution differ with
    the thread count and the CPU's vector kernels, and after a few hundred optimiser steps that moves a score (the
    centralised segmentation row at seed 0 gave 81.30 at one torch thread and 80.82 at two, same commit and
    machine). ``cores`` are the ones this process may use (affinity and container quota,
    :func:`~medflare.common.compute.available_cores`, what the thread shares are cut from); ``torch_threads`` is this
    process's count (a standalone row trains in it); the FLARE rows' site processes take their share of the cores
    (:mod:`medflare.common.compute`), which ``OMP_NUM_THREADS`` caps.
    """
    import platform

    import monai
    import nvflare
    import torch

    return {"cpu": cpu_model(), "cores": available_cores(), "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "monai": monai.__version__,
            "nvflare": nvflare.__version__, "torch_threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}


def cpu_model(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> str:
    """The CPU's model name (Linux's ``/proc/cpuinfo``), else what :mod:`platform` knows, else "unknown"."""
    import platform

    with contextlib.suppress(OSError):
        for line in Path(cpuinfo).read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    return platform.processor() or platform.machine() or "unknown"


def device_name() -> str:
    """What the row's training ran on: the GPU's name when CUDA is visible (every executor and the standalone
    trainer use it then), else ``cpu``; the report marks timings taken on a GPU as GPU figures."""
    import torch

    return f"GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "cpu"


def standalone_row(mode: str, preset: str, sites: list[str], rounds: int, overrides: Mapping[str, Any] | None = None,
                   seed: int = 0, metrics: list[str] | None = None) -> dict[str, Any]:
    """Local-only or centralised training with as many passes over the data as ``rounds`` FL rounds (rounds x the
    preset's local epochs): ``site_table`` of the test split (scored with ``metrics`` when given) plus ``curve``, the
    client-average validation key metric after each round's worth of epochs, and ``curve_x`` (1..rounds)."""
    from medflare.baselines.standalone import run_standalone

    epochs_per_round = int(get_preset(preset, overrides)["train"].get("epochs", 1))
    scoring = {**(overrides or {}), **({"eval": {"metrics": list(metrics)}} if metrics else {})}
    table = run_standalone(mode, preset, list(sites), epochs=rounds * epochs_per_round, overrides=scoring, seed=seed,
                           log=lambda m: None)
    table["curve"] = table["curve"][epochs_per_round - 1 :: epochs_per_round]
    table["curve_x"] = list(range(1, len(table["curve"]) + 1))
    return table


def _standalone(row: Row) -> dict[str, Any]:
    table = standalone_row(method_mode(row.method), row.preset, list(row.sites), row.rounds, row.overrides, row.seed,
                           SCORE_METRICS[row.method.task])
    return {"scores": {k: table[k] for k in ("sites", "client_average", "global")}, "curve": table["curve"],
            "curve_x": table["curve_x"], "traffic": None, "peak_mb": {}, "epsilon": None}


def _federated(row: Row, work: Path, log: Callable[[str], None]) -> dict[str, Any]:
    from medflare.evaluation import evaluate_result

    m = row.method
    workflow = {"num_rounds": row.rounds, **m.workflow}
    if m.flare_clients_arg:
        workflow["num_clients"] = len(row.sites)
    total = row.rounds + int(get_preset(row.preset, row.overrides).get("fedsm", {}).get("extra_rounds", 0))
    start, first = time.perf_counter(), {}

    def on_round(rnd: int) -> None:
        now = time.perf_counter()
        first.setdefault("round", (rnd, now))  # the rate leaves out the simulator's start-up before the first round
        r0, t0 = first["round"]
        eta = f", about {(now - t0) / (rnd - r0) * (total - rnd) / 60:.1f} min left in the job" if rnd > r0 else ""
        what = f"round {rnd + 1} of {total}" if rnd < total else "final tasks after the last round (e.g. validation)"
        log(f"      {row.key}: {what} ({(now - start) / 60:.1f} min in the job{eta if rnd < total else ''})")

    out = run_job(m.job, work, list(row.sites), preset=row.preset, overrides=row.overrides, workflow_args=workflow,
                  seed=row.seed, on_round=on_round)
    run = out["run"]
    result = run.app_server / m.result
    try:
        scored = evaluate_result(result, sites=list(row.sites), metrics=SCORE_METRICS[m.task], log=lambda line: None)
    except MedflareError as e:
        raise MedflareError(f"scoring '{result}' failed: {e}") from e
    evaluation = json.loads(json.dumps(scored["evaluations"][0], default=float))  # the plain numbers a record holds
    scores = {"sites": {s: r["mean"] for s, r in evaluation["sites"].items()},
              "client_average": evaluation["client_average"], "global": evaluation["global"]}
    key = get_preset(row.preset, row.overrides)["eval"]["key_metric"]
    scalars = run.scalars()
    curve = _curve(scalars, m, key, row.sites)
    return {"scores": scores, "curve": curve, "curve_x": list(range(m.curve_start, m.curve_start + len(curve))), "traffic": out["traffic"],
            "peak_mb": out["peak_mb"], "epsilon": _epsilon(result), "workspace": str(run.workspace),
            "compute": compute_of(scalars, row.sites, m.site_steps, m.server_steps, m.server_time)}


def _curve(scalars, method: Method, key: str, sites) -> list[float]:
    """Mean over sites (or the server's value) of the method's curve tag, one value per step in step order
    (``scalars``: the run's TensorBoard, :meth:`medflare.jobs.simulate.SimRun.scalars`)."""
    tag = method.curve.format(key=key)
    series = [dict(v[tag]) for name, v in scalars.items() if tag in v and ((name not in sites) if method.curve_on_server else (name in sites))]
    steps = sorted({s for d in series for s in d})
    return [sum(d[s] for d in series if s in d) / max(1, sum(s in d for d in series)) for s in steps]


def _epsilon(result: Path) -> dict[str, float] | None:
    """Every ``epsilon`` the saved result's metadata holds, by site (FedIOD writes each site's with its student)."""
    from medflare.common.results import read_checkpoint

    found: dict[str, float] = {}

    def walk(node: Any, where: str) -> None:
        if isinstance(node, Mapping):
            for k, v in node.items():
                if k == "epsilon" and isinstance(v, (int, float)):
                    found[where or "?"] = float(v)
                else:
                    walk(v, str(k) if isinstance(v, Mapping) else where)

    walk(read_checkpoint(result).get("meta_props", {}), "")
    return {k: v for k, v in found.items() if not math.isnan(v)} or None
