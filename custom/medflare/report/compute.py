"""Compute on the record (issue 31): how many optimisation steps and seconds a report row spent, from its TensorBoard.

Every job streams its steps per round (:meth:`medflare.common.site_executor.SiteExecutor.log_steps` at the sites,
the FedVCK / FedIOD controllers at the server); :func:`compute_of` sums, for one run, the tags its
:class:`~medflare.report.methods.Method` names: the sites' steps summed over sites, the server's, each averaged
over the rounds that logged them, and seconds (every site's ``time/task_s``, the server's training time where the
method streams it). :func:`budget` turns a record into the optimisation-step budget per round that ``--match-compute`` gives
a baseline, split evenly over its sites by :func:`steps_per_site`.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from medflare.jobs.simulate import SIMULATOR_SERVER as SERVER

#: seconds each site streams for every task it runs (medflare.common.site_executor)
SITE_SECONDS = "time/task_s"


def _per_round(series: Sequence[Sequence[tuple[int, float]]]) -> dict[int, float]:
    """``{round: sum of every value logged at that round}`` over several (step, value) series."""
    out: dict[int, float] = {}
    for s in series:
        for step, value in s:
            out[int(step)] = out.get(int(step), 0.0) + float(value)
    return out


def _mean(per_round: Mapping[int, float]) -> float:
    return sum(per_round.values()) / len(per_round)


def compute_of(scalars: Mapping[str, Mapping[str, Sequence[tuple[int, float]]]], sites: Sequence[str],
               site_tags: Sequence[str] | None, server_tags: Sequence[str] | None,
               server_time: str | None = None) -> dict[str, Any]:
    """Steps and seconds of one run from its TensorBoard scalars (``{folder: {tag: [(round, value)]}}``, as
    :meth:`medflare.jobs.simulate.SimRun.scalars` reads them): ``site_steps_per_round`` (the ``site_tags`` of every
    site summed per round, averaged over rounds), ``server_steps_per_round`` (the ``server_tags`` of the server's
    folder, likewise), their totals, ``site_s`` (every site's ``time/task_s`` over the job) and ``server_s`` (the
    server's ``server_time`` tag over the job, e.g. FedVCK's ``time/update_s``). Tags ``()``: the method optimises
    nothing there (0 steps and 0 s, e.g. a baseline's server); tags None, or tags that logged nothing: not on the
    record (None; e.g. FedIOD's sites train teachers and discriminators but stream no steps)."""
    site = _per_round([scalars.get(s, {}).get(t, []) for s in sites for t in site_tags or ()])
    server = _per_round([scalars.get(SERVER, {}).get(t, []) for t in server_tags or ()])
    site_s = [v for s in sites for _, v in scalars.get(s, {}).get(SITE_SECONDS, [])]
    server_s = [v for _, v in scalars.get(SERVER, {}).get(server_time, [])] if server_time else []

    def steps(per_round: Mapping[int, float], tags: Sequence[str] | None, fn) -> float | None:
        return 0.0 if tags is not None and not tags else (fn(per_round) if per_round else None)

    return {"site_steps_per_round": steps(site, site_tags, _mean), "server_steps_per_round": steps(server, server_tags, _mean),
            "site_steps": steps(site, site_tags, lambda d: sum(d.values())),
            "server_steps": steps(server, server_tags, lambda d: sum(d.values())),
            "rounds_logged": len(set(site) | set(server)),
            "site_tags": None if site_tags is None else list(site_tags),
            "server_tags": None if server_tags is None else list(server_tags),
            "site_s": sum(site_s) if site_s else None,
            "server_s": 0.0 if server_tags is not None and not server_tags else (sum(server_s) if server_s else None)}


def budget(record: Mapping[str, Any]) -> int:
    """A row's optimisation steps per round over the whole federation (every site's plus the server's), the budget
    ``--match-compute`` gives a baseline; a record without steps on it raises ValueError naming the row."""
    c = record.get("compute") or {}
    parts = [c.get("site_steps_per_round"), c.get("server_steps_per_round")]
    if all(p is None for p in parts):
        raise ValueError(f"row '{record.get('method')}' (seed {record.get('seed')}) has no steps on its record; rerun it")
    return int(round(sum(p for p in parts if p is not None)))


def steps_per_site(total: int, num_sites: int) -> int:
    """``total`` steps per round split evenly over ``num_sites`` sites (rounded up, at least 1)."""
    return max(1, math.ceil(total / max(1, num_sites)))
