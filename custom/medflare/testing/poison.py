"""A broken or hostile site for tests: a client result filter that turns one site's weight updates into NaN or scales them.

Put it in the client config's ``task_result_filters`` (``customize_job(task_result_filters=[{"tasks": ["train"],
"filters": [{"path": "medflare.testing.poison.PoisonFilter", "args": {"site": "site-2", "from_round": 1}}]}])``):
every site runs it, only ``site`` is changed. It is how the issue measured that one NaN site ends a FedAvg job, and
how the tests show that the server's update guard (:mod:`medflare.common.result_guard`) stops it. Never used by a job.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.filter import Filter
from nvflare.apis.fl_constant import FLContextKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable

from medflare.common.component import keep_args

WEIGHT_KINDS = (DataKind.WEIGHTS, DataKind.WEIGHT_DIFF)


def poison(dxo: DXO, scale: float | None) -> None:
    """In place: every float array of the WEIGHTS / WEIGHT_DIFF parts of ``dxo`` (COLLECTION parts too) set to NaN,
    or multiplied by ``scale`` when given."""
    if dxo.data_kind == DataKind.COLLECTION:
        for part in dxo.data.values():
            if isinstance(part, DXO):
                poison(part, scale)
        return
    if dxo.data_kind not in WEIGHT_KINDS:
        return
    for key, value in dxo.data.items():
        arr = np.asarray(value)
        if np.issubdtype(arr.dtype, np.floating):
            dxo.data[key] = arr * scale if scale is not None else np.full_like(arr, np.nan)


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
    updates become NaN, or are multiplied by ``scale`` when it is given. Args: site, from_round (default 1), scale
    (default None = NaN)."""

    def __init__(self, site: str, from_round: int = 1, scale: float | None = None):
        super().__init__()
        keep_args(self, site=site, from_round=from_round, scale=scale)
        self.counter = TaskCounter()

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        task, rnd = self.counter.next(fl_ctx)
        if fl_ctx.get_identity_name() != self.site or rnd < self.from_round:
            return shareable
        if shareable.get_return_code(ReturnCode.OK) != ReturnCode.OK:
            return shareable
        dxo = from_shareable(shareable)
        poison(dxo, self.scale)
        self.log_warning(fl_ctx, f"test poison: result {rnd} of task '{task}' of {self.site} "
                                 + (f"scaled by {self.scale}" if self.scale is not None else "set to NaN"))
        return dxo.update_shareable(shareable)
