"""Run a job in the FLARE simulator as a subprocess and read back what it wrote (the report, benchmarks, tests).

FLARE's simulator can exit 0 after a client crashed, so callers check artifacts, not just the return
code: :class:`SimRun` exposes the server run folder, the TensorBoard scalars per site and the log.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from medflare import MedflareError


SIMULATOR_SERVER = "simulator_server"  # the name the FLARE simulator gives the server (its tb_events folder)
#: every audited run of this process (e.g. a test session), for the session-wide egress audit (tests/e2e/test_egress_audit.py)
AUDITED: list["SimRun"] = []


@dataclass
class SimRun:
    """Result of one simulator run: return code, wall seconds, workspace, and the server's run folder."""

    returncode: int
    seconds: float
    workspace: Path
    log: str
    job: Path | None = None  # the job folder that ran (the audited copy when run_simulator added the egress recorder)

    @property
    def server_dir(self) -> Path:
        return server_dir(self.workspace)

    @property
    def app_server(self) -> Path:
        return self.server_dir / "app_server"

    def scalars(self) -> dict[str, dict[str, list[tuple[int, float]]]]:
        """``{site: {tag: [(step, value), ...]}}`` from the server's TensorBoard folder (the server's own scalars, e.g.
        the update guard's, under ``SIMULATOR_SERVER``)."""
        return read_scalars(self.server_dir / "tb_events")

    @property
    def job_name(self) -> str:
        """The job's name (its meta.json), e.g. "fedavg"."""
        return json.loads((self.job / "meta.json").read_text())["name"] if self.job else ""

    def images(self) -> dict[str, int]:
        """Image summaries in the server's TensorBoard by folder (``{site or server name: count}``)."""
        return image_counts(self.server_dir / "tb_events")

    def site_images(self) -> dict[str, int]:
        """Image summaries each site kept in its own TensorBoard (``<ws>/<site>/simulate_job/tb_events/<site>``)."""
        return {site.name: image_counts(site / "simulate_job" / "tb_events").get(site.name, 0)
                for site in sorted(self.workspace.iterdir()) if site.is_dir() and (site / "simulate_job").is_dir()
                and site.name != "server"}

    def egress(self) -> list[dict]:
        """What the sites sent, message by message (:mod:`medflare.jobs.egress`; empty when the run was not audited)."""
        from medflare.jobs.egress import read_records

        return read_records(self.workspace)

    def egress_violations(self) -> list[str]:
        """The egress rule's violations in this run, judged against the job's manifest."""
        from medflare.jobs.egress import violations

        return violations(self.egress(), job_manifest(self.job) if self.job else None)

    def site_scalars(self) -> dict[str, dict[str, list[tuple[int, float]]]]:
        """:meth:`scalars` without the server's own folder: only what the sites streamed."""
        return {k: v for k, v in self.scalars().items() if k != SIMULATOR_SERVER}


def server_dir(workspace: str | os.PathLike) -> Path:
    """The server's run folder in a simulator workspace (``app_server`` under it holds the server's app files)."""
    return Path(workspace) / "server" / "simulate_job"


def job_manifest(job: str | os.PathLike) -> dict | None:
    """The manifest of what a job's sites send (its client config's ManifestFilter), or None when it declares none."""
    from medflare.common.egress import job_manifest_filter

    args = job_manifest_filter(job)
    return args["manifest"] if args else None


def with_egress_recorder(job: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """A copy of ``job`` at ``dst`` whose client apps also run :class:`~medflare.jobs.egress.EgressRecorder`."""
    job, dst = Path(job), Path(dst)
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(job, dst)
    for path in dst.glob("*/config/config_fed_client.json"):
        config = json.loads(path.read_text())
        config.setdefault("components", []).append({"id": "egress_recorder", "path": "medflare.jobs.egress.EgressRecorder",
                                                     "args": {}})
        path.write_text(json.dumps(config, indent=2))
    return dst


def run_simulator(
    job: str | os.PathLike,
    workspace: str | os.PathLike,
    n_clients: int,
    *,
    threads: int | None = None,
    clients: list[str] | None = None,
    timeout: float = 900,
    env: dict[str, str] | None = None,
    local_files: dict[str, object] | None = None,
    audit: bool = True,
) -> SimRun:
    """``nvflare simulator job -w workspace -n N -t N [-c names]`` with FLARE's memory advice; raises on timeout.

    Each site process takes its share of the cores itself (:mod:`medflare.common.compute`); ``env`` (e.g.
    ``{"OMP_NUM_THREADS": "1"}``) is added to the environment of the run.
    ``local_files`` (``{name: dict or text}``) are written to ``workspace/local/``, which the simulator copies into
    every site's and the server's ``local/`` (e.g. ``{"medflare_site.json": {...}}``, ``{"privacy.json": {...}}``).
    ``audit`` (default True) runs a copy of the job with the egress recorder at every site (beside the workspace, as
    ``<workspace>_job``), so :meth:`SimRun.egress_violations` can judge everything the sites sent.
    """
    if audit:
        job = with_egress_recorder(job, Path(str(workspace).rstrip("/") + "_job"))
    if local_files:
        local = Path(workspace) / "local"
        local.mkdir(parents=True, exist_ok=True)
        for name, content in local_files.items():
            (local / name).write_text(content if isinstance(content, str) else json.dumps(content, indent=2))
    cmd = [
        sys.executable, "-m", "nvflare.cli", "simulator", str(job),
        "-w", str(workspace), "-n", str(n_clients), "-t", str(threads or n_clients),
    ]
    if clients:
        cmd += ["-c", ",".join(clients)]
    full_env = {**os.environ, "MALLOC_ARENA_MAX": "2", "PYTHONUNBUFFERED": "1", **(env or {})}
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise MedflareError(f"simulator run of '{job}' exceeded {timeout:.0f} s:\n{(e.stdout or '')[-4000:]}") from e
    log = proc.stdout + proc.stderr
    run = SimRun(proc.returncode, time.perf_counter() - start, Path(workspace), log, Path(job))
    if audit:
        AUDITED.append(run)
    return run


def read_scalars(tb_root: str | os.PathLike) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """All scalar series under ``tb_root/<site>/`` as ``{site: {tag: [(step, value)]}}`` sorted by step; scores back
    as fractions (TensorBoard shows them in percent: :func:`medflare.common.report.is_percent_tag`)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from medflare.common.report import is_percent_tag

    out: dict[str, dict[str, list[tuple[int, float]]]] = {}
    root = Path(tb_root)
    if not root.is_dir():
        return out
    for site_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        acc = EventAccumulator(str(site_dir), size_guidance={"scalars": 0, "images": 0})
        acc.Reload()
        out[site_dir.name] = {
            tag: sorted((e.step, e.value / 100.0 if is_percent_tag(tag) else e.value) for e in acc.Scalars(tag))
            for tag in acc.Tags().get("scalars", [])
        }
    return out


def image_counts(tb_root: str | os.PathLike) -> dict[str, int]:
    """Number of image summaries under each ``tb_root/<folder>/`` (segmentation overlays, samples, condensed sets)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {}
    root = Path(tb_root)
    for site_dir in (sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []):
        acc = EventAccumulator(str(site_dir), size_guidance={"images": 0})
        acc.Reload()
        out[site_dir.name] = sum(len(acc.Images(t)) for t in acc.Tags().get("images", []))
    return out

