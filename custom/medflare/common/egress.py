"""What a site sends, in one place: declared parts of one COLLECTION DXO, checked against the job's manifest before
they leave, and unpacked on the server into the shape FLARE's workflows read.

The bundle's egress rule (docs/design.md, "What leaves a site"): every byte a site sends is either a task result whose
parts are DXOs of declared kinds, each passed through the site's task result filters (its privacy scope), or a channel
the site operator turned on in its own ``local/medflare_site.json`` (analytics: :mod:`medflare.common.tracking`).
Nothing model-sized, image-like or data-derived rides in DXO meta or headers: FLARE's filters see only DXO data.

Three pieces:

- :func:`site_reply` (site): builds the task result from named parts. FLARE's own workflows read some values from
  meta (``initial_metrics`` for the best-model selector, SCAFFOLD's control diff); on the wire these are parts
  (``lift``), and the part that FLARE's FedAvg / Scaffold expect as the whole result is named (``unwrap``).
- :class:`Intake` (server result filter, every task): turns a reply built by :func:`site_reply` back into what the
  workflows read (lifted parts into meta, the unwrapped part as the result), after the site's filters ran.
- :class:`ManifestFilter` (site result filter, every task, after the site's own scope): refuses any reply that
  holds a part, data kind, meta key or size the job's manifest does not declare, with a :class:`~medflare.PrivacyError`
  naming task, part and kind. The manifest is the recipe's (:func:`declare`); ``medflare audit jobs/<job>``
  prints it for a site operator before the job is approved (:func:`describe`).
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.filter import Filter
from nvflare.apis.fl_constant import FLContextKey, FLMetaKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import ReservedHeaderKey, Shareable
from nvflare.app_common.app_constant import AppConstants

from medflare import PrivacyError
from medflare.common.component import keep_args
from medflare.common.payload import ok_dxo, payload_bytes

#: collection meta keys of a reply built by :func:`site_reply` (names only, never data)
PACKED, UNWRAP, LIFT = "medflare_packed", "medflare_unwrap", "medflare_lift"
#: the part name under which a manifest declares a reply that is one DXO, not a collection
RESULT = "result"
#: meta keys any reply may hold besides a task's declared ones: FLARE's bookkeeping and the packing keys
BASE_META_KEYS = frozenset({FLMetaKey.NUM_STEPS_CURRENT_ROUND, MetaKey.FILTER_HISTORY, PACKED, UNWRAP, LIFT})
#: longest string a meta value or header may be (a status or a reason, not a payload)
MAX_TEXT = 512
#: cadences a manifest states (how often a part leaves a site)
CADENCES = ("every round", "every window", "once", "last round")


def site_reply(parts: Mapping[str, DXO], *, lift: Mapping[str, DXO] | None = None, unwrap: str = "",
               meta: Mapping[str, Any] | None = None, rnd: int | None = None) -> Shareable:
    """A site's task result: a COLLECTION of ``parts`` and ``lift`` (each a DXO its site's filters see).

    ``lift``: ``{meta key: DXO}`` parts the server puts into the result's meta under that key (their data), for FLARE
    components that read meta (``initial_metrics``, SCAFFOLD's ``scaffold_ctrl_diff``). ``unwrap``: the name of a part
    that the server makes the result itself (FLARE's FedAvg expects one WEIGHT_DIFF DXO). ``meta``: scalars only
    (a count, a status), checked by :class:`ManifestFilter`. ``rnd``: the round, set as the CURRENT_ROUND header.
    """
    body = dict(parts)
    for key, dxo in (lift or {}).items():
        if key in body:
            raise ValueError(f"part '{key}' is both a part and lifted")
        body[key] = dxo
    if unwrap and unwrap not in body:
        raise ValueError(f"unwrap names '{unwrap}', which is not a part ({sorted(body)})")
    out_meta = {**(meta or {}), PACKED: True, UNWRAP: unwrap, LIFT: sorted(lift or {})}
    shareable = DXO(data_kind=DataKind.COLLECTION, data=body, meta=out_meta).to_shareable()
    if rnd is not None:
        shareable.set_header(AppConstants.CURRENT_ROUND, rnd)
    return shareable


def unpack(dxo: DXO) -> DXO:
    """The server's view of a :func:`site_reply` collection (lifted parts in meta, the unwrapped part as the result);
    any other DXO unchanged."""
    meta = dict(dxo.meta or {})
    if dxo.data_kind != DataKind.COLLECTION or not meta.get(PACKED):
        return dxo
    parts = dict(dxo.data)
    unwrap = meta.get(UNWRAP) or ""
    main = parts.pop(unwrap) if unwrap and isinstance(parts.get(unwrap), DXO) else None
    for key in (PACKED, UNWRAP, LIFT):
        meta.pop(key, None)
    base = {**((main.meta or {}) if main is not None else {}), **meta}
    # a lifted part never replaces a meta key the reply already holds nor FLARE's bookkeeping (the count the server
    # bounds, the filter history): a site cannot smuggle a value past the server's own reading of the reply
    lifted = {key: parts.pop(key).data for key in meta_list(dxo.meta.get(LIFT))
              if isinstance(parts.get(key), DXO) and key not in base and key not in BASE_META_KEYS}
    if main is not None:
        return DXO(main.data_kind, data=main.data, meta={**base, **lifted})
    return DXO(DataKind.COLLECTION, data=parts, meta={**base, **lifted})


def meta_list(value: Any) -> list[str]:
    """The names in a list-valued packing key (an empty list for anything else)."""
    return [v for v in value if isinstance(v, str)] if isinstance(value, (list, tuple)) else []


class Intake(Filter):
    """Server result filter on every task: a :func:`site_reply` result as the workflows read it (:func:`unpack`).

    It runs on the server, after every filter of the site, so lifting a part into meta changes nothing about what
    the site's privacy scope saw. Placed before the update guard, which then judges what the workflow will use.
    """

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        dxo = ok_dxo(shareable)
        out = unpack(dxo) if dxo is not None else None
        return shareable if out is dxo else out.update_shareable(shareable)


# ---- the manifest ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Send:
    """One part a site sends for a task. ``part``: its name in the reply (:data:`RESULT` for a one-DXO reply);
    ``kind``: its DXO data kind; ``what``: what it holds, for the site operator; ``models``: its arrays' bound in
    states of the preset's network (1 = one weight diff of it; resolved where the preset is known, so a job run with
    another preset gets its own bound); ``max_bytes``: a fixed bound instead (None and ``models`` 0: bounded by the
    job's settings but not computed here); ``cadence``: one of :data:`CADENCES`."""

    part: str
    kind: str
    what: str
    models: float = 0.0
    max_bytes: int | None = None
    cadence: str = "every round"

    def __post_init__(self):
        if self.cadence not in CADENCES:
            raise ValueError(f"cadence '{self.cadence}' of part '{self.part}' is not one of {CADENCES}")


def declare(tasks: Mapping[str, Iterable[Send]], meta: Mapping[str, Sequence[str]] | None = None) -> dict:
    """A job's manifest as plain JSON (a FLARE component argument): ``{task: {"parts": {part: {...}}, "meta": [...]}}``.

    ``tasks``: the parts each task's reply may hold; ``meta``: per task, the meta keys it may hold besides
    :data:`BASE_META_KEYS` (scalar values only)."""
    out = {}
    for task, sends in tasks.items():
        parts = {}
        for s in sends:
            row = asdict(s)
            row.pop("part")
            parts[s.part] = row
        out[task] = {"parts": parts, "meta": sorted((meta or {}).get(task, ()))}
    return out


def resolve_bounds(manifest: Mapping[str, Any], model_state_bytes: int) -> dict:
    """``manifest`` with each part's ``max_bytes`` set from its ``models`` (states of a network of ``model_state_bytes``)."""
    out = copy.deepcopy(dict(manifest))
    for entry in out.values():
        for spec in entry["parts"].values():
            if spec.get("models"):
                spec["max_bytes"] = int(spec["models"] * model_state_bytes)
    return out


def kind_name(kind: Any) -> str:
    """A DXO data kind as its string (FLARE's DataKind members and custom string kinds alike)."""
    return kind.value if isinstance(kind, DataKind) else str(kind)


def state_bytes(module: torch.nn.Module) -> int:
    """Bytes of a network's state (parameters and buffers) on the wire: the bound of its weights or weight diff."""
    return int(sum(t.numel() * t.element_size() for t in module.state_dict().values()))


def preset_model_bytes(preset: str, overrides: Mapping[str, Any] | None = None) -> int:
    """Bytes of the state of the network a preset's ``model`` spec builds (what a WEIGHT_DIFF of it may hold)."""
    from medflare.nets import build_from_spec  # built on demand: once per site at its first reply, or by `medflare audit`
    from medflare.presets import get_preset

    return state_bytes(build_from_spec(get_preset(preset, overrides)["model"]))


def _meta_problems(meta: Mapping[str, Any], allowed: set[str], where: str) -> list[str]:
    problems = []
    for key, value in (meta or {}).items():
        if key not in allowed:
            problems.append(f"{where} meta key '{key}' is not declared (declared: {sorted(allowed)})")
        elif not is_small_scalar(value):
            problems.append(f"{where} meta '{key}' holds {type(value).__name__}, not a scalar: data rides in parts, "
                            "where the site's filters see it")
    return problems


def is_small_scalar(value: Any) -> bool:
    """What a meta value may be: a number, a flag, None, a short text or a short list of short texts (the site's
    :class:`ManifestFilter` and the test suite's egress audit apply this one rule)."""
    if value is None or isinstance(value, (bool, int, float)):
        return True
    if isinstance(value, str):
        return len(value) <= MAX_TEXT
    if isinstance(value, (list, tuple)):  # FLARE's filter history, the lifted parts' names
        return len(value) <= 64 and all(isinstance(v, str) and len(v) <= MAX_TEXT for v in value)
    return False


def _numbers_only(data: Any) -> bool:
    """A METRICS part's data: names -> numbers (a metric, a count), nothing an image could hide in."""
    return isinstance(data, Mapping) and all(isinstance(v, (bool, int, float, np.number)) for v in data.values())


def _holds_array(value: Any, depth: int = 0) -> bool:
    if isinstance(value, (np.ndarray, torch.Tensor, bytes, bytearray, memoryview)):
        return True
    if isinstance(value, str):
        return len(value) > MAX_TEXT * 8
    if depth < 4 and isinstance(value, Mapping):
        return any(_holds_array(v, depth + 1) for v in value.values())
    if depth < 4 and isinstance(value, (list, tuple)):
        return len(value) > 256 or any(_holds_array(v, depth + 1) for v in value)
    return False


def reply_problems(manifest: Mapping[str, Any], task: str, dxo: DXO, headers: Mapping[str, Any] | None = None) -> list[str]:
    """Why a task result may not leave under ``manifest`` (:func:`declare`); empty when it may.

    Checks: the task is declared; every part's name and data kind are declared for it and its arrays within
    ``max_bytes``; meta keys declared with scalar values (collection and parts); no array, bytes or long text in any
    header.
    """
    entry = manifest.get(task)
    if entry is None:
        return [f"task '{task}' is not in the job's manifest (declared: {sorted(manifest)})"]
    declared, allowed = entry["parts"], set(BASE_META_KEYS) | set(entry.get("meta", ()))
    problems = []
    if dxo.data_kind == DataKind.COLLECTION and isinstance(dxo.data, Mapping):
        parts = dict(dxo.data)
        problems += _meta_problems(dxo.meta, allowed, "the reply's")
    else:
        parts = {RESULT: dxo}
    for name, part in parts.items():
        if not isinstance(part, DXO):
            problems.append(f"part '{name}' is a {type(part).__name__}, not a DXO")
            continue
        kind, spec = kind_name(part.data_kind), declared.get(name)
        if spec is None:
            problems.append(f"part '{name}' ({kind}) is not declared for task '{task}' (declared: {sorted(declared)})")
            continue
        if kind != spec["kind"]:
            problems.append(f"part '{name}' is {kind}, declared {spec['kind']}")
        if kind == "METRICS" and not _numbers_only(part.data):
            problems.append(f"part '{name}' is METRICS but holds more than numbers")
        size = payload_bytes(part)
        if spec.get("max_bytes") is not None and size > spec["max_bytes"]:
            problems.append(f"part '{name}' ({kind}) holds {size} B, declared at most {spec['max_bytes']} B")
        problems += _meta_problems(part.meta, allowed, f"part '{name}'")
    for key, value in (headers or {}).items():
        if _holds_array(value):
            problems.append(f"header '{key}' holds an array, bytes or long text")
    return problems


class ManifestFilter(Filter):
    """Site result filter on every task: a reply the job's manifest does not declare does not leave the site.

    Runs after the site's privacy scope (FLARE applies scope filters first), so it judges what would really leave.
    A refused reply fails the task: the filter logs and raises a :class:`~medflare.PrivacyError` naming the task,
    part and kind, which FLARE turns into a TASK_RESULT_FILTER_ERROR reply.

    Args:
        manifest: the job's manifest (:func:`declare`), written into the client config by the recipe. Required.
        preset: the job's preset, whose network sizes the parts declared in ``models``. Default "" (no such parts).
        overrides: the job's overrides of the preset. Default none.
    """

    def __init__(self, manifest: Mapping[str, Any], preset: str = "", overrides: Mapping[str, Any] | None = None):
        super().__init__()
        keep_args(self, manifest=dict(manifest), preset=preset, overrides=overrides or {})
        self._bounded: dict | None = None

    def bounded(self) -> dict:
        """The manifest with its byte bounds resolved for the job's preset (built once, at the first reply)."""
        if self._bounded is None:
            self._bounded = resolve_bounds(self.manifest, preset_model_bytes(self.preset, self.overrides) if self.preset else 0)
        return self._bounded

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        if shareable.get_return_code(ReturnCode.OK) != ReturnCode.OK:
            return shareable  # an error reply carries no payload
        task = fl_ctx.get_prop(FLContextKey.TASK_NAME) or shareable.get_header(ReservedHeaderKey.TASK_NAME, "")
        try:
            dxo = from_shareable(shareable)
        except ValueError:
            problems = [f"the '{task}' reply is not a DXO, so no privacy filter could see it"]
        else:
            problems = reply_problems(self.bounded(), task, dxo, shareable.get(ReservedHeaderKey.HEADERS))
        if not problems:
            return shareable
        message = (f"site '{fl_ctx.get_identity_name()}' refused to send its '{task}' reply: "
                   + "; ".join(problems[:5]) + " (the job's manifest, `medflare audit` prints it)")
        self.log_error(fl_ctx, message)
        raise PrivacyError(message)


# ---- for a site operator -------------------------------------------------------------------------------------------
def describe(manifest: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per declared part: task, part, kind, max_bytes, cadence, what (``medflare audit``'s table)."""
    return [{"task": task, "part": part, **spec} for task, entry in manifest.items() for part, spec in entry["parts"].items()]


def job_manifest_filter(job: str | Path) -> dict | None:
    """The args (manifest, preset, overrides) of a job folder's ManifestFilter (client config), or None when it has none."""
    for path in sorted(Path(job).glob("*/config/config_fed_client.json")):
        for entry in json.loads(path.read_text()).get("task_result_filters", []):
            for f in entry.get("filters", []):
                if f.get("path", "").endswith("egress.ManifestFilter"):
                    return dict(f["args"])
    return None


def audit_job(job: str | Path) -> dict[str, Any]:
    """What a job folder's sites will send, for a site operator before approving it: its privacy scope, the manifest's
    parts with byte bounds resolved at the job's preset, the bytes a site sends per round at most (parts sent every
    round with a bound), the parts without a computed bound, and the analytics channel's rule. ConfigError when the
    folder is no job or declares no manifest."""
    from medflare import ConfigError

    folder = Path(job)
    if not (folder / "meta.json").is_file():
        raise ConfigError(f"'{folder}' is not a FLARE job folder (no meta.json)")
    args = job_manifest_filter(folder)
    if args is None:
        raise ConfigError(f"job '{folder}' declares no manifest of what its sites send (no medflare ManifestFilter in its "
                          "client config): a site should not approve it")
    preset = args.get("preset", "")
    manifest = resolve_bounds(args["manifest"], preset_model_bytes(preset, args.get("overrides")) if preset else 0)
    rows = describe(manifest)
    per_round = sum(r["max_bytes"] for r in rows if r["cadence"] == "every round" and r["max_bytes"] is not None)
    meta = json.loads((folder / "meta.json").read_text())
    return {"job": meta.get("name", folder.name), "scope": meta.get("scope", ""), "preset": preset, "parts": rows,
            "max_bytes_per_round": per_round,
            "unbounded": [f"{r['task']}/{r['part']}" for r in rows if r["max_bytes"] is None and r["kind"] != "METRICS"],
            "analytics": "scalars stream to the server's TensorBoard unless the site's medflare_site.json sets "
                         "privacy.stream_scalars false; pictures of the site's data stay in the site's own TensorBoard "
                         "unless it sets privacy.stream_images true"}
