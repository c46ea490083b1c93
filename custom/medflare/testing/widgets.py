"""FLARE widgets for tests: components that only watch a job, as FLARE's own widgets do."""

from __future__ import annotations

import json
import os
import time

from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType

WATCHED = (AppEventType.ROUND_STARTED, AppEventType.BEFORE_AGGREGATION, AppEventType.AFTER_AGGREGATION,
           AppEventType.GLOBAL_BEST_MODEL_AVAILABLE, AppEventType.BEFORE_CONTRIBUTION_ACCEPT)


class EventRecorder(FLComponent):
    """Appends ``{"event", "round", "has_result", "time"}`` for each watched server event to ``<run dir>/<file_name>``
    (JSON lines; ``time`` is the wall clock in seconds, for per-round timings in benchmarks).

    Args:
        file_name: file in the job's run folder. Default "events.jsonl".
    """

    def __init__(self, file_name: str = "events.jsonl"):
        super().__init__()
        self.file_name = file_name

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type not in WATCHED:
            return
        engine = fl_ctx.get_engine()
        run_dir = engine.get_workspace().get_run_dir(fl_ctx.get_job_id())
        row = {
            "event": event_type,
            "round": fl_ctx.get_prop(AppConstants.CURRENT_ROUND),
            "has_result": fl_ctx.get_prop(AppConstants.AGGREGATION_RESULT) is not None,
            "time": time.time(),
        }
        with open(os.path.join(run_dir, self.file_name), "a") as f:
            f.write(json.dumps(row) + "\n")
