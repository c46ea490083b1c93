"""Run a job in the FLARE simulator as a subprocess and read back what it wrote (the report, benchmarks, tests).

FLARE's simulator can exit 0 after a client crashed, so callers check artifacts, not just the return
code: :class:`SimRun` exposes the server run folder, the TensorBoard scalars per site and the log.

FLARE's simulator can also wait for ever on a site's process that never started (its port taken by another process
between FLARE's pick and the site's bind): such a run is stopped when FLARE logs it and started again once
(:func:`run_simulator`), and forked runs pick their ports where other processes' connections do not land
(:func:`ports_below_the_ephemeral_range`).
"""

from __future__ import annotations

import contextvars
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from medflare import MedflareError
from medflare.common.compute import env_number


SIMULATOR_SERVER = "simulator_server"  # the name the FLARE simulator gives the server (its tb_events folder)
#: every audited run of this process (e.g. a test session), for the session-wide egress audit (tests/e2e/test_egress_audit.py)
AUDITED: list["SimRun"] = []
#: added to the environment of every run of this process (FLARE's memory advice; a caller may add FLARE settings:
#: ``NVFLARE_<VAR>`` sets a job config variable, e.g. the test suite's shorter end-of-run wait in tests/conftest.py)
RUN_ENV: dict[str, str] = {"MALLOC_ARENA_MAX": "2", "PYTHONUNBUFFERED": "1"}
#: the environment a run starts from in this context (this process's os.environ when None): a thread that starts runs
#: beside code that changes os.environ sets its own (the test suite's background runs beside tests that monkeypatch it)
BASE_ENV: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("medflare_simulator_env", default=None)
#: environment variable (in :data:`RUN_ENV`) capping, in a forked run's simulator and site processes, the seconds FLARE
#: sleeps after a process's work is done "to let pending activities finish" before its clean-up (``mpm.run``'s
#: ``shutdown_grace_time``: 3 s in the simulator and in each site), and skipping the 2 s a site's process sleeps after
#: that: about 5 s of every run's end, a third of a tiny test run. Unset: FLARE's own.
SHUTDOWN_GRACE_ENV = "MEDFLARE_SIMULATOR_SHUTDOWN_GRACE"
#: the fork server of :func:`start_fork_server`, None while every run is a fresh `nvflare simulator` process
_FORK_SERVER: multiprocessing.context.ForkServerContext | None = None
#: what a fork server imports once besides the jobs' server components: FLARE's simulator, torch (with the part that
#: its optimisers import on first use) and MONAI
FORK_SERVER_PRELOAD = ["nvflare.cli", "nvflare.private.fed.app.simulator.simulator_runner", "torch", "torch._dynamo", "monai",
                       # what a site's process (FLARE's simulator_worker) imports
                       "nvflare.private.fed.app.deployer.base_client_deployer", "nvflare.private.fed.client.client_engine",
                       "nvflare.private.fed.client.fed_client", "nvflare.private.fed.simulator.simulator_app_runner",
                       "nvflare.private.fed.simulator.simulator_audit", "nvflare.private.fed.utils.fed_utils"]


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
    env: dict[str, str | None] | None = None,
    local_files: dict[str, object] | None = None,
    audit: bool = True,
) -> SimRun:
    """``nvflare simulator job -w workspace -n N -t N [-c names]`` with FLARE's memory advice; raises on timeout.

    Each site process takes its share of the cores itself (:mod:`medflare.common.compute`); ``env`` (e.g.
    ``{"OMP_NUM_THREADS": "1"}``) is added to the environment of the run (:data:`BASE_ENV`, by default this process's;
    a None value removes that variable).
    ``local_files`` (``{name: dict or text}``) are written to ``workspace/local/``, which the simulator copies into
    every site's and the server's ``local/`` (e.g. ``{"medflare_site.json": {...}}``, ``{"privacy.json": {...}}``).
    ``audit`` (default True) runs a copy of the job with the egress recorder at every site (beside the workspace, as
    ``<workspace>_job``), so :meth:`SimRun.egress_violations` can judge everything the sites sent.
    A run whose site process FLARE's simulator could not reach (:data:`SITE_NOT_REACHED_LOG`; it would wait for ever)
    is stopped at once and started again in a fresh workspace, once; a second such start raises.
    """
    if audit:
        job = with_egress_recorder(job, Path(str(workspace).rstrip("/") + "_job"))
    cmd = [
        sys.executable, "-m", "nvflare.cli", "simulator", str(job),
        "-w", str(workspace), "-n", str(n_clients), "-t", str(threads or n_clients),
    ]
    if clients:
        cmd += ["-c", ",".join(clients)]
    full_env = {k: v for k, v in {**(BASE_ENV.get() or os.environ), **RUN_ENV, **(env or {})}.items() if v is not None}
    start = time.perf_counter()
    if _FORK_SERVER is not None:
        launch = partial(_run_forked, cmd[3:], full_env, timeout)
    else:
        launch = partial(_run_process, cmd, full_env, timeout)
    outcome, returncode, stdout, log = _with_restart(launch, workspace, local_files)
    if outcome == TIMED_OUT:
        raise MedflareError(f"simulator run of '{job}' exceeded {timeout:.0f} s:\n{stdout[-4000:]}")
    if outcome == SITE_NOT_REACHED:
        raise MedflareError(f"simulator run of '{job}': FLARE's simulator could not reach a site's process in "
                            f"{SITE_START_ATTEMPTS} starts (its log: '{SITE_NOT_REACHED_LOG}'):\n{log[-4000:]}")
    run = SimRun(returncode, time.perf_counter() - start, Path(workspace), log, Path(job))
    if audit:
        AUDITED.append(run)
    return run


def start_fork_server(jobs: str | os.PathLike) -> None:
    """Run every later :func:`run_simulator` of this process in a fork of one process that imported FLARE's simulator,
    torch, MONAI and the server components of every job folder under ``jobs`` once (for a process that runs many jobs:
    the test suite).

    A run is the same `nvflare simulator` command (:func:`nvflare.cli.main`: same arguments, environment, working
    folder, output and return code); only its process is a fork instead of a fresh interpreter, so the simulator and
    its FL server (FLARE forks the server from it) skip those imports: about 7 s of CPU a run. Each site's process
    (FLARE's ``simulator_worker``, one per site) starts from the same fork server with the arguments and environment
    FLARE gives it, instead of a fresh interpreter importing them again: about 5-10 s of CPU per site and run
    (tests/e2e/test_hostile_sites.py, 4 runs of 3 sites, idle 2-core machine: 141 s without the fork server, 107 s
    with it for the simulator only, 51 s with the sites' processes too). The fork server starts here and imports in
    the background.
    """
    global _FORK_SERVER
    if _FORK_SERVER is not None:
        return
    from medflare.jobs.customize import components

    modules = {str(c["path"]).rsplit(".", 1)[0] for p in sorted(Path(jobs).glob("*/app*/config/config_fed_*.json"))
               for c in components(json.loads(p.read_text()), filters=True)}
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([*FORK_SERVER_PRELOAD, *sorted(modules), __name__])
    old = {k: os.environ.get(k) for k in RUN_ENV}
    os.environ.update(RUN_ENV)  # read at a process's start (the allocator's arenas): the fork server's are its forks'
    try:
        from multiprocessing import forkserver

        forkserver.ensure_running()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    _FORK_SERVER = context


#: how :func:`_watch` ends a run: it exited, it ran past its time, or FLARE's simulator lost a site's process at its start
EXITED, TIMED_OUT, SITE_NOT_REACHED = "exited", "timed out", "site not reached"
#: what FLARE's simulator logs when a site's process did not open the port it was given within 60 s. FLARE picks a free
#: port, closes it and passes its number to the site's new process, which binds it seconds later: another process can
#: take it meanwhile ("Address already in use" in the site's log). The simulator then waits for that site for ever.
SITE_NOT_REACHED_LOG = "Failed to create connection to the child process"
#: starts of a run whose site process was not reached (each in a fresh workspace) before :func:`run_simulator` gives up
SITE_START_ATTEMPTS = 2


def _with_restart(launch, workspace: str | os.PathLike,
                  local_files: dict[str, object] | None) -> tuple[str, int | None, str, str]:
    """``launch()`` (:func:`_run_process` or :func:`_run_forked`) with ``local_files`` written to ``workspace/local/``;
    a run whose site process was not reached starts again in a fresh workspace, up to :data:`SITE_START_ATTEMPTS`
    times. Returns the last start's result."""
    for attempt in range(SITE_START_ATTEMPTS):
        if attempt:
            shutil.rmtree(workspace, ignore_errors=True)  # nothing of the stopped run is read back
        if local_files:
            local = Path(workspace) / "local"
            local.mkdir(parents=True, exist_ok=True)
            for name, content in local_files.items():
                (local / name).write_text(content if isinstance(content, str) else json.dumps(content, indent=2))
        result = launch()
        if result[0] != SITE_NOT_REACHED:
            break
    return result


def _watch(wait, outputs: tuple[Path, ...], timeout: float, poll: float = 2.0) -> str:
    """Wait for a run for at most ``timeout`` s (``wait(seconds)``: True once it has exited), reading the new lines of
    its output files: :data:`EXITED`, :data:`TIMED_OUT`, or :data:`SITE_NOT_REACHED` as soon as the simulator logs
    :data:`SITE_NOT_REACHED_LOG` (instead of waiting out the timeout on a run that cannot end)."""
    deadline = time.monotonic() + timeout
    marker = SITE_NOT_REACHED_LOG.encode()
    read = {path: (0, b"") for path in outputs}  # per file: bytes read so far, the last bytes of them
    while not wait(min(poll, max(0.0, deadline - time.monotonic()))):
        for path, (offset, tail) in read.items():
            if not path.is_file():
                continue
            with path.open("rb") as f:
                f.seek(offset)
                new = f.read()
            if marker in tail + new:
                return SITE_NOT_REACHED
            read[path] = (offset + len(new), (tail + new)[-len(marker):])
        if time.monotonic() >= deadline:
            return TIMED_OUT
    return EXITED


def _supervise(start, timeout: float) -> tuple[str, int | None, str, str]:
    """A run started by ``start(stdout_path, stderr_path)`` -> (its pid, ``wait(seconds)``: True once it exited, its
    exit code), watched by :func:`_watch` and killed with what it started unless it exited: (the outcome, the exit
    code or None when it was stopped, stdout, stdout + stderr)."""
    with tempfile.TemporaryDirectory(prefix="medflare-simulator-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        pid, wait, exitcode = start(out, err)
        outcome = _watch(wait, (out, err), timeout)
        if outcome != EXITED:
            _kill_tree(pid)
            wait(None)
        stdout, stderr = (path.read_text(errors="replace") if path.is_file() else "" for path in (out, err))
    return outcome, exitcode() if outcome == EXITED else None, stdout, stdout + stderr


def _run_process(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[str, int | None, str, str]:
    """``cmd`` (``nvflare simulator ...``) as a fresh process, watched by :func:`_supervise`."""

    def start(out: Path, err: Path):
        with out.open("wb") as o, err.open("wb") as e:
            proc = subprocess.Popen(cmd, env=env, stdout=o, stderr=e)
        return proc.pid, partial(_exited, proc), lambda: proc.returncode

    return _supervise(start, timeout)


def _exited(proc: subprocess.Popen, seconds: float | None) -> bool:
    """``proc`` has exited, waiting at most ``seconds`` for it (None: until it does)."""
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        return False
    return True


def _kill_tree(pid: int) -> None:
    """Kill a stopped run's process and what it started (FLARE's simulator runs the server in a child process beside a
    multiprocessing manager; killing the top process alone left them waiting)."""
    import psutil

    try:
        top = psutil.Process(pid)
        processes = [*top.children(recursive=True), top]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def _run_forked(argv: list[str], env: dict[str, str], timeout: float) -> tuple[str, int | None, str, str]:
    """``nvflare <argv>`` in a fork of the fork server, watched by :func:`_supervise`."""
    from multiprocessing import forkserver

    address = forkserver._forkserver._forkserver_address  # noqa: SLF001 - its sites start from the same fork server

    def start(out: Path, err: Path):
        proc = _FORK_SERVER.Process(target=_simulate, args=(argv, env, os.getcwd(), str(out), str(err), address))
        proc.start()
        return proc.pid, lambda seconds: proc.join(seconds) or proc.exitcode is not None, lambda: proc.exitcode

    return _supervise(start, timeout)


def _simulate(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str, address: str) -> None:
    """In a fork of the fork server: ``nvflare <argv>`` as if started with ``env`` in ``cwd``, its output (and its
    sites', :func:`_site_worker`) appended to the files ``out`` and ``err``; its exit status is the fork's. ``address``:
    the fork server's, from which the sites' processes start."""
    _redirect(out, err)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = ["nvflare", *argv]
    # as in a fresh `nvflare simulator` process on Linux: FLARE's server process is a fork of this one (with its imports
    # and environment), not of a new fork server (a fork server's children inherit its start method)
    multiprocessing.set_start_method("fork", force=True)
    _reach_fork_server(address)
    ports_below_the_ephemeral_range()
    subprocess.Popen = _site_process_factory(subprocess.Popen, out, err)
    _cap_shutdown_grace()
    from nvflare.cli import main

    main()


def ports_below_the_ephemeral_range() -> None:
    """In this forked simulator run (:func:`_simulate`; ``medflare run``'s SimEnv and a plain run start FLARE's own in a
    new process): its server's and its sites' ports are free ones picked at random below the kernel's
    ephemeral port range (:func:`free_ports`) instead of FLARE's ``get_open_ports``. FLARE's picks a port from that range
    (bind port 0, close) and a site's new process binds it seconds later; any outgoing connection of any process (the
    other runs of a test session, its POC federation) may take it meanwhile, and the site's process then fails with
    "Address already in use" (:data:`SITE_NOT_REACHED_LOG`). Below the range only explicit binds land."""
    from nvflare.fuel.utils import network_utils
    from nvflare.private.fed.app.deployer import simulator_deployer
    from nvflare.private.fed.app.simulator import simulator_runner

    low, high = _below_ephemeral_range()
    if high - low < 1000:  # a kernel whose ephemeral range starts low: FLARE's own
        return
    for module in (network_utils, simulator_runner, simulator_deployer):
        module.get_open_ports = lambda number: free_ports(number, low, high)


def _below_ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The ports [low, high) below the kernel's ephemeral range, from its lower half up (Linux's default range starts at
    32768: 16384-32767); an empty range where the kernel does not say."""
    try:
        start = int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0, 0
    return max(1024, start // 2), start


def free_ports(number: int, low: int, high: int, attempts: int = 200) -> list[int]:
    """``number`` distinct ports in [low, high) that this host let us bind and listen on just now, picked at random
    (from the OS's entropy: forks of one process pick differently); FLARE's ``get_open_ports`` contract otherwise."""
    import random
    import socket

    rng, sockets = random.SystemRandom(), []
    try:
        for _ in range(attempts):
            if len(sockets) == number:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("", rng.randrange(low, high)))
                s.listen(1)
            except OSError:
                s.close()
                continue
            sockets.append(s)  # held until all are found, so none is picked twice
        if len(sockets) < number:
            raise RuntimeError(f"found {len(sockets)} of {number} free ports in {low}-{high - 1} in {attempts} tries")
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _shutdown_grace() -> float | None:
    """``$MEDFLARE_SIMULATOR_SHUTDOWN_GRACE`` in seconds, None when unset; anything but a number >= 0 names the variable."""
    return env_number(SHUTDOWN_GRACE_ENV, float, 0)


def _cap_shutdown_grace() -> None:
    """In this forked process: FLARE's ``mpm.run`` waits at most ``$MEDFLARE_SIMULATOR_SHUTDOWN_GRACE`` s before its
    clean-up (see :data:`SHUTDOWN_GRACE_ENV`); nothing when it is unset."""
    grace = _shutdown_grace()
    if grace is None:
        return
    from nvflare.fuel.f3.mpm import MainProcessMonitor

    run = MainProcessMonitor.run.__func__

    def capped(cls, main_func, run_dir=None, shutdown_grace_time=3, cleanup_grace_time=3, **kwargs):
        return run(cls, main_func, run_dir, min(shutdown_grace_time, grace), cleanup_grace_time, **kwargs)

    MainProcessMonitor.run = classmethod(capped)


def _reach_fork_server(address: str) -> None:
    """Let this fork of the fork server ask it for further processes (the sites'): a fork knows the server's liveness
    pipe but not its address, and would otherwise start a new, empty fork server."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # noqa: SLF001
    server._forkserver_address = address
    server.ensure_running = lambda: None  # it runs: the run's process started it


def _redirect(out: str, err: str) -> None:
    """This process's stdout and stderr appended to the files ``out`` and ``err`` (shared with the run's other processes)."""
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)


#: the module FLARE's simulator starts each site's process with (``python -m <module> ...``)
SITE_WORKER = "nvflare.private.fed.app.simulator.simulator_worker"


def _site_process_factory(popen, out: str, err: str):
    """``subprocess.Popen`` for a forked simulator: a site's process (``python -m`` :data:`SITE_WORKER`) is started from
    the fork server, which has imported FLARE, torch, MONAI and the jobs' components once, with the command's arguments
    and environment and its output in the run's files ``out`` and ``err``; any other command is ``popen``'s."""

    def start(args, *rest, **kwargs):
        if isinstance(args, (list, tuple)) and SITE_WORKER in args:
            argv = list(args)[list(args).index(SITE_WORKER) + 1:]
            return _ForkedSite(argv, dict(kwargs.get("env") or os.environ), out, err)
        return popen(args, *rest, **kwargs)

    return start


class _ForkedSite:
    """The part of ``subprocess.Popen`` FLARE's simulator uses, for a site process started by the fork server."""

    def __init__(self, argv: list[str], env: dict[str, str], out: str, err: str):
        self._proc = multiprocessing.get_context("forkserver").Process(target=_site_worker, args=(argv, env, out, err),
                                                                        name="medflare-site-worker")
        self._proc.start()
        self.pid = self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(SITE_WORKER, timeout)
        return self._proc.exitcode

    def terminate(self) -> None:
        if self._proc.exitcode is None:
            self._proc.terminate()

    def kill(self) -> None:
        if self._proc.exitcode is None:
            self._proc.kill()


def _site_worker(argv: list[str], env: dict[str, str], out: str, err: str) -> None:
    """In a fork of the fork server: ``python -m`` :data:`SITE_WORKER` ``argv`` as FLARE's simulator starts it (its own
    session, the command's environment, PYTHONPATH on ``sys.path``), output appended to the run's files."""
    import runpy

    _redirect(out, err)
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    multiprocessing.set_start_method("fork", force=True)  # a fresh interpreter's default on Linux
    sys.argv = [SITE_WORKER, *argv]
    if _shutdown_grace() is None:
        runpy.run_module(SITE_WORKER, run_name="__main__", alter_sys=True)
        return
    # the module's ``__main__`` block without its closing 2 s sleep, FLARE's wait capped (:data:`SHUTDOWN_GRACE_ENV`)
    import importlib

    from nvflare.fuel.f3.mpm import MainProcessMonitor

    _cap_shutdown_grace()
    worker = importlib.import_module(SITE_WORKER)
    args = worker.parse_arguments()
    MainProcessMonitor.run(main_func=worker.main, run_dir=args.workspace, args=args)


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

