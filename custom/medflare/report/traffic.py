"""What crossed the wire, measured where FLARE sees it: a server filter on task data (down) and results (up).

:class:`TrafficMeter` is a FLARE ``Filter``. The report's runner adds one to the server's ``task_data_filters``
(last, so it sees what actually leaves the server after any other filter) and one to its
``task_result_filters`` (first, so it sees what the site sent, before the update guard). Each call appends one
JSON line to ``traffic.jsonl`` in the server's app folder: time, direction, site, task, round, payload bytes
(:func:`payload_size`: the arrays' bytes in the DXO's data and meta, e.g. FLARE's SCAFFOLD sends its control
variates in meta; not FLARE's serialised message, which adds headers and compression) and the DXO data kind of every part (WEIGHTS, WEIGHT_DIFF, a custom kind such as
FedIOD's logits, ...): what kind of thing left the site. Shipped jobs do not carry it; it is a measuring
instrument (it reads, never changes, a payload).

:func:`summarize` turns the lines into per-site, per-round byte counts and into each site's busy time (result
received minus task handed out). The compute on the critical path is, summed over the job's exchanges (a task of a
round; FedIOD and FedST-join have several per round), the slowest site's time in that exchange; the report's "FLARE
overhead" is the job's wall time minus it: start-up, messaging, server-side aggregation or training, scoring.

The meter sees task results only. What a site sends on every channel (task results, analytics events, aux messages,
FLARE's download service) is recorded at the site's cell by the egress recorder the simulator runs add
(:mod:`medflare.jobs.egress`); :func:`summarize_egress` totals those records per site and channel, each payload
once (a download chunk is a piece of a payload counted whole), for the report's every-channel byte columns.
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Mapping

from nvflare.apis.dxo import DXO, DataKind
from nvflare.apis.filter import Filter
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import ReservedHeaderKey, Shareable

from medflare import ConfigError
from medflare.common.component import keep_args
from medflare.common.payload import ok_dxo, payload_bytes
from medflare.common.result_guard import dxo_parts, result_round

LEDGER = "traffic.jsonl"
DIRECTIONS = ("down", "up")


class TrafficMeter(Filter):
    """Server filter that records every payload's size and data kinds (module docstring).

    Args:
        direction: "down" in the server's task_data_filters, "up" in its task_result_filters.
    """

    def __init__(self, direction: str = "up"):
        super().__init__()
        if direction not in DIRECTIONS:
            raise ConfigError(f"TrafficMeter: 'direction' must be one of {DIRECTIONS}, got {direction!r}")
        keep_args(self, direction=direction)
        self._lock = threading.Lock()

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        dxo = ok_dxo(shareable)
        if dxo is None:
            return shareable
        peer = fl_ctx.get_peer_context()
        rnd = result_round(shareable)
        row = {"t": time.time(), "dir": self.direction, "site": peer.get_identity_name() if peer is not None else "?",
               "task": fl_ctx.get_prop(FLContextKey.TASK_NAME) or shareable.get_header(ReservedHeaderKey.TASK_NAME, ""),
               "round": rnd if isinstance(rnd, int) else None, "bytes": payload_size(dxo),
               "kinds": sorted({p.kind for p in dxo_parts(dxo).values() if p.kind})}
        app_root = fl_ctx.get_prop(FLContextKey.APP_ROOT)
        if app_root:
            with self._lock, open(Path(app_root) / LEDGER, "a") as f:
                f.write(json.dumps(row) + "\n")
        return shareable


def payload_size(dxo: DXO) -> int:
    """Bytes of every array in ``dxo``'s data and meta, and in each part's of a COLLECTION."""
    parts = dxo.data.values() if dxo.data_kind == DataKind.COLLECTION and isinstance(dxo.data, Mapping) else []
    own = 0 if parts else payload_bytes(dxo.data)
    return own + payload_bytes(dict(dxo.meta or {})) + sum(payload_size(p) if isinstance(p, DXO) else payload_bytes(p) for p in parts)


def meter_filters(config: dict) -> None:
    """Put a down meter last in the server's task-data chains and an up meter first in its result chains (FLARE
    allows one chain per task), for the tasks the result filters name (every medflare job's update guard does)."""
    path = f"{__name__}.TrafficMeter"
    results = config.setdefault("task_result_filters", [])
    if not results:
        results.append({"tasks": ["*"], "filters": []})
    tasks = sorted({t for chain in results for t in chain.get("tasks", [])})
    for chain in results:
        chain["filters"] = [{"path": path, "args": {"direction": "up"}}, *chain.get("filters", [])]
    data = config.setdefault("task_data_filters", [])
    covered = {t for chain in data for t in chain.get("tasks", [])}
    for chain in data:
        chain["filters"] = [*chain.get("filters", []), {"path": path, "args": {"direction": "down"}}]
    missing = [t for t in tasks if t not in covered]
    if missing:
        data.append({"tasks": missing, "filters": [{"path": path, "args": {"direction": "down"}}]})


def read_ledger(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def summarize(rows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Bytes per site and round each way, totals, kinds each way, each site's busy seconds, and the compute on the
    critical path (module docstring)."""
    per_site: dict[str, dict[str, dict[str, int]]] = defaultdict(lambda: defaultdict(lambda: {"down": 0, "up": 0}))
    kinds = {"down": set(), "up": set()}
    pending: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    busy: dict[str, float] = defaultdict(float)
    exchanges: dict[tuple, float] = defaultdict(float)  # (round, task, n-th exchange of the site in it) -> slowest site's s
    count: dict[tuple, int] = defaultdict(int)
    for row in sorted(rows, key=lambda r: r["t"]):
        site, d = row["site"], row["dir"]
        per_site[site][str(row.get("round"))][d] += int(row["bytes"])
        kinds[d].update(row.get("kinds", []))
        if d == "down":
            pending[site].append(row)
        elif pending[site]:
            sent = pending[site].pop(0)
            seconds = row["t"] - sent["t"]
            busy[site] += seconds
            key = (sent.get("round"), sent.get("task"))
            n = count[(site, *key)]
            count[(site, *key)] += 1
            exchanges[(*key, n)] = max(exchanges[(*key, n)], seconds)
    sites = sorted(per_site)
    total = {d: sum(r[d] for s in sites for r in per_site[s].values()) for d in DIRECTIONS}
    rounds = {s: len(per_site[s]) for s in sites}
    per_site_round = {d: (total[d] / sum(rounds.values()) if sum(rounds.values()) else 0.0) for d in DIRECTIONS}
    return {"per_site": {s: dict(per_site[s]) for s in sites}, "total": total, "per_site_round": per_site_round,
            "kinds": {d: sorted(k) for d, k in kinds.items()}, "busy_s": dict(busy), "compute_s": sum(exchanges.values())}


#: "channel/topic" prefixes of the egress records that are task results or analytics events (the rest: aux, downloads)
KNOWN_PAYLOAD_CHANNELS = ("server_command/submit_update", "task/", "aux_communication/fed.event")


def summarize_egress(records: Iterable[Mapping[str, Any]], rounds: Mapping[str, int] | None = None) -> dict[str, Any] | None:
    """Every channel's bytes from a run's egress records (:func:`medflare.jobs.egress.read_records`), or None when
    the run recorded nothing: ``per_site`` ``{site: {"channel/topic": bytes}}``, ``by_channel`` and ``messages`` (count)
    over all sites, ``total`` bytes, ``per_site_round`` (total over the rounds each site took part in, ``rounds``
    ``{site: n}`` as the meter counted them; the records carry no round, so this is an average), the data ``kinds``
    of the task results' parts, the analytics ``events`` types (scalar, image, ...), ``other`` channels that carried
    arrays (neither task results nor analytics events), and the download ``chunks`` left uncounted."""
    from medflare.jobs.egress import DOWNLOAD_CHANNEL, egress_bytes, sent_messages

    sent = sent_messages(records)
    if not sent:
        return None
    sites = sorted({str(r.get("site", "?")) for r in sent})
    messages: dict[str, int] = defaultdict(int)
    kinds, events = set(), set()
    for r in sent:
        messages[f"{r['channel']}/{r['topic']}"] += 1
        dxo = r.get("dxo") or {}
        if dxo.get("analytics_type"):
            events.add(dxo["analytics_type"].rsplit(".", 1)[-1].lower())
        elif dxo:
            kinds.update(p["kind"] for p in dxo.get("parts", {}).values())
    by_channel = egress_bytes(sent)
    total = sum(by_channel.values())
    n_rounds = sum((rounds or {}).get(s, 0) for s in sites)
    return {"per_site": {s: egress_bytes(sent, s) for s in sites}, "by_channel": by_channel, "messages": dict(messages),
            "total": total, "per_site_round": total / n_rounds if n_rounds else None, "kinds": sorted(kinds),
            "events": sorted(events), "other": [c for c, b in by_channel.items() if b and not c.startswith(KNOWN_PAYLOAD_CHANNELS)],
            "chunks": sum(1 for r in sent if r.get("type") == "bytes" and r["channel"] == DOWNLOAD_CHANNEL)}
