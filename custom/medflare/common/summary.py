"""What a person reads of a running job: one line per round and one at the end, the same in every job.

Every server workflow (FLARE's FedAvg / Scaffold in the baselines, :class:`medflare.common.workflow.SiteRounds` in the
others) reports each round through :class:`RoundSummary`: the mean over sites (each site once) of the job's key metric,
in percent, and the round's wall time, as one line on the logger :data:`ROUNDS_LOGGER`, and the same mean as the
federation-level curve ``federation/mean_<key>`` (in percent, as every score in TensorBoard) in the server's
TensorBoard. :class:`RunSummary`, a server component of every job (:class:`medflare.common.recipe.JobRecipe`), logs at
the end of the run the result file's path and the ``medflare evaluate`` command that scores it (:data:`RESULT_LOGGER`).

``medflare run`` shows these lines (and warnings) and nothing else of FLARE's console (:mod:`medflare.jobs.logs`).
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from typing import Any, Mapping, Sequence

from nvflare.apis.event_type import EventType
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_context import FLContext

from medflare.common.report import format_metric

#: the logger of the per-round lines (``medflare run`` shows it on the console)
ROUNDS_LOGGER = "medflare.summary.rounds"
#: the logger of the end-of-run line naming the result file
RESULT_LOGGER = "medflare.summary.result"
#: the server's TensorBoard tag of the federation-level curve (``key``: the job's key metric)
CURVE_TAG = "federation/mean_{key}"
#: a per-round line, e.g. ``round 3/10: mean dice over 4 sites 71.23 % (global_dice 65.10 %), 4.2 s``
ROUND_LINE = re.compile(r"round (?P<round>\d+)/(?P<total>\d+): mean (?P<key>\S+) over (?P<sites>\d+) sites? "
                        r"(?P<value>\S+(?: %)?)(?: \((?P<also>[^)]*)\))?, (?P<seconds>[\d.]+) s$")


def site_mean(per_site: Mapping[str, Mapping[str, Any]], key: str) -> tuple[float, int]:
    """The mean of ``key`` over the sites that reported a finite value (each site once), and how many did."""
    values = [float(m[key]) for m in per_site.values() if isinstance(m.get(key), (int, float)) and math.isfinite(m[key])]
    return (sum(values) / len(values) if values else math.nan), len(values)


def round_line(rnd: int, total: int, key: str, mean: float, sites: int, seconds: float,
               also: Mapping[str, float] | None = None) -> str:
    """The per-round line: round ``rnd + 1`` of ``total`` (FLARE counts rounds from 0), the mean over ``sites`` sites of
    ``key`` (percent for scores, :func:`medflare.common.report.format_metric`), other means in brackets, the seconds."""
    extra = ", ".join(f"{name} {format_metric(name, value)}" for name, value in (also or {}).items())
    return (f"round {rnd + 1}/{total}: mean {key} over {sites} site{'s' if sites != 1 else ''} {format_metric(key, mean)}"
            + (f" ({extra})" if extra else "") + f", {seconds:.1f} s")


def evaluate_command(path: str | os.PathLike, sites: Sequence[str]) -> str:
    """``medflare evaluate`` of a result file on the sites that trained it (``-n N`` for site-1..site-N)."""
    names = list(sites)
    if names and names == [f"site-{i}" for i in range(1, len(names) + 1)]:
        return f"medflare evaluate --model {path} -n {len(names)}"
    return f"medflare evaluate --model {path}" + (f" --sites {','.join(names)}" if names else "")


def result_line(job: str, path: str | os.PathLike, sites: Sequence[str]) -> str:
    """The end-of-run line: where the job's result is and the command that scores it."""
    return f"{job} finished: result {path}; score it with: {evaluate_command(path, sites)}"


class RoundSummary:
    """A server workflow's per-round line and federation-level curve (see the module docstring).

    ``component``: the workflow (an FLComponent); the curve goes to the server's TensorBoard through its analytics
    events. Call :meth:`start` when a round starts and :meth:`report` once its sites' scores are in.
    """

    def __init__(self, component: FLComponent):
        self.component = component
        self.started = time.perf_counter()
        self._tracker = None

    def start(self) -> None:
        """The round starts now (its seconds count from here)."""
        self.started = time.perf_counter()

    def report(self, fl_ctx: FLContext, rnd: int, total: int, key: str, per_site: Mapping[str, Mapping[str, Any]],
               also: Sequence[str] = ()) -> float:
        """Log the round's line and add the mean of ``key`` over ``per_site`` (``{site: {metric: value}}``) to the
        federation curve at step ``rnd``; ``also``: further metrics whose means the line shows. Returns the mean."""
        from medflare.common.tracking import SERVER_EVENT_TYPE, SiteTracker

        mean, sites = site_mean(per_site, key)
        means = {name: site_mean(per_site, name)[0] for name in also}
        line = round_line(rnd, total, key, mean, sites, time.perf_counter() - self.started,
                          {k: v for k, v in means.items() if math.isfinite(v)})
        logging.getLogger(ROUNDS_LOGGER).info(line)
        if self._tracker is None:
            self._tracker = SiteTracker(self.component, event_type=SERVER_EVENT_TYPE)
        self._tracker.scalars(fl_ctx, {CURVE_TAG.format(key=key): mean}, rnd)  # a NaN mean is left out
        return mean


class RunSummary(FLComponent):
    """Server component of every job: at the end of the run, one line naming the result file and the command that
    scores it (a warning when the job saved none).

    Args:
        job: the job's name (its folder under jobs/). Required.
        result_file: the file the job saves in the server's app folder (e.g. "FL_global_model.pt"). Required.
    """

    def __init__(self, job: str, result_file: str):
        super().__init__()
        self.job = job
        self.result_file = result_file

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type != EventType.END_RUN:
            return
        engine = fl_ctx.get_engine()
        path = os.path.join(engine.get_workspace().get_app_dir(fl_ctx.get_job_id()), self.result_file)
        if os.path.isfile(path):
            sites = sorted(c.name for c in engine.get_clients())
            logging.getLogger(RESULT_LOGGER).info(result_line(self.job, path, sites))
        else:
            self.log_warning(fl_ctx, f"{self.job} ended without saving its result file {path} (see the errors above)")
