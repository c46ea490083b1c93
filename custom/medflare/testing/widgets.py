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


def _append(fl_ctx: FLContext, file_name: str, row: dict) -> None:
    """Append ``row`` as a JSON line to ``file_name`` in the job's run folder."""
    run_dir = fl_ctx.get_engine().get_workspace().get_run_dir(fl_ctx.get_job_id())
    with open(os.path.join(run_dir, file_name), "a") as f:
        f.write(json.dumps(row) + "\n")


class EventRecorder(FLComponent):
    """Appends ``{"event", "round", "has_result"}`` for each watched server event to ``<run dir>/<file_name>`` (JSON lines).

    Args:
        file_name: file in the job's run folder. Default "events.jsonl".
    """

    def __init__(self, file_name: str = "events.jsonl"):
        super().__init__()
        self.file_name = file_name

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type not in WATCHED:
            return
        _append(fl_ctx, self.file_name, {
            "event": event_type,
            "round": fl_ctx.get_prop(AppConstants.CURRENT_ROUND),
            "has_result": fl_ctx.get_prop(AppConstants.AGGREGATION_RESULT) is not None,
        })


def _describe_dxo(dxo) -> dict:
    """``{"kind", "keys": {key: [dtype, shape]}, "parts": {name: ...}}`` of a DXO (recursing into collections)."""
    import numpy as np
    from nvflare.apis.dxo import DXO, DataKind

    if dxo.data_kind == DataKind.COLLECTION:
        return {"kind": dxo.data_kind, "parts": {k: _describe_dxo(v) for k, v in dxo.data.items() if isinstance(v, DXO)}}
    keys = {}
    for key, value in (dxo.data or {}).items():
        arr = np.asarray(value)
        keys[key] = [str(arr.dtype), list(arr.shape)]
    return {"kind": dxo.data_kind, "keys": keys}


class PayloadRecorder(FLComponent):
    """Appends, for every result a site sends, ``{"site", "round", "dxo": <kinds, part names, data keys, dtypes, shapes>,
    "meta_keys"}`` (JSON lines) to ``<run dir>/<file_name>``: what crossed the wire after the site's filters.

    Args:
        file_name: file in the job's run folder. Default "payloads.jsonl".
    """

    def __init__(self, file_name: str = "payloads.jsonl"):
        super().__init__()
        self.file_name = file_name

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type != AppEventType.BEFORE_CONTRIBUTION_ACCEPT:
            return
        from nvflare.apis.dxo import from_shareable
        from nvflare.apis.fl_constant import FLContextKey

        peer = fl_ctx.get_peer_context()
        shareable = peer.get_prop(FLContextKey.SHAREABLE) if peer is not None else None
        if shareable is None:
            return
        try:
            dxo = from_shareable(shareable)
        except ValueError:
            return
        _append(fl_ctx, self.file_name, {"site": peer.get_identity_name(), "round": fl_ctx.get_prop(AppConstants.CURRENT_ROUND),
                                         "dxo": _describe_dxo(dxo), "meta_keys": sorted(dxo.meta or {})})
