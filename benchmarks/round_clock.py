"""A server widget for benchmarks: the wall-clock time of each ROUND_STARTED event, one JSON line per round.

It lives outside the medflare package so that a benchmark can add it to jobs of any version of the code
(``speed_benchmark.py --modes before`` runs an older medflare package).
"""

from __future__ import annotations

import json
import os
import time

from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType


class RoundClock(FLComponent):
    """Appends ``{"round", "time"}`` to ``<run dir>/<file_name>`` at every ROUND_STARTED.

    Args:
        file_name: file in the job's run folder. Default "round_times.jsonl".
    """

    def __init__(self, file_name: str = "round_times.jsonl"):
        super().__init__()
        self.file_name = file_name

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type != AppEventType.ROUND_STARTED:
            return
        run_dir = fl_ctx.get_engine().get_workspace().get_run_dir(fl_ctx.get_job_id())
        with open(os.path.join(run_dir, self.file_name), "a") as f:
            f.write(json.dumps({"round": fl_ctx.get_prop(AppConstants.CURRENT_ROUND), "time": time.time()}) + "\n")
