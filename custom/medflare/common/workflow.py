"""The server side every medflare workflow shares: rounds in which each site gets its own task data, seen by FLARE.

:class:`SiteRounds` is a FLARE ``ModelController`` that does what FLARE's own ``FedAvg`` does for the
components around it, so FLARE's widgets, filters and persistors see a medflare workflow as they see
FedAvg:

- the persistor is the component named by ``persistor_id`` (``load_model`` / ``save_model``);
- each round sets ``CURRENT_ROUND`` / ``NUM_ROUNDS`` in the FL context and fires ``ROUND_STARTED``;
  the model the round's validation metrics describe is published as ``GLOBAL_MODEL``, so
  ``IntimeModelSelector`` (which fires ``GLOBAL_BEST_MODEL_AVAILABLE`` at ``BEFORE_AGGREGATION``) makes
  the persistor save it as the best model;
- aggregation is bracketed by ``BEFORE_AGGREGATION`` and ``AFTER_AGGREGATION`` (with
  ``AGGREGATION_RESULT``);
- every result passes FLARE's ``BEFORE/AFTER_CONTRIBUTION_ACCEPT`` events (BaseModelController does it).

What FedAvg does not do and hospitals need: each site may get its own payload (FedSM's personalised
model, FedIOD's per-site gradients), a site that does not answer within ``task_timeout`` counts as
missing instead of hanging the job, fewer than ``min_responses`` answers end the job with a message
naming the missing sites, and a reply that a site's privacy filters refused is reported as such
(:class:`medflare.PrivacyError`), not as a crash.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping

from nvflare.apis.fl_constant import FLMetaKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_common.abstract.fl_model import FLModel
from nvflare.app_common.abstract.model import make_model_learnable
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType
from nvflare.app_common.workflows.model_controller import ModelController

from medflare import ConfigError, PayloadError, PrivacyError
from medflare.common.component import keep_args
from medflare.common.payload import payload_bytes


def check_int(owner: str, key: str, value: Any, low: int) -> int:
    """``value`` as an int >= ``low``; ConfigError naming ``owner`` and ``key`` otherwise (bools refused)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{owner}: '{key}' must be an int >= {low}, got {value!r}")
    return value


class SiteRounds(ModelController):
    """Base of medflare's server workflows (see the module docstring).

    Args (subclasses pass them through and document their own):
        num_rounds: rounds of the workflow. Default 10.
        persistor_id: id of the persistor component ("" = none). Default "persistor".
        min_responses: fewest sites whose results make a round; fewer ends the job with an error naming the
            missing sites. 0 = all sites. Default 0.
        task_timeout: seconds a site may take for one task before it counts as not answering; 0 = wait
            forever (a dead site then hangs the job). Default 3600.
        task_check_period: seconds between checks of the standing tasks. Default 0.2.
    """

    def __init__(
        self,
        num_rounds: int = 10,
        persistor_id: str = "persistor",
        min_responses: int = 0,
        task_timeout: int = 3600,
        task_check_period: float = 0.2,
    ):
        # Site errors are judged here (min_responses, privacy refusals), not by FLARE's per-task panic.
        super().__init__(persistor_id=persistor_id, ignore_result_error=True, task_check_period=task_check_period)
        keep_args(self, num_rounds=num_rounds, persistor_id=persistor_id, min_responses=min_responses,
                  task_timeout=task_timeout, task_check_period=task_check_period)
        name = type(self).__name__
        check_int(name, "num_rounds", num_rounds, 1)
        check_int(name, "min_responses", min_responses, 0)
        check_int(name, "task_timeout", task_timeout, 0)
        self._results: dict[str, FLModel] = {}
        self._refused: dict[str, str] = {}

    # ---- FLARE's standard round bookkeeping ------------------------------------------------------
    def sites(self) -> list[str]:
        """Names of the sites in this job, sorted (their index in this list is stable for the run)."""
        return sorted(c.name for c in self.engine.get_clients())

    def start_round(self, rnd: int, total: int, validated: FLModel | None = None) -> None:
        """Set CURRENT_ROUND / NUM_ROUNDS, publish ``validated`` (the model this round's site metrics describe)
        as GLOBAL_MODEL, and fire ROUND_STARTED."""
        self.current_round = rnd
        self.fl_ctx.set_prop(AppConstants.CURRENT_ROUND, rnd, private=True, sticky=False)
        self.fl_ctx.set_prop(AppConstants.NUM_ROUNDS, total, private=True, sticky=False)
        if validated is not None:
            self.publish(validated)
        self.event(AppEventType.ROUND_STARTED)

    def publish(self, model: FLModel) -> None:
        """Set ``model`` as the FL context's GLOBAL_MODEL (what a persistor saves on GLOBAL_BEST_MODEL_AVAILABLE)."""
        learnable = make_model_learnable(weights=model.params, meta_props=model.meta)
        self.fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, learnable, private=True, sticky=True)

    def aggregate(self, results: Mapping[str, FLModel], combine: Callable[[Mapping[str, FLModel]], Any]) -> Any:
        """``combine(results)`` between BEFORE_AGGREGATION and AFTER_AGGREGATION (with AGGREGATION_RESULT)."""
        self.event(AppEventType.BEFORE_AGGREGATION)
        out = combine(results)
        self.fire_event_with_data(AppEventType.AFTER_AGGREGATION, self.fl_ctx, AppConstants.AGGREGATION_RESULT, out)
        return out

    # ---- one exchange with the sites -------------------------------------------------------------
    def _accept_train_result(self, client_name: str, result: Shareable, fl_ctx: FLContext) -> bool:
        rc = result.get_return_code()
        if rc == ReturnCode.TASK_RESULT_FILTER_ERROR:
            self._refused[client_name] = rc
        return super()._accept_train_result(client_name, result, fl_ctx)

    def _collect(self, result: FLModel) -> bool:
        self._results[result.meta["client_name"]] = result
        return True

    def exchange(self, task: str, payloads: Mapping[str, FLModel], rnd: int, min_responses: int | None = None) -> dict[str, FLModel]:
        """Send each site its own task data (all at once), wait for the standing tasks, return results by site.

        Returns {} when the job is aborted. Raises PrivacyError when a site's result filters refused its reply
        (e.g. a scope's DXOBlocker), PayloadError when fewer than ``min_responses`` (default: the workflow's,
        0 = all) sites answered. Logs the bytes each way per site and the filters each result passed.
        """
        self._results, self._refused = {}, {}
        sent = {}
        for site, model in payloads.items():
            sent[site] = payload_bytes(model.params)
            self.send_model(task, data=model, targets=[site], timeout=self.task_timeout, callback=self._collect)
        start = time.perf_counter()
        while self.get_num_standing_tasks():
            if self.abort_signal.triggered:
                return {}
            time.sleep(self._task_check_period)
        results = dict(self._results)
        if self._refused:
            raise PrivacyError(
                f"round {rnd} task '{task}': the result filters of {sorted(self._refused)} refused to send the reply "
                f"({ReturnCode.TASK_RESULT_FILTER_ERROR}); their privacy scope blocks a payload this workflow needs "
                "(see the site's log for the blocked DXO kind)"
            )
        need = min_responses if min_responses is not None else (self.min_responses or len(payloads))
        if len(results) < need:
            missing = sorted(set(payloads) - set(results))
            raise PayloadError(f"round {rnd} task '{task}': {len(results)} of {len(payloads)} sites answered (no result from {missing}); min_responses={need}")
        for site, res in results.items():
            filters = res.meta.get(FLMetaKey.FILTER_HISTORY)
            self.info(f"round {rnd} {task}: {site} sent {sent[site]} B, received {payload_bytes(res.params)} B"
                      + (f", result filters {filters}" if filters else ""))
        self.info(f"round {rnd} {task}: {len(results)} sites in {time.perf_counter() - start:.1f} s; {sum(sent.values())} B out")
        return results
