"""The server's update guard: a FLARE result filter that refuses a site's result holding NaN/Inf or an outsized update.

Every medflare job (:class:`medflare.common.recipe.JobRecipe`) puts one :class:`UpdateGuard` in the server's
``task_result_filters`` for all its tasks, so FLARE's FedAvg / Scaffold (jobs/fedavg, fedprox, scaffold) and
every :class:`~medflare.common.workflow.SiteRounds` workflow (FedSM, FedVCK, FedIOD, FedST) are protected by
the same code, before any workflow or aggregator sees the result. The rules are
:mod:`medflare.common.update_guard`'s.

A refused result is replaced by an empty reply with return code :data:`UPDATE_REFUSED`: FLARE's workflows
then treat the site as one that failed its task (FedAvg / Scaffold in the baseline recipes run with
``ignore_result_error=True`` and aggregate, weighted, over the sites that answered; ``SiteRounds`` counts the
site as missing and its ``min_responses`` decides whether the round goes on). The guard logs an error naming
the site, task, round and reason (the reason also rides on the reply's
:data:`~medflare.common.site_errors.CAUSE_HEADER`, so a workflow that ends for want of sites names it), and writes
``guard/refused/<site>`` (1 refused, 0 accepted, per round) to the
server's TensorBoard (``tb_events/<server name>``, ``tb_events/simulator_server`` in the simulator).

The structure rule compares a result with the weights the server sent for that very task (each site's own task
data in a :class:`~medflare.common.workflow.SiteRounds` workflow): the filter reads the task back from the running
workflow's task monitor (FLARE's ``WFCommServer.process_task_check`` with the result's task id, the data as the
workflow built it). Where that cannot be read (no running workflow, a task no longer standing) the rule is
skipped for that result, and the other rules still apply.
"""

from __future__ import annotations

from typing import Any

from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.filter import Filter
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import ReservedHeaderKey, Shareable
from nvflare.app_common.app_constant import AlgorithmConstants, AppConstants

from medflare.checks import check_bool
from medflare.common.component import keep_args
from medflare.common.payload import ok_dxo
from medflare.common.site_errors import error_reply
from medflare.common.tracking import SERVER_EVENT_TYPE, SiteTracker
from medflare.common.update_guard import Part, UpdateScreen, weight_structure

#: return code of a result the guard refused (FLARE workflows skip any result whose code is not OK)
UPDATE_REFUSED = "UPDATE_REFUSED"


def dxo_parts(dxo: DXO, prefix: str = "") -> dict[str, Part]:
    """A DXO as :class:`Part` s by name: itself under ``prefix`` ("" at the top), or each part of a COLLECTION."""
    if dxo.data_kind == DataKind.COLLECTION and isinstance(dxo.data, dict):
        out: dict[str, Part] = {}
        for name, sub in dxo.data.items():
            full = f"{prefix}/{name}" if prefix else str(name)
            if isinstance(sub, DXO):
                out.update(dxo_parts(sub, full))
            else:
                out[full] = Part(kind="", data=sub)
        if dxo.meta:
            out[f"{prefix}/meta" if prefix else "meta"] = Part(kind="", data=None, meta=dxo.meta)
        return out
    kind = dxo.data_kind.value if isinstance(dxo.data_kind, DataKind) else str(dxo.data_kind)
    return {prefix: Part(kind=kind, data=dxo.data, meta=dxo.meta or {})}


def weight_parts(dxo: DXO) -> dict[str, Part]:
    """:func:`dxo_parts`, plus FLARE's SCAFFOLD control diff (which FLARE's Scaffold keeps in a result's meta and adds
    to its control variates key by key) as a WEIGHT_DIFF part of its own, so that the structure rule sees it too: no key
    the server did not send, the sent shapes and dtypes; it may leave out keys, since controls exist for trainable
    parameters only (a BatchNorm model's running statistics have none)."""
    parts = dxo_parts(dxo)
    ctrl = (dxo.meta or {}).get(AlgorithmConstants.SCAFFOLD_CTRL_DIFF)
    if ctrl is not None:
        parts[f"meta.{AlgorithmConstants.SCAFFOLD_CTRL_DIFF}"] = Part(kind=DataKind.WEIGHT_DIFF.value, data=ctrl, subset=True)
    return parts


def sent_structure(fl_ctx: FLContext) -> dict | None:
    """The :func:`~medflare.common.update_guard.weight_structure` of the task data the server sent for the result being
    filtered, read from the running workflow's task monitor by the result's task id; None when it cannot be read."""
    runner = fl_ctx.get_prop(FLContextKey.RUNNER)
    comm = getattr(getattr(getattr(runner, "current_wf", None), "controller", None), "communicator", None)
    task_id = fl_ctx.get_prop(FLContextKey.TASK_ID)
    if comm is None or not task_id or not hasattr(comm, "process_task_check"):
        return None
    client_task = comm.process_task_check(task_id=task_id, fl_ctx=fl_ctx)
    data = getattr(getattr(client_task, "task", None), "data", None)
    if not isinstance(data, Shareable):
        return None
    try:
        return weight_structure(dxo_parts(from_shareable(data)))
    except ValueError:
        return {}  # the server sent no DXO: no weights to compare with


def result_round(result: Shareable) -> Any:
    """The round a result answers: FLARE's contribution-round cookie (set by every ModelController), else its header."""
    rnd = result.get_cookie(AppConstants.CONTRIBUTION_ROUND)
    return rnd if rnd is not None else result.get_header(AppConstants.CURRENT_ROUND)


class UpdateGuard(Filter):
    """Server result filter: refuses a site's result that holds NaN/Inf or whose weight update is an outlier.

    Args:
        max_norm_ratio: a WEIGHTS / WEIGHT_DIFF payload whose norm exceeds this multiple of the median norm of the
            updates accepted for the same task and part this round and the round before is refused; 0 = norm rule
            off. Default 10 (an honest site's update is rarely more than a few times its peers'; a broken or hostile
            one is orders of magnitude off).
        enabled: False passes every result unchecked. Default True.
    """

    def __init__(self, max_norm_ratio: float = 10.0, enabled: bool = True):
        super().__init__()
        keep_args(self, max_norm_ratio=max_norm_ratio, enabled=enabled)
        check_bool("UpdateGuard", "enabled", enabled)
        self.screen = UpdateScreen(max_norm_ratio)
        self.tracker = SiteTracker(self, event_type=SERVER_EVENT_TYPE)

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        dxo = ok_dxo(shareable) if self.enabled else None
        if dxo is None:
            return shareable  # a site's own error reply (or no DXO: no model payload to judge) goes to the workflow as it is
        peer = fl_ctx.get_peer_context()
        site = peer.get_identity_name() if peer is not None else "?"
        task = fl_ctx.get_prop(FLContextKey.TASK_NAME) or shareable.get_header(ReservedHeaderKey.TASK_NAME, "")
        rnd = result_round(shareable)
        reason = self.screen.screen(task, rnd, weight_parts(dxo), sent=sent_structure(fl_ctx))
        step = rnd if isinstance(rnd, int) else 0
        self.tracker.scalars(fl_ctx, {f"guard/refused/{site}": float(reason is not None)}, step)
        if reason is None:
            return shareable
        self.log_error(fl_ctx, f"update guard refused the '{task}' result of site '{site}' in round {rnd}: {reason}; "
                               "the round goes on without it")
        reply = error_reply(UPDATE_REFUSED, f"the server's update guard refused it: {reason}")
        for key, value in (shareable.get(ReservedHeaderKey.HEADERS) or {}).items():  # task, round, cookies, peer
            if key not in (ReservedHeaderKey.RC, ReservedHeaderKey.CONTENT_TYPE):  # the original OK; it holds no DXO now
                reply.set_header(key, value)
        return reply
