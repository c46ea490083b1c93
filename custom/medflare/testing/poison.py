"""A broken or hostile site for tests: a client result filter that turns one site's weight updates into NaN or scales them,
claims a count of its choosing, or sends a structure unlike the model it was sent (wrong shape, extra or missing key).

Put it in the client config's ``task_result_filters`` (``customize_job(task_result_filters=[{"tasks": ["train"],
"filters": [{"path": "medflare.testing.poison.PoisonFilter", "args": {"site": "site-2", "from_round": 1}}]}])``):
every site runs it, only ``site`` is changed. It is how the issue measured that one NaN site ends a FedAvg job, and
how the tests show that the server's update guard (:mod:`medflare.common.result_guard`) and the server's weight bound
(:mod:`medflare.common.site_weights`) stop it. Never used by a job.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.filter import Filter
from nvflare.apis.fl_constant import FLContextKey, FLMetaKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable

from medflare.common.component import keep_args

WEIGHT_KINDS = (DataKind.WEIGHTS, DataKind.WEIGHT_DIFF)
#: what ``tamper`` can do to the weight parts: the issue's malformed updates
TAMPERS = ("", "wrong_shape", "extra_key", "missing_key")


def poison(dxo: DXO, scale: float | None) -> None:
    """In place: every float array of the WEIGHTS / WEIGHT_DIFF parts of ``dxo`` (COLLECTION parts too) set to NaN,
    or multiplied by ``scale`` when given."""
    for part in weight_dxos(dxo):
        for key, value in part.data.items():
            arr = np.asarray(value)
            if np.issubdtype(arr.dtype, np.floating):
                part.data[key] = arr * scale if scale is not None else np.full_like(arr, np.nan)


def weight_dxos(dxo: DXO) -> list[DXO]:
    """The WEIGHTS / WEIGHT_DIFF DXOs of ``dxo`` (itself, or the parts of a COLLECTION, recursively)."""
    if dxo.data_kind == DataKind.COLLECTION:
        return [w for part in dxo.data.values() if isinstance(part, DXO) for w in weight_dxos(part)]
    return [dxo] if dxo.data_kind in WEIGHT_KINDS else []


def tamper_structure(dxo: DXO, how: str) -> None:
    """In place, on the first weight part of ``dxo``: its last float key of more than one entry as a (1,) array
    ("wrong_shape", a bias sent as one number), a key the server never sent ("extra_key"), or that key left out
    ("missing_key")."""
    parts = weight_dxos(dxo)
    if not how or not parts:
        return
    data = parts[0].data
    key = [k for k, v in data.items() if np.issubdtype(np.asarray(v).dtype, np.floating) and np.size(v) > 1][-1]
    if how == "wrong_shape":
        data[key] = np.zeros(1, dtype=np.asarray(data[key]).dtype)
    elif how == "extra_key":
        data[f"{key}.poison"] = np.zeros(2, dtype=np.float32)
    elif how == "missing_key":
        del data[key]


def claim_steps(dxo: DXO, steps: float) -> None:
    """In place: ``steps`` as the count (``NUM_STEPS_CURRENT_ROUND``) wherever ``dxo`` or its parts report one (the top
    meta when none does)."""
    metas = [d.meta for d in [dxo, *weight_dxos(dxo)] if d.meta is not None and FLMetaKey.NUM_STEPS_CURRENT_ROUND in d.meta]
    for meta in metas or [dxo.meta]:
        meta[FLMetaKey.NUM_STEPS_CURRENT_ROUND] = steps


class TaskCounter:
    """Counts the tasks (or results) a filter sees per task name, so a test filter can act from or at a round."""

    def __init__(self):
        self.seen: dict[str, int] = defaultdict(int)

    def next(self, fl_ctx: FLContext) -> tuple[str, int]:
        """``(task name, 0-based count of this task so far)`` for the shareable being filtered now."""
        task = fl_ctx.get_prop(FLContextKey.TASK_NAME) or "?"
        self.seen[task] += 1
        return task, self.seen[task] - 1


class PoisonFilter(Filter):
    """Client result filter: from the ``from_round``-th result (0-based, counted per task) on, ``site``'s weight
    updates become NaN, or are multiplied by ``scale`` when it is given; with ``steps`` the site also claims that count;
    with ``tamper`` ("wrong_shape", "extra_key", "missing_key") its update is malformed instead (no NaN then).
    Args: site, from_round (default 1), scale (default None = NaN), steps (default None = the site's own), tamper
    (default "")."""

    def __init__(self, site: str, from_round: int = 1, scale: float | None = None, steps: float | None = None, tamper: str = ""):
        super().__init__()
        keep_args(self, site=site, from_round=from_round, scale=scale, steps=steps, tamper=tamper)
        if tamper not in TAMPERS:
            raise ValueError(f"PoisonFilter: 'tamper' must be one of {TAMPERS}, got {tamper!r}")
        self.counter = TaskCounter()

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        task, rnd = self.counter.next(fl_ctx)
        if fl_ctx.get_identity_name() != self.site or rnd < self.from_round:
            return shareable
        if shareable.get_return_code(ReturnCode.OK) != ReturnCode.OK:
            return shareable
        dxo = from_shareable(shareable)
        if self.tamper:
            tamper_structure(dxo, self.tamper)
            what = f"tampered: {self.tamper}"
        else:
            poison(dxo, self.scale)
            what = f"scaled by {self.scale}" if self.scale is not None else "set to NaN"
        if self.steps is not None:
            claim_steps(dxo, self.steps)
            what += f", claims {self.steps:g} steps"
        self.log_warning(fl_ctx, f"test poison: result {rnd} of task '{task}' of {self.site} {what}")
        return dxo.update_shareable(shareable)
