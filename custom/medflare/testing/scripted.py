"""A run whose best round is known, for tests: sites whose validation scores follow a script, and a record of the
models they received.

- :class:`ScriptedScores` (client task result filter): every site reports ``scores[round]`` as the key metric of
  the validation scores its reply carries (the ``initial_metrics`` METRICS part of :func:`medflare.common.egress.site_reply`),
  so the round whose model is the best is the test's choice, not the training's.
- :class:`KeepReceived` (client task data filter): each site saves the weights it received with each task to
  ``<folder>/<site>_<task>_<round>.pt``: the model sent in that round, to compare the best file with, tensor by tensor.

Never used by a job: the folder is the test's own (tests/e2e/test_best_model.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np
import torch
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.filter import Filter
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_common.app_constant import AppConstants

from medflare.common.component import keep_args


def _round(shareable: Shareable) -> int | None:
    rnd = shareable.get_header(AppConstants.CURRENT_ROUND)
    return int(rnd) if rnd is not None else None


class ScriptedScores(Filter):
    """Client result filter: the reply's validation score ``key_metric`` becomes ``scores[str(round)]`` (rounds the
    script does not name keep the real score). Args: key_metric (default "dice"), scores ({round: value})."""

    def __init__(self, scores: Mapping[str, float], key_metric: str = "dice"):
        super().__init__()
        keep_args(self, scores=dict(scores), key_metric=key_metric)

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        value = self.scores.get(str(_round(shareable)))
        dxo = from_shareable(shareable)
        part = dxo.data.get(MetaKey.INITIAL_METRICS) if dxo.data_kind == DataKind.COLLECTION else None
        if value is None or not isinstance(part, DXO):
            return shareable
        part.data[self.key_metric] = float(value)
        self.log_warning(fl_ctx, f"test script: validation {self.key_metric} of round {_round(shareable)} set to {value}")
        return dxo.update_shareable(shareable)


class KeepReceived(Filter):
    """Client task data filter: the received weights (a WEIGHTS DXO) saved as ``<folder>/<site>_<task>_<round>.pt``
    (``{key: tensor}``). Args: folder."""

    def __init__(self, folder: str):
        super().__init__()
        keep_args(self, folder=folder)

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        dxo = from_shareable(shareable)
        if dxo.data_kind == DataKind.WEIGHTS:
            name = f"{fl_ctx.get_identity_name()}_{fl_ctx.get_prop(FLContextKey.TASK_NAME)}_{_round(shareable)}.pt"
            Path(self.folder).mkdir(parents=True, exist_ok=True)
            torch.save({k: torch.as_tensor(np.asarray(v)).clone() for k, v in dxo.data.items()}, Path(self.folder) / name)
        return shareable

