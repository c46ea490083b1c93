"""The egress audit of a run: every message a site's job process sends, recorded at FLARE's cell level, and judged.

A privacy scope and the job's manifest only see task results. A site also sends federated events (analytics),
aux messages, heartbeats and the chunks of large payloads, and a task result carries meta and headers that no
filter sees. :class:`EgressRecorder` (a client component that :func:`~medflare.jobs.simulate.run_simulator` adds to
a copy of the job, for the report and the tests) wraps the sending methods of the site's cell at START_RUN and writes one JSON line per outgoing message to ``<site run dir>/egress.jsonl``: channel,
topic, bytes, and what the payload holds (a task result's parts with kinds and array shapes, its meta keys and
value types, arrays found in headers or outside any DXO, the analytics data type of a federated event).

:func:`violations` applies the bundle's egress rule (:mod:`medflare.common.egress`) to those records: a task result's
parts must be declared by the job's manifest, no meta value may be more than a scalar, no array may travel outside a
declared part (headers, meta, aux and event payloads), analytics events carry scalars unless the site opted in to
pictures (``privacy.stream_images``), and every channel must be one of FLARE's own that the bundle uses
(:data:`CHANNELS`). Payload chunks (FLARE's object download) are bytes of a message already judged whole.

:func:`medflare.jobs.simulate.run_simulator` adds the recorder to every job it runs and :meth:`SimRun.egress` reads the
records, so every simulator run of the test suite is audited (tests/e2e/test_egress_audit.py). :func:`egress_bytes`
totals a run's records by channel (each payload once); the report's byte columns use it.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
import torch
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import ReservedHeaderKey, Shareable

from medflare.common.egress import BASE_META_KEYS, RESULT, is_small_scalar, kind_name
from medflare.common.site_config import read_site_config

FILE_NAME = "egress.jsonl"
#: cell methods that send (CoreCell's, reached through Cell's dispatch)
SENDERS = ("send_request", "fire_and_forget", "broadcast_request", "broadcast_multi_requests", "queue_message")
#: an array with more elements than this outside a declared part is data leaving unseen (a scalar box is not)
SMALL = 16
#: (channel, topic) of a task result: FLARE's submit_update, which the site's task result filters saw
TASK_RESULT = ("server_command", "submit_update")
#: (channel, topic) pairs a site job process uses with the bundle ("*": any topic of FLARE's own channel); measured on
#: the simulator: the task protocol, FLARE's download service (the site fetching a large task, or the server pulling a
#: large result), aux messages of known topics (analytics events, FLARE's task check, medflare's task-ready probe)
CHANNELS = {
    ("server_command", "get_task"), TASK_RESULT, ("task", "*"),
    ("download_service__", "*"),
    ("aux_communication", "fed.event"), ("aux_communication", "__task_check__"), ("aux_communication", "medflare.task_ready"),
}


def _describe_arrays(tree: Any, path: str = "", depth: int = 0) -> list[dict]:
    """``[{"path", "shape", "dtype", "size"}]`` of the numpy arrays / tensors / byte strings in nested containers."""
    out: list[dict] = []
    if isinstance(tree, (np.ndarray, torch.Tensor)):
        shape = list(tree.shape)
        out.append({"path": path, "shape": shape, "dtype": str(tree.dtype), "size": int(np.prod(shape)) if shape else 1})
    elif isinstance(tree, (bytes, bytearray, memoryview)):
        out.append({"path": path, "shape": [len(tree)], "dtype": "bytes", "size": len(tree)})
    elif depth < 8 and isinstance(tree, DXO):
        out += _describe_arrays(tree.data, f"{path}.data", depth + 1)
        out += _describe_arrays(tree.meta, f"{path}.meta", depth + 1)
    elif depth < 8 and isinstance(tree, Mapping):
        for key, value in tree.items():
            out += _describe_arrays(value, f"{path}.{key}" if path else str(key), depth + 1)
    elif depth < 8 and isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            out += _describe_arrays(value, f"{path}[{i}]", depth + 1)
    return out


def _meta_types(meta: Mapping[str, Any] | None) -> dict[str, str]:
    return {str(k): type(v).__name__ for k, v in (meta or {}).items()}


def describe_payload(payload: Any) -> dict:
    """What an outgoing payload holds (see the module docstring): JSON-ready."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return {"type": "bytes", "bytes": len(payload)}
    if not isinstance(payload, Shareable):
        return {"type": type(payload).__name__, "arrays": _describe_arrays(payload)}
    headers = payload.get(ReservedHeaderKey.HEADERS, {}) or {}
    row: dict[str, Any] = {"type": "Shareable", "task": headers.get(ReservedHeaderKey.TASK_NAME),
                           "header_arrays": _describe_arrays(headers), "return_code": headers.get(ReservedHeaderKey.RC)}
    try:
        dxo = from_shareable(payload)
    except Exception:  # noqa: BLE001 - not a DXO: everything in it is outside a part
        body = {k: v for k, v in payload.items() if k != ReservedHeaderKey.HEADERS}
        row.update(dxo=None, loose_arrays=_describe_arrays(body))
        return row
    parts = dict(dxo.data) if dxo.data_kind == DataKind.COLLECTION and isinstance(dxo.data, Mapping) else {RESULT: dxo}
    row["dxo"] = {
        "kind": kind_name(dxo.data_kind), "meta": _meta_types(dxo.meta),
        "meta_not_scalar": sorted(str(k) for k, v in (dxo.meta or {}).items() if not is_small_scalar(v)),
        "meta_arrays": _describe_arrays(dxo.meta),
        "analytics_type": str((dxo.meta or {}).get("analytics_data_type", "")),
        "parts": {name: ({"kind": kind_name(p.data_kind), "meta": _meta_types(p.meta), "meta_arrays": _describe_arrays(p.meta),
                          "arrays": _describe_arrays(p.data)} if isinstance(p, DXO) else {"kind": "<not a DXO>",
                                                                                       "arrays": _describe_arrays(p)})
                  for name, p in parts.items()},
    }
    return row


class EgressRecorder(FLComponent):
    """Client component (added to a copy of a job by the report and the tests, never shipped in jobs/): records every message the site's job process sends (see the module docstring).

    Args:
        file_name: JSON-lines file in the site's run folder. Default "egress.jsonl".
    """

    def __init__(self, file_name: str = FILE_NAME):
        super().__init__()
        self.file_name = file_name
        self._path: Path | None = None
        self._lock = threading.Lock()
        self._site = ""

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type != EventType.START_RUN:
            return
        engine = fl_ctx.get_engine()
        workspace = fl_ctx.get_prop(FLContextKey.WORKSPACE_OBJECT)
        self._site = fl_ctx.get_identity_name()
        self._path = Path(workspace.get_run_dir(fl_ctx.get_job_id())) / self.file_name
        privacy = read_site_config(workspace.get_site_config_dir(), self._site)["privacy"]  # the site's own opt-ins
        self._write({"site": self._site, "start": True, "stream_images": privacy.get("stream_images") is True,
                     "stream_scalars": privacy.get("stream_scalars", True) is True})
        cell = engine.get_cell()
        for name in SENDERS:
            setattr(cell, name, self._wrap(getattr(cell, name), name))
        core = getattr(cell, "core_cell", None)
        if core is not None and hasattr(core, "_filter_outgoing_reply"):
            original = core._filter_outgoing_reply

            def record_reply(reply, _original=original):
                out = _original(reply)
                self._record("reply", reply.get_header("channel", ""), reply.get_header("topic", ""), out.payload)
                return out

            core._filter_outgoing_reply = record_reply

    def _wrap(self, send, method: str):
        def wrapped(*args, **kwargs):
            try:
                for channel, topic, message in _messages(method, args, kwargs):
                    self._record(method, channel, topic, getattr(message, "payload", None))
            except Exception as exc:  # noqa: BLE001 - the recorder must never break the site
                self._write({"site": self._site, "method": method, "recorder_error": repr(exc)})
            return send(*args, **kwargs)

        return wrapped

    def _record(self, method: str, channel: str, topic: str, payload: Any) -> None:
        self._write({"site": self._site, "method": method, "channel": channel, "topic": topic, **describe_payload(payload)})

    def _write(self, row: dict) -> None:
        if self._path is None:
            return
        with self._lock, open(self._path, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")


def _messages(method: str, args: tuple, kwargs: dict) -> Iterable[tuple[str, str, Any]]:
    """(channel, topic, message) of one call of a cell's sending method (positional or keyword arguments)."""
    if method == "broadcast_multi_requests":
        target_msgs = kwargs.get("target_msgs", args[0] if args else {})
        return [(tm.channel, tm.topic, tm.message) for tm in target_msgs.values()]
    names = {"send_request": ("channel", "target", "topic", "request"), "fire_and_forget": ("channel", "topic", "targets", "message"),
             "broadcast_request": ("channel", "topic", "targets", "request"), "queue_message": ("channel", "topic", "targets", "message")}
    bound = dict(zip(names[method], args))
    bound.update(kwargs)
    return [(bound.get("channel", ""), bound.get("topic", ""), bound.get("request", bound.get("message")))]


# ---- judging the records ------------------------------------------------------------------------------------------
def read_records(workspace: str | Path) -> list[dict]:
    """Every record of every site of a simulator workspace (``<ws>/<site>/simulate_job/egress.jsonl``)."""
    rows = []
    for path in sorted(Path(workspace).glob(f"*/simulate_job/{FILE_NAME}")):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows


def _channel_known(channel: str, topic: str) -> bool:
    return (channel, topic) in CHANNELS or (channel, "*") in CHANNELS


def _big(arrays: Iterable[dict]) -> list[str]:
    return [f"{a['path']} {a['shape']} {a['dtype']}" for a in arrays if a["size"] > SMALL]


def violations(records: Iterable[dict], manifest: Mapping[str, Any] | None) -> list[str]:
    """What broke the egress rule (see the module docstring) in one run's records; ``manifest``: the job's (None: the
    task results' parts are not checked against a declaration)."""
    out: list[str] = []
    policy: dict[str, dict] = {}
    for r in records:
        site = r.get("site", "?")
        if r.get("start"):
            policy[site] = r
            continue
        if "recorder_error" in r:
            out.append(f"{site}: the recorder failed on a {r['method']} ({r['recorder_error']})")
            continue
        where = f"{site} {r['method']} {r['channel']}/{r['topic']}"
        if not _channel_known(r["channel"], r["topic"]):
            out.append(f"{where}: a channel the bundle does not declare")
        if r["type"] == "bytes":
            continue  # a chunk of a payload judged whole when it was sent, or FLARE's own binary protocol
        if r["type"] != "Shareable":
            out += [f"{where}: array outside any DXO: {a}" for a in _big(r.get("arrays", []))]
            continue
        out += [f"{where}: array in a header: {a}" for a in _big(r["header_arrays"])]
        dxo = r.get("dxo")
        if dxo is None:
            out += [f"{where}: array outside any DXO: {a}" for a in _big(r.get("loose_arrays", []))]
            continue
        if dxo["analytics_type"]:  # a federated analytics event: scalars, pictures only by the site's choice
            image = "IMAGE" in dxo["analytics_type"].upper()
            if image and not policy.get(site, {}).get("stream_images"):
                out.append(f"{where}: a picture streamed to the server, but the site did not opt in (privacy.stream_images)")
            if not image:
                out += [f"{where}: array in an analytics event: {a}" for a in _big(_all_arrays(dxo))]
            continue
        out += [f"{where}: array in meta: {a}" for a in _big(dxo["meta_arrays"])]
        out += [f"{where}: meta '{k}' is a {dxo['meta'][k]}" for k in dxo.get("meta_not_scalar", []) if k not in BASE_META_KEYS]
        task = r.get("task")
        declared = (manifest or {}).get(task, {}).get("parts") if manifest is not None else None
        if manifest is not None and (r["channel"], r["topic"]) == TASK_RESULT and declared is None:
            out.append(f"{where}: task '{task}' is not in the job's manifest")
            continue
        for name, part in dxo["parts"].items():
            if dxo["kind"] == "COLLECTION":  # a one-DXO reply's meta was judged above
                out += [f"{where}: array in the meta of part '{name}': {a}" for a in _big(part.get("meta_arrays", []))]
            if declared is not None and (name not in declared or declared[name]["kind"] != part["kind"]):
                out.append(f"{where}: part '{name}' ({part['kind']}) of task '{task}' is not declared")
    return out


def _all_arrays(dxo: Mapping[str, Any]) -> list[dict]:
    return [a for part in dxo["parts"].values() for a in part.get("arrays", [])] + dxo["meta_arrays"]


# ---- counting the records' bytes ----------------------------------------------------------------------------------
#: FLARE's object download: a site's replies on it are chunks of a payload whose arrays were counted whole when it was sent
DOWNLOAD_CHANNEL = "download_service__"


def _itemsize(dtype: str) -> int:
    """Bytes per element of a recorded dtype (``float32``, ``torch.bfloat16``, ``bytes``, ...)."""
    if dtype == "bytes":
        return 1
    if dtype.startswith("torch."):
        return getattr(torch, dtype.removeprefix("torch.")).itemsize
    return np.dtype(dtype).itemsize


def record_arrays(record: Mapping[str, Any]) -> list[dict]:
    """Every array a record describes, each once: headers, a COLLECTION's own meta, each part's data and meta (a DXO
    that is not a COLLECTION is recorded as its own single part, so its meta is counted with the part), loose arrays."""
    if record.get("type") == "bytes":
        return []
    if record.get("type") != "Shareable":
        return list(record.get("arrays", []))
    dxo = record.get("dxo")
    if dxo is None:
        return [*record.get("header_arrays", []), *record.get("loose_arrays", [])]
    own = dxo.get("meta_arrays", []) if dxo.get("kind") == DataKind.COLLECTION.value else []
    parts = [a for part in dxo.get("parts", {}).values() for a in (*part.get("meta_arrays", []), *part.get("arrays", []))]
    return [*record.get("header_arrays", []), *own, *parts]


def message_bytes(record: Mapping[str, Any]) -> int:
    """Payload bytes of one recorded message: its arrays (elements x item size) or its raw byte length; 0 for a
    chunk on FLARE's download channel (:data:`DOWNLOAD_CHANNEL`), a piece of a payload already counted whole."""
    if record.get("type") == "bytes":
        return 0 if record.get("channel") == DOWNLOAD_CHANNEL else int(record.get("bytes", 0))
    return sum(int(a["size"]) * _itemsize(str(a["dtype"])) for a in record_arrays(record))


def sent_messages(records: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The records that are messages (not a site's start line nor a recorder error)."""
    return [r for r in records if not r.get("start") and "recorder_error" not in r and "channel" in r]


def egress_bytes(records: Iterable[Mapping[str, Any]], site: str | None = None) -> dict[str, int]:
    """``{"channel/topic": bytes}`` of every message the sites (or only ``site``) sent (:func:`message_bytes`: each
    payload once), in first-seen order; a channel whose messages carried no arrays shows 0."""
    out: dict[str, int] = {}
    for r in sent_messages(records):
        if site is None or r.get("site") == site:
            key = f"{r['channel']}/{r['topic']}"
            out[key] = out.get(key, 0) + message_bytes(r)
    return out
