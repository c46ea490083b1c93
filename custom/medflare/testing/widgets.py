"""FLARE widgets for tests: components that only watch a job, as FLARE's own widgets do."""

from __future__ import annotations

import json
import os

from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType

WATCHED = (AppEventType.ROUND_STARTED, AppEventType.BEFORE_AGGREGATION, AppEventType.AFTER_AGGREGATION,
           AppEventType.GLOBAL_BEST_MODEL_AVAILABLE, AppEventType.BEFORE_CONTRIBUTION_ACCEPT)


class _JsonLinesRecorder(FLComponent):
    """A widget that appends JSON rows to ``<run dir>/<file_name>``."""

    def __init__(self, file_name: str):
        super().__init__()
        self.file_name = file_name

    def append(self, fl_ctx: FLContext, row: dict) -> None:
        run_dir = fl_ctx.get_engine().get_workspace().get_run_dir(fl_ctx.get_job_id())
        with open(os.path.join(run_dir, self.file_name), "a") as f:
            f.write(json.dumps(row) + "\n")


class EventRecorder(_JsonLinesRecorder):
    """Appends ``{"event", "round", "has_result"}`` for each watched server event to ``<run dir>/<file_name>`` (JSON lines).

    Args:
        file_name: file in the job's run folder. Default "events.jsonl".
    """

    def __init__(self, file_name: str = "events.jsonl"):
        super().__init__(file_name)

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type not in WATCHED:
            return
        self.append(fl_ctx, {
            "event": event_type,
            "round": fl_ctx.get_prop(AppConstants.CURRENT_ROUND),
            "has_result": fl_ctx.get_prop(AppConstants.AGGREGATION_RESULT) is not None,
        })


def dxo_kinds(dxo) -> list[str]:
    """Data kinds of a DXO and, for a COLLECTION, of every part (recursively)."""
    from nvflare.apis.dxo import DXO, DataKind

    kinds = [dxo.data_kind]
    if dxo.data_kind == DataKind.COLLECTION and isinstance(dxo.data, dict):
        for part in dxo.data.values():
            if isinstance(part, DXO):
                kinds += dxo_kinds(part)
    return kinds


class ReplyKindRecorder(_JsonLinesRecorder):
    """Appends ``{"task", "site", "kinds"}`` for every site reply the server accepts to ``<run dir>/<file_name>``:
    the DXO data kinds (collections opened) that left each site, as the server received them.

    Args:
        file_name: file in the job's run folder. Default "reply_kinds.jsonl".
    """

    def __init__(self, file_name: str = "reply_kinds.jsonl"):
        super().__init__(file_name)

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type != AppEventType.BEFORE_CONTRIBUTION_ACCEPT:
            return
        from nvflare.apis.dxo import from_shareable
        from nvflare.apis.fl_constant import FLContextKey
        from nvflare.apis.shareable import ReservedHeaderKey

        peer = fl_ctx.get_peer_context()
        shareable = peer.get_prop(FLContextKey.SHAREABLE) if peer is not None else None
        if shareable is None:
            return
        try:
            kinds = dxo_kinds(from_shareable(shareable))
        except Exception:  # noqa: BLE001 - not a DXO: record that
            kinds = ["<not a DXO>"]
        task = shareable.get_header(ReservedHeaderKey.TASK_NAME) or fl_ctx.get_prop(FLContextKey.TASK_NAME)
        self.append(fl_ctx, {"task": task, "site": peer.get_identity_name(default="?"), "kinds": kinds})
