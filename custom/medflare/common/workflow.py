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
- every result passes FLARE's ``BEFORE/AFTER_CONTRIBUTION_ACCEPT`` events (BaseModelController does it);
- each round ends with one summary line and a point on the federation curve (:meth:`SiteRounds.report_round`, the same
  as the baselines' FLARE workflows: :mod:`medflare.common.summary`).

What FedAvg does not do and hospitals need: each site may get its own payload (FedSM's personalised
model, FedIOD's per-site gradients), a site that does not answer within ``task_timeout`` counts as
missing instead of hanging the job, fewer than ``min_responses`` answers end the job with a message
naming the missing sites, and a reply that a site's privacy filters refused is reported as such
(:class:`medflare.PrivacyError`), not as a crash. A result that the server's update guard
(:class:`medflare.common.result_guard.UpdateGuard`: NaN/Inf, a structure unlike the model sent, or an outsized
update) refused counts as a missing site: the round goes on with the others when ``min_responses`` allows, and the
log names the site. So does a site that answers with an error (it could not start or do its task): the line that
ends a job for want of sites names each missing site with its cause (:mod:`medflare.common.site_errors`).

The count a site reports with its result (``NUM_STEPS_CURRENT_ROUND``, what the workflows weigh its update and
metrics by) is bounded once per exchange by :class:`medflare.common.site_weights.SiteWeights` (one per task) and
rewritten in the result's meta, so every workflow built on this class weighs by what the server stands behind;
a report that is no count refuses that site's result. A model that holds NaN/Inf is never saved (:meth:`save_model`).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Mapping

from nvflare.apis.dxo import DXO
from nvflare.apis.fl_constant import FLContextKey, FLMetaKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_common.abstract.fl_model import FLModel
from nvflare.app_common.abstract.model import make_model_learnable
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType
from nvflare.app_common.workflows.model_controller import ModelController

from medflare import ConfigError, PayloadError, PrivacyError
from medflare.checks import check_int
from medflare.common.component import keep_args
from medflare.common.compute import apply_threads, compute_share
from medflare.common.aggregation import check_finite_params
from medflare.common.payload import payload_bytes
from medflare.common.result_guard import UPDATE_REFUSED
from medflare.common.site_config import read_site_config
from medflare.common.site_errors import MissingSites
from medflare.common.site_weights import SiteWeights
from medflare.common.summary import RoundSummary


def filter_history(params: Any) -> dict[str, list[str]]:
    """``{part: [filter names]}`` of the parts of a COLLECTION result (FLARE records a filter on the part it changed)."""
    if not isinstance(params, Mapping):
        return {}
    return {name: dxo.get_filter_history() for name, dxo in params.items() if isinstance(dxo, DXO) and dxo.get_filter_history()}


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
        self._guarded: set[str] = set()  # sites whose result the server's update guard refused in this exchange
        self._missing = MissingSites()  # why each site's result was an error in this exchange
        self._count_bounds: dict[str, SiteWeights] = {}  # the bound on the counts the sites report, per task
        self._expected: set[str] = set()
        self._all_in = threading.Event()
        self.best_value = float("-inf")  # the best value given to offer_best so far
        self.summary = RoundSummary(self)  # the round's line and federation curve (report_round)

    def start_controller(self, fl_ctx: FLContext) -> None:
        """FLARE's set-up, then the server process's share of its machine (torch threads for the workflow's own
        compute; the server's ``local/medflare_site.json`` "compute" section may set it, see
        :mod:`medflare.common.compute`)."""
        super().start_controller(fl_ctx)
        workspace = fl_ctx.get_engine().get_workspace()
        try:
            config = read_site_config(workspace.get_site_config_dir() if workspace is not None else None, "server")
            share = compute_share(config, site="server", fl_args=fl_ctx.get_prop(FLContextKey.ARGS), role="server")
        except ConfigError as e:  # the message names the file and the key
            self.error(str(e))
            self.system_panic(f"cannot start: {e}", fl_ctx)
            return
        self.info(f"server compute: {share.describe(apply_threads(share))}")

    # ---- FLARE's standard round bookkeeping ------------------------------------------------------
    def sites(self) -> list[str]:
        """Names of the sites in this job, sorted (their index in this list is stable for the run)."""
        return sorted(c.name for c in self.engine.get_clients())

    def start_round(self, rnd: int, total: int, validated: FLModel | None = None) -> None:
        """Set CURRENT_ROUND / NUM_ROUNDS, publish ``validated`` (the model this round's site metrics describe)
        as GLOBAL_MODEL, and fire ROUND_STARTED."""
        self.current_round = rnd
        self.summary.start()
        self.fl_ctx.set_prop(AppConstants.CURRENT_ROUND, rnd, private=True, sticky=False)
        self.fl_ctx.set_prop(AppConstants.NUM_ROUNDS, total, private=True, sticky=False)
        if validated is not None:
            self.publish(validated)
        self.event(AppEventType.ROUND_STARTED)

    def publish(self, validated: FLModel) -> None:
        """Set ``validated`` as GLOBAL_MODEL (what a persistor saves as the best model); call again to update its meta
        (e.g. with the round's scores once they arrived)."""
        learnable = make_model_learnable(weights=validated.params, meta_props=dict(validated.meta or {}))
        self.fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, learnable, private=True, sticky=True)

    def report_round(self, rnd: int, total: int, key: str, per_site: Mapping[str, Mapping[str, Any]],
                     also: tuple[str, ...] = ()) -> float:
        """The round's summary line (mean over sites of ``key``, each site once; means of ``also`` in brackets; seconds
        since :meth:`start_round`) and its point on the federation curve in the server's TensorBoard
        (:class:`medflare.common.summary.RoundSummary`). ``per_site``: ``{site: {metric: value}}``. Returns the mean."""
        return self.summary.report(self.fl_ctx, rnd, total, key, per_site, also)

    def offer_best(self, value: float, model: FLModel | None = None) -> bool:
        """For a workflow that judges its models itself: when ``value`` beats every value offered before (NaN never
        does), publish ``model`` (if given) and fire GLOBAL_BEST_MODEL_AVAILABLE with VALIDATION_RESULT = ``value``, as
        FLARE's IntimeModelSelector does, so the persistor saves the best model. Returns whether it was the best."""
        if not value > self.best_value:
            return False
        self.best_value = float(value)
        if model is not None:
            self.publish(model)
        self.fl_ctx.set_prop(AppConstants.VALIDATION_RESULT, self.best_value, private=True, sticky=False)
        self.event(AppEventType.GLOBAL_BEST_MODEL_AVAILABLE)
        return True

    def aggregate(self, results: Mapping[str, FLModel], combine: Callable[[Mapping[str, FLModel]], Any]) -> Any:
        """``combine(results)`` between BEFORE_AGGREGATION and AFTER_AGGREGATION (with AGGREGATION_RESULT)."""
        self.event(AppEventType.BEFORE_AGGREGATION)
        out = combine(results)
        self.fire_event_with_data(AppEventType.AFTER_AGGREGATION, self.fl_ctx, AppConstants.AGGREGATION_RESULT, out)
        return out

    # ---- one exchange with the sites -------------------------------------------------------------
    def _build_shareable(self, data: FLModel = None) -> Shareable:
        """An FLModel whose ``params`` is a DXO is sent as that DXO (its own data kind, e.g. generated images or
        gradients, not FLARE's WEIGHTS); any other FLModel as FLARE sends it."""
        if not isinstance(data.params, DXO):
            return super()._build_shareable(data)
        dxo = DXO(data.params.data_kind, data=data.params.data, meta={**data.params.meta, **(data.meta or {})})
        shareable = dxo.to_shareable()
        for header, value in ((AppConstants.CURRENT_ROUND, data.current_round), (AppConstants.NUM_ROUNDS, data.total_rounds)):
            if value is not None:
                shareable.set_header(header, value)
        shareable.add_cookie(AppConstants.CONTRIBUTION_ROUND, data.current_round)
        return shareable

    def _accept_train_result(self, client_name: str, result: Shareable, fl_ctx: FLContext) -> bool:
        rc = result.get_return_code()
        self._missing.note(client_name, result)
        if rc == ReturnCode.TASK_RESULT_FILTER_ERROR:
            self._refused[client_name] = rc
        elif rc == UPDATE_REFUSED:
            self._guarded.add(client_name)
        return super()._accept_train_result(client_name, result, fl_ctx)

    def _collect(self, result: FLModel) -> bool:
        self._results[result.meta["client_name"]] = result
        if self._expected <= set(self._results):
            self._all_in.set()  # the last answer wakes exchange() now, not at its next check of the standing tasks
        return True

    def exchange(self, task: str, payloads: Mapping[str, FLModel], rnd: int, min_responses: int | None = None,
                 reply_holds: str = "") -> dict[str, FLModel]:
        """Send each site its own task data (all at once), wait for the standing tasks, return results by site.

        A payload is an FLModel (FLARE's conversion: WEIGHTS / WEIGHT_DIFF / METRICS DXO) or an FLModel whose
        ``params`` is a DXO, sent with that DXO's own data kind.

        Returns {} when the job is aborted. Raises PrivacyError when a site's result filters refused its reply
        (e.g. a scope's DXOBlocker; the message names the job's scope and, from ``reply_holds``, what the reply
        holds), PayloadError when fewer than ``min_responses`` (default: the workflow's, 0 = all) sites
        answered. Logs the bytes each way per site and the filters each result (or each part of a COLLECTION) passed.
        """
        self._results, self._refused, self._guarded = {}, {}, set()
        self._missing.reset()
        self._expected, self._all_in = set(payloads), threading.Event()
        sent = {}
        for site, model in payloads.items():
            sent[site] = payload_bytes(model.params)
            self.send_model(task, data=model, targets=[site], timeout=self.task_timeout, callback=self._collect)
        start = time.perf_counter()
        while self.get_num_standing_tasks() and not self._all_in.is_set():
            if self.abort_signal.triggered:
                return {}
            self._all_in.wait(self._task_check_period)
        results = dict(self._results)
        if self._refused:
            meta = self.fl_ctx.get_prop(FLContextKey.JOB_META) or {}
            scope = f"privacy scope '{meta['scope']}' (the job's meta.json)" if meta.get("scope") else "default privacy scope"
            raise PrivacyError(
                f"round {rnd} task '{task}': the {scope} of {sorted(self._refused)} refused to send the reply"
                + (f", which holds {reply_holds}" if reply_holds else "")
                + f" ({ReturnCode.TASK_RESULT_FILTER_ERROR}); the scope blocks a payload this workflow needs "
                "(the site's log names the blocked DXO kind)"
            )
        self._bound_counts(task, results)
        need = min_responses if min_responses is not None else (self.min_responses or len(payloads))
        guarded = f"; the server's update guard refused {sorted(self._guarded)}" if self._guarded else ""
        if len(results) < need:
            missing = sorted(set(payloads) - set(results))
            raise PayloadError(f"round {rnd} task '{task}': {len(results)} of {len(payloads)} sites answered, min_responses={need}; "
                               f"missing: {self._missing.describe(missing)}")
        absent = sorted(set(payloads) - set(results) - self._guarded)  # dead, timed out or failed at the site
        if guarded or absent:
            self.warning(f"round {rnd} task '{task}': going on with {sorted(results)}{guarded}"
                         + (f"; no result from {absent}" if absent else ""))
        for site, res in results.items():
            filters = res.meta.get(FLMetaKey.FILTER_HISTORY) or filter_history(res.params)
            self.info(f"round {rnd} {task}: {site} sent {sent[site]} B, received {payload_bytes(res.params)} B"
                      + (f", result filters {filters}" if filters else ""))
        self.info(f"round {rnd} {task}: {len(results)} sites in {time.perf_counter() - start:.1f} s; {sum(sent.values())} B out")
        return results

    def _bound_counts(self, task: str, results: dict[str, FLModel]) -> None:
        """In place: each result's reported count (meta ``NUM_STEPS_CURRENT_ROUND``, where present) replaced by the weight
        :class:`SiteWeights` allows (clips logged as warnings naming the site); a result whose report is no count is
        dropped (logged as an error, counted as missing)."""
        bound = self._count_bounds.setdefault(task, SiteWeights(what=f"task '{task}'"))
        reports = {s: r.meta[FLMetaKey.NUM_STEPS_CURRENT_ROUND] for s, r in results.items()
                   if FLMetaKey.NUM_STEPS_CURRENT_ROUND in (r.meta or {})}
        decided = bound.bound(reports)
        for site, why in decided.clipped.items():
            self.warning(f"site '{site}' {why}")
        for site, why in decided.refused.items():
            self.error(f"site '{site}' {why}: its result is left out of this round")
            self._missing.causes[site] = f"refused by the server: {why}"
            del results[site]
        for site, weight in decided.weights.items():
            results[site].meta[FLMetaKey.NUM_STEPS_CURRENT_ROUND] = weight

    def save_model(self, model: FLModel) -> None:
        """The persistor's save, refused (PayloadError naming the keys; the job ends, the last saved model stays) when a
        float entry of ``model`` is NaN/Inf: a non-finite model must never be saved or sent on."""
        if isinstance(model, FLModel) and isinstance(model.params, Mapping):
            check_finite_params({k: v for k, v in model.params.items() if not isinstance(v, DXO)},
                                f"round {self.current_round}: the model to save")
        super().save_model(model)
