"""FLARE widgets for tests and benchmarks: components that only watch a job, as FLARE's own widgets do.

Each writes to a file in the job's run folder (JSON rows, or arrays), which a test reads after the job ends.
"""

from __future__ import annotations

import json
import os
import time

from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import ReservedHeaderKey
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
    """Appends ``{"event", "round", "has_result", "time"}`` for each watched server event to ``<run dir>/<file_name>``
    (JSON lines; ``time`` is the wall clock in seconds, for per-round timings in benchmarks).

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
            "time": time.time(),
        })


def describe_dxo(dxo: DXO) -> dict:
    """``{"kind", "keys": {key: [dtype, shape]}}`` of a DXO, or ``{"kind", "parts": {name: ...}}`` for a COLLECTION."""
    import numpy as np

    if dxo.data_kind == DataKind.COLLECTION:
        return {"kind": dxo.data_kind, "parts": {k: describe_dxo(v) for k, v in (dxo.data or {}).items() if isinstance(v, DXO)}}
    keys = {}
    for key, value in (dxo.data or {}).items():
        arr = np.asarray(value)
        keys[key] = [str(arr.dtype), list(arr.shape)]
    return {"kind": dxo.data_kind, "keys": keys}


def dxo_kinds(dxo: DXO) -> list[str]:
    """Data kinds of a DXO and, for a COLLECTION, of every part (recursively)."""
    kinds = [dxo.data_kind]
    if dxo.data_kind == DataKind.COLLECTION and isinstance(dxo.data, dict):
        for part in dxo.data.values():
            if isinstance(part, DXO):
                kinds += dxo_kinds(part)
    return kinds


class PayloadRecorder(_JsonLinesRecorder):
    """Appends, for every site reply the server accepts, ``{"task", "site", "round", "kinds", "dxo", "meta_keys"}``
    (JSON lines) to ``<run dir>/<file_name>``: what crossed the wire after the site's filters -- the data kinds
    (collections opened), and per part the data keys with dtype and shape, and the DXO meta's keys.

    Args:
        file_name: file in the job's run folder. Default "payloads.jsonl".
    """

    def __init__(self, file_name: str = "payloads.jsonl"):
        super().__init__(file_name)

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type != AppEventType.BEFORE_CONTRIBUTION_ACCEPT:
            return
        peer = fl_ctx.get_peer_context()
        shareable = peer.get_prop(FLContextKey.SHAREABLE) if peer is not None else None
        if shareable is None:
            return
        row = {"task": shareable.get_header(ReservedHeaderKey.TASK_NAME) or fl_ctx.get_prop(FLContextKey.TASK_NAME),
               "site": peer.get_identity_name(default="?"), "round": fl_ctx.get_prop(AppConstants.CURRENT_ROUND)}
        try:
            dxo = from_shareable(shareable)
        except Exception:  # noqa: BLE001 - not a DXO: record that
            row.update(kinds=["<not a DXO>"], dxo=None, meta_keys=[])
        else:
            row.update(kinds=dxo_kinds(dxo), dxo=describe_dxo(dxo), meta_keys=sorted(dxo.meta or {}))
        self.append(fl_ctx, row)


def fingerprint(params) -> dict[str, list[float]]:
    """``{prefix: [sum, sum of squares]}`` (float64) of the float arrays of a flat params dict, grouped by the key's part
    before the first "." (FedSM's ``global``, ``person_<i>``, ``select``; one group for a plain model): two equal
    models have equal fingerprints, and the fingerprint of a weighted mean is the weighted mean of the sums."""
    import numpy as np

    out: dict[str, list[float]] = {}
    for key, value in (params or {}).items():
        arr = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
        if not np.issubdtype(arr.dtype, np.floating):
            continue
        acc = out.setdefault(str(key).partition(".")[0], [0.0, 0.0])
        acc[0] += float(arr.sum(dtype=np.float64))
        acc[1] += float(np.square(arr, dtype=np.float64).sum())
    return out


def _params_of(obj):
    """The flat params dict of an FLModel, a ModelLearnable, a DXO or a Shareable holding one (None otherwise)."""
    from nvflare.app_common.abstract.fl_model import FLModel
    from nvflare.app_common.abstract.model import ModelLearnableKey
    from nvflare.apis.shareable import Shareable

    if isinstance(obj, FLModel):
        return obj.params if isinstance(obj.params, dict) else None
    if isinstance(obj, Shareable):
        try:
            obj = from_shareable(obj)
        except Exception:  # noqa: BLE001 - not a DXO
            return None
    if isinstance(obj, DXO):
        return obj.data if obj.data_kind != DataKind.COLLECTION else None
    if isinstance(obj, dict) and ModelLearnableKey.WEIGHTS in obj:
        return obj[ModelLearnableKey.WEIGHTS]
    return None


class ModelRecorder(_JsonLinesRecorder):
    """Appends a :func:`fingerprint` of every model the server handles to ``<run dir>/<file_name>`` (JSON lines):
    ``{"event": "initial"}`` when the workflow loaded its initial model (INITIAL_MODEL_LOADED), ``{"event":
    "contribution", "site", "round", "n"}`` for every site reply accepted (n: its NUM_STEPS_CURRENT_ROUND weight), and
    ``{"event": "aggregate", "round"}`` for every aggregation result, each with ``"fingerprint"`` and ``"time"``.
    Tests read it to check which sites a round aggregated, with which weights, and which models stayed unchanged.

    Args:
        file_name: file in the job's run folder. Default "models.jsonl".
    """

    def __init__(self, file_name: str = "models.jsonl"):
        super().__init__(file_name)

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        from nvflare.apis.fl_constant import FLMetaKey

        row = {"round": fl_ctx.get_prop(AppConstants.CURRENT_ROUND), "time": time.time()}
        if event_type == AppEventType.INITIAL_MODEL_LOADED:
            row.update(event="initial", fingerprint=fingerprint(_params_of(fl_ctx.get_prop(AppConstants.GLOBAL_MODEL))))
        elif event_type == AppEventType.AFTER_AGGREGATION:
            row.update(event="aggregate", fingerprint=fingerprint(_params_of(fl_ctx.get_prop(AppConstants.AGGREGATION_RESULT))))
        elif event_type == AppEventType.BEFORE_CONTRIBUTION_ACCEPT:
            peer = fl_ctx.get_peer_context()
            shareable = peer.get_prop(FLContextKey.SHAREABLE) if peer is not None else None
            if shareable is None:
                return
            try:
                dxo = from_shareable(shareable)
            except Exception:  # noqa: BLE001 - not a DXO: the site is still recorded
                dxo = None
            row.update(event="contribution", site=peer.get_identity_name(default="?"),
                       n=(dxo.meta or {}).get(FLMetaKey.NUM_STEPS_CURRENT_ROUND) if dxo is not None else None,
                       fingerprint=fingerprint(_params_of(dxo)))
        else:
            return
        self.append(fl_ctx, row)


class UnfilteredResultRecorder(FLComponent):
    """Client widget: every task result as the site's executor made it, before any filter ran (the privacy scope's or
    the job's), its model update saved as ``<run dir>/<prefix><task>_<n>.npz`` (n counts that task's results from 0):
    the part the server would take as the result (:func:`medflare.common.egress.unpack`, e.g. FedAvg's WEIGHT_DIFF).
    FLARE fires AFTER_TASK_EXECUTION with the reply before it filters it, so a test compares what a site computed with
    what its filters let out, in one run. Results without such a part (validation scores) are skipped.

    Args:
        prefix: file name prefix. Default "unfiltered_".
    """

    def __init__(self, prefix: str = "unfiltered_"):
        super().__init__()
        self.prefix = prefix
        self._count: dict[str, int] = {}

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        import numpy as np

        from medflare.common.egress import unpack

        if event_type != EventType.AFTER_TASK_EXECUTION:
            return
        try:
            params = _params_of(unpack(from_shareable(fl_ctx.get_prop(FLContextKey.TASK_RESULT))))
        except Exception:  # noqa: BLE001 - an error reply or not a DXO: nothing to keep
            return
        if not params:
            return
        task = fl_ctx.get_prop(FLContextKey.TASK_NAME)
        n = self._count[task] = self._count.get(task, -1) + 1
        run_dir = fl_ctx.get_engine().get_workspace().get_run_dir(fl_ctx.get_job_id())
        np.savez(os.path.join(run_dir, f"{self.prefix}{task}_{n}.npz"), **{k: np.array(v) for k, v in params.items()})
