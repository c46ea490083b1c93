"""How many CPU threads and data-loader workers a medflare process uses: its share of the machine, no more.

FLARE runs every site, and the server, as a process of its own, and PyTorch starts one compute thread
per core in each. Four simulated sites on a 16-core machine then run 64 threads on 16 cores and spend
their time waiting for each other (issue 11: rounds 15-20x slower than with the threads capped; on a
2-core machine, 184 s instead of 48 s for the default FedSM job). So every medflare process sets its
thread count once at start-up, from this rule:

    share   = max(1, cores // processes)
    workers = the site's "compute.workers", else the preset's ``train.num_workers`` (default 0)
    threads = the site's "compute.threads", else $OMP_NUM_THREADS when the user set it,
              else max(1, share - workers)

where
    cores     = the CPUs this process may run on: its CPU affinity, and a container's CPU quota
                (cgroup v2 ``cpu.max``) when that is smaller, and $MEDFLARE_CORES when that is smaller
                (the cores one run may use when several share the machine: two simulator runs side by
                side on 2 cores set it to 1 each, so that their servers do not both take 2 threads);
    processes = the medflare processes on this machine that compute at the same time:
                the site's "compute.processes" when set; else $MEDFLARE_PROCESSES when set (e.g. a POC
                federation, all sites on one machine); else, in the FLARE simulator, the sites it runs at
                once: ``-t`` (times the GPU groups of ``-gpu``), at most the number of sites; else 1
                (POC and production: one site per machine). The server counts 1: in every medflare
                workflow it computes (FedSM calibration, FedVCK/FedIOD server training) while the sites
                wait for its next task.

Site settings come from the site's own ``local/medflare_site.json`` (:mod:`medflare.common.site_config`)::

    {"compute": {"threads": 4, "workers": 2, "processes": 2, "device": "cuda:1"}}

so a hospital can always say what its machine is; a job cannot. Data-loader workers are processes
of their own that PyTorch runs with one thread each, so they come out of the same share. Every dataset
the bundle builds today is held in memory (MONAI CacheDataset, the .npz arrays), where workers only add
start-up and copying: the default is 0. The simulator passes its arguments (``-n``, ``-t``, ``-gpu``) to
each site process as FLARE's ``FLContextKey.ARGS``; that is how a simulated site knows how many others
share its machine. The choice is logged at start-up with the reason for it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from medflare import ConfigError
from medflare.common.site_config import setting

__all__ = ["CORES_ENV", "PROCESSES_ENV", "ComputeShare", "apply_threads", "available_cores", "compute_share", "env_number", "process_share",
           "simulator_counts", "simulator_processes"]

#: environment variable saying how many medflare processes compute at once on this machine
PROCESSES_ENV = "MEDFLARE_PROCESSES"
#: environment variable capping the cores a medflare process counts as its machine's (several runs sharing it)
CORES_ENV = "MEDFLARE_CORES"
_CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


@dataclass(frozen=True)
class ComputeShare:
    """What one process uses: ``threads`` torch threads and ``workers`` data-loader worker processes, and why."""

    cores: int
    processes: int
    threads: int
    workers: int
    reason: str

    def describe(self, applied: int | None = None) -> str:
        """One log line: the choice (``applied``: the thread count torch reports after :func:`apply_threads`) and why."""
        return f"{self.threads if applied is None else applied} torch threads, {self.workers} data-loader workers ({self.reason})"


def available_cores(cgroup_cpu_max: str | os.PathLike = _CGROUP_CPU_MAX) -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota (containers) when one is set."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = Path(cgroup_cpu_max).read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def _positive_int(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def simulator_counts(args: Any) -> tuple[int, int | None] | None:
    """(site processes the FLARE simulator runs at once, sites in total or None when the command line does not
    say) from its arguments (FLContextKey.ARGS); None outside the simulator.

    ``-t`` clients run in parallel per GPU group; with several ``-gpu`` groups FLARE runs one client per group
    at a time (it sets ``threads`` to 1), so the product counts both cases.
    """
    threads = getattr(args, "threads", None)
    if not _positive_int(threads, 1):
        return None
    gpu = getattr(args, "gpu", None)
    groups = 1
    if gpu:
        from nvflare.private.fed.utils.fed_utils import split_gpus

        try:
            groups = max(1, len(split_gpus(str(gpu))))
        except ValueError:
            groups = 1
    clients = getattr(args, "clients", None)
    n_sites = getattr(args, "n_clients", None) or (len([c for c in str(clients).split(",") if c.strip()]) if clients else None)
    return threads * groups, (n_sites if _positive_int(n_sites, 1) else None)


def simulator_processes(args: Any) -> int | None:
    """Site processes the FLARE simulator runs at once (at most the number of sites); None outside it."""
    counts = simulator_counts(args)
    if counts is None:
        return None
    running, n_sites = counts
    return min(running, n_sites) if n_sites else running


def process_share(
    cores: int,
    processes: int,
    *,
    threads: int | None = None,
    workers: int = 0,
    env_threads: int | None = None,
    reason: str = "",
) -> ComputeShare:
    """The rule of the module docstring for one process: explicit ``threads`` win, then ``env_threads``, then the share.

    Args:
        cores: CPUs of the machine this process may use (>= 1).
        processes: processes computing at the same time on those CPUs (>= 1).
        threads: the site's explicit setting, or None.
        workers: data-loader workers (>= 0); they come out of the share.
        env_threads: $OMP_NUM_THREADS as the user set it, or None.
        reason: where ``processes`` came from, for the log line.
    """
    cores, processes = max(1, int(cores)), max(1, int(processes))
    share = max(1, cores // processes)
    base = f"{cores} cores / {processes} process{'es' if processes > 1 else ''}" + (f" ({reason})" if reason else "")
    if threads is not None:
        return ComputeShare(cores, processes, threads, workers, f"site setting compute.threads; {base}")
    if env_threads is not None:
        return ComputeShare(cores, processes, env_threads, workers, f"OMP_NUM_THREADS={env_threads} set by the user; {base}")
    return ComputeShare(cores, processes, max(1, share - workers), workers,
                        f"share {share} = {base}" + (f", minus {workers} loader workers" if workers else ""))


def env_number(name: str, kind: type[int] | type[float] = int, minimum: float = 1) -> int | float | None:
    """``$name`` as a ``kind`` >= ``minimum``, None when unset or blank; anything else (NaN too) is a ConfigError naming
    the variable, never a bare ValueError from deep in a run."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = kind(raw)
        if value >= minimum:
            return value
    except ValueError:
        pass
    raise ConfigError(f"environment variable {name}={raw!r} must be {'an int' if kind is int else 'a number'} >= {minimum}")


def compute_share(
    site_config: Mapping[str, Mapping[str, Any]],
    *,
    site: str,
    fl_args: Any = None,
    role: str = "site",
    default_workers: int = 0,
    cores: int | None = None,
) -> ComputeShare:
    """This process's share from the site's ``compute`` settings, the environment and FLARE's run arguments.

    ``role`` is "site" or "server" (the server counts one process, see the module docstring);
    ``default_workers`` is the preset's ``train.num_workers``. A bad setting raises ConfigError naming it.
    """
    threads = setting(site_config, "compute", "threads", None, lambda v: v is None or _positive_int(v, 1), site)
    workers = setting(site_config, "compute", "workers", default_workers, lambda v: _positive_int(v, 0), site)
    processes = setting(site_config, "compute", "processes", None, lambda v: v is None or _positive_int(v, 1), site)
    cores = cores or available_cores()
    capped = ""
    if (cap := env_number(CORES_ENV)) is not None and cap < cores:
        cores, capped = cap, f"; cores capped by ${CORES_ENV}={cap}"
    if processes is not None:
        reason = "site setting compute.processes"
    elif (env := env_number(PROCESSES_ENV)) is not None:
        processes, reason = env, f"${PROCESSES_ENV}"
    elif role == "site" and (sim := simulator_processes(fl_args)) is not None:
        processes, reason = sim, f"FLARE simulator running {sim} site{'s' if sim > 1 else ''} at once"
    else:
        processes, reason = 1, ("server: computes while the sites wait" if role == "server" else "one site per machine")
    return process_share(cores, processes, threads=threads, workers=workers, env_threads=env_number("OMP_NUM_THREADS"),
                         reason=reason + capped)


def apply_threads(share: ComputeShare) -> int:
    """Set torch's intra-op threads (and its inter-op threads, when this process has not used them yet).

    Returns the intra-op thread count torch now uses (what the start-up log line reports).
    """
    import torch

    torch.set_num_threads(share.threads)
    try:
        torch.set_num_interop_threads(share.threads)
    except RuntimeError:  # only settable before the first inter-op parallel work; the intra-op count is what matters
        pass
    return torch.get_num_threads()
