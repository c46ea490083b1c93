"""The logging configuration medflare ships: FLARE's own concise console without FLARE's transport bookkeeping.

FLARE 2.9 reads a process's logging configuration from the command line (``nvflare simulator -l FILE``, what
``SimEnv(log_config=...)`` passes) or from the site's ``local/log_config.json`` (POC and provisioned sites, and a
simulator workspace's ``local/`` when no ``-l`` is given); it reads none from a job folder. So the configuration is a
file a site (or a run) points FLARE at:

- :func:`site_log_config` (shipped as ``app_configs/site/local/log_config.json`` and ``app_configs/server/local/``,
  and what ``nvflare simulator ... -l app_configs/site/local/log_config.json`` uses): FLARE's concise console, with the
  loggers in :data:`QUIET` at WARNING, so the lines FLARE writes for every object it streams (``set transaction info``,
  ``object has been downloaded to all 1 receivers``) and for every simulated task (``Finished one task run``) are in no
  console and no log file;
- :func:`run_log_config` (``medflare run``): the same files, and a console that shows only the jobs' per-round lines
  (:mod:`medflare.common.summary`) and warnings and errors.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

#: FLARE loggers whose INFO lines are bookkeeping of its transport: one pair per object streamed to a site or back
#: (``nvflare.fuel.f3.streaming.cacheable``'s subclasses for tensors and arrays), and the simulator's worker (one line per
#: task per site); their warnings and errors still show
QUIET = (
    "nvflare.app_opt.pt.tensor_downloader",
    "nvflare.app_common.np.np_downloader",
    "nvflare.fuel.f3.streaming.cacheable",
    "__main__.ClientTaskWorker",
)


def site_log_config() -> dict[str, Any]:
    """FLARE's concise logging configuration with the loggers of :data:`QUIET` at WARNING."""
    from nvflare.fuel.utils.log_utils import concise_log_dict

    config = copy.deepcopy(concise_log_dict)
    config.setdefault("loggers", {}).update({name: {"level": "WARNING"} for name in QUIET})
    return config


def run_log_config() -> dict[str, Any]:
    """:func:`site_log_config` whose console shows the jobs' per-round lines (the message alone) and, from every logger,
    warnings and errors; the log files keep everything else."""
    from medflare.common.summary import ROUNDS_LOGGER  # medflare run prints the result itself: not the end-of-run line

    config = site_log_config()
    config["formatters"]["summaryFormatter"] = {"()": "nvflare.fuel.utils.log_utils.BaseFormatter", "fmt": "%(message)s"}
    config["filters"]["SummaryFilter"] = {"()": "nvflare.fuel.utils.log_utils.LoggerNameFilter",
                                         "logger_names": [ROUNDS_LOGGER], "allow_all_error_logs": False}
    console = config["handlers"]["consoleHandler"]
    config["handlers"]["warningsHandler"] = {**copy.deepcopy(console), "level": "WARNING", "filters": []}
    console.update(formatter="summaryFormatter", filters=["SummaryFilter"], level="INFO")
    config["loggers"]["root"]["handlers"].append("warningsHandler")
    return config


def write_log_config(config: dict[str, Any], path: str | Path) -> Path:
    """Write ``config`` as JSON to ``path`` (its folder made); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=4) + "\n")
    return path
