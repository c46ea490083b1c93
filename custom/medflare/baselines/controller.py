"""FLARE's FedAvg and Scaffold workflows, resilient to a refused, failed, lying or silent site but not to all of them.

The server's update guard (:mod:`medflare.common.result_guard`) turns a bad result into an error reply, a site that
cannot work answers with one (:mod:`medflare.common.site_errors`), and a dead site times out after
``task_timeout``; with ``ignore_result_error=True`` FLARE's workflows leave such a site out of the round and average
the others. Left alone they would also go on when *no* site answered (every site's privacy scope refusing its
weights, say), finishing a job that learned nothing, and wait forever for a site that never answers (FLARE's FedAvg
has no task timeout). These subclasses end the job instead when fewer than ``min_responses`` sites answered a round,
with one PayloadError line naming each missing site and its cause (FLARE's ``control_flow`` turns the exception
into a panic), as :class:`medflare.common.workflow.SiteRounds` does for medflare's own workflows.

They also weigh by what the server stands behind (issue 28): each site's reported ``NUM_STEPS_CURRENT_ROUND`` is
bounded by :class:`medflare.common.site_weights.SiteWeights` (clips logged naming the site; a report that is no count
refuses the result) before FLARE's own aggregation helpers see it, the sums run in float64
(:func:`medflare.common.aggregation.as_float64`) and the aggregate, SCAFFOLD's control diff and the updated model are
checked finite before anything is saved or sent (:func:`~medflare.common.aggregation.cast_back`). FedAvg's in-time
aggregation therefore keeps a round's results until the round ends (the bound needs every report of the round),
as FLARE's Scaffold always does.

And they let the best-model selector judge the final model (issue 32). A site scores the global model it receives
before it trains, so FLARE's ``IntimeModelSelector``, which decides at round r's BEFORE_AGGREGATION, judges the
model sent in round r (the aggregate of round r-1) and the persistor saves exactly that one (``GLOBAL_MODEL`` is
still it then: measured, jobs/fedavg/README.md); but the aggregate of the last round is never sent, so never scored,
and ``best_FL_global_model.pt`` could never be ``FL_global_model.pt``. After the last round these workflows run one
more round that trains nothing (:meth:`_Resilient.validate_final`, task ``validate_task``): every site scores the
final model, and the selector judges it like the others.
"""

from __future__ import annotations

import threading
from typing import Any, List

from nvflare.apis.fl_constant import FLMetaKey
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.abstract.model import ModelLearnableKey
from nvflare.app_common.app_constant import AlgorithmConstants, AppConstants
from nvflare.app_common.app_event_type import AppEventType
from nvflare.app_common.workflows.fedavg import FedAvg
from nvflare.app_common.workflows.scaffold import Scaffold

from medflare import PayloadError
from medflare.baselines.protocol import TASK_VALIDATE
from medflare.common.aggregation import as_float64, cast_back, check_finite_params
from medflare.checks import check_int
from medflare.common.component import keep_args
from medflare.common.site_errors import MissingSites
from medflare.common.site_weights import SiteWeights
from medflare.common.summary import RoundSummary

CTRL_DIFF = AlgorithmConstants.SCAFFOLD_CTRL_DIFF


def _site(result: FLModel) -> str:
    return str((result.meta or {}).get("client_name", "?"))


def _dtypes_of(results: List[FLModel], key: str | None = None) -> dict:
    """The arrays of every result's params (or meta[``key``]) by name: the dtypes to cast an aggregate back to."""
    out: dict = {}
    for r in results:
        arrays = (r.meta or {}).get(key) if key else r.params
        out.update(arrays or {})
    return out


class _Resilient:
    """Mixin over a FLARE workflow: ``ignore_result_error=True``, ``min_responses`` (default 1) and ``task_timeout`` per
    round, bounded weights, float64 aggregation and finite checks (see the module docstring), one summary line per
    round with the federation curve of ``key_metric`` (:mod:`medflare.common.summary`; "" = none), and a last round in
    which the sites score the final model for the best-model selector (``validate_task``, default "validate"; "" =
    none, FLARE's behaviour: the best file is then never the final model)."""

    def __init__(self, *args: Any, min_responses: int = 1, task_timeout: int = 3600, key_metric: str = "",
                 validate_task: str = TASK_VALIDATE, **kwargs: Any):
        kwargs["ignore_result_error"] = True
        super().__init__(*args, **kwargs)
        name = type(self).__name__
        check_int(name, "min_responses", min_responses, 1)
        check_int(name, "task_timeout", task_timeout, 0)
        check_int(name, "num_rounds", self.num_rounds, 1)  # FLARE's FedAvg ran 0 rounds and ended rc 0 with no model
        keep_args(self, min_responses=min_responses, task_timeout=task_timeout, key_metric=key_metric,
                  validate_task=validate_task)
        self._missing = MissingSites()
        self._asked: list[str] = []
        self._bound = SiteWeights(what=f"{name} 'train'")
        self._summary = RoundSummary(self)
        self._scores: dict[str, dict] = {}  # the round's validation scores by site (of the model the sites received)
        self._said_all = False

    # ---- who was asked, who answered, why not ----------------------------------------------------
    def sample_clients(self, num_clients: int = None) -> List[str]:
        """FLARE's sampling (once per round); also starts the round's record of missing sites and its clock. Asking for
        more sites than the run has (the job's 4 in a 2-site simulation) asks all of them, said once (FLARE logs an
        error every round)."""
        self._summary.start()
        available = len(self.engine.get_clients())
        if num_clients and num_clients > available:
            if not self._said_all:
                self.info(f"num_clients {num_clients} but {available} sites in this run: every round asks all {available}")
                self._said_all = True
            num_clients = available
        clients = super().sample_clients(num_clients)
        self._asked = [c if isinstance(c, str) else getattr(c, "name", str(c)) for c in clients]
        self._missing.reset()
        self._scores = {}
        return clients

    def broadcast_model(self, *args: Any, timeout: int = 0, **kwargs: Any):
        """FLARE's broadcast with the workflow's ``task_timeout`` when the caller gives none (FedAvg never does)."""
        return super().broadcast_model(*args, timeout=timeout or self.task_timeout, **kwargs)

    def _accept_train_result(self, client_name: str, result, fl_ctx, is_unknown_task: bool = False) -> bool:
        self._missing.note(client_name, result)
        return super()._accept_train_result(client_name, result, fl_ctx, is_unknown_task=is_unknown_task)

    def check_answers(self, answered: List[str]) -> None:
        """PayloadError (one line naming each missing site and its cause) when fewer than ``min_responses`` answered."""
        if len(answered) < self.min_responses:
            missing = sorted(set(self._asked) - set(answered))
            raise PayloadError(f"{type(self).__name__} round {self.current_round}: {len(answered)} of {len(self._asked)} sites "
                               f"answered, min_responses={self.min_responses}; missing: {self._missing.describe(missing)}")

    # ---- the final model judged like the others -------------------------------------------------------
    def run(self) -> None:
        super().run()
        if self.validate_task and not self.abort_signal.triggered:
            self.validate_final()

    def validate_final(self) -> None:
        """One more round that trains nothing: the sites score the final global model (task ``validate_task``) and
        BEFORE_AGGREGATION lets FLARE's IntimeModelSelector judge it, with ``GLOBAL_MODEL`` (what the persistor saves
        as the best model) the model scored, as in every training round."""
        learnable = self.fl_ctx.get_prop(AppConstants.GLOBAL_MODEL)
        if not learnable or not learnable.get(ModelLearnableKey.WEIGHTS):
            return
        rnd = self.start_round + self.num_rounds
        self.current_round = rnd
        self.fl_ctx.set_prop(AppConstants.CURRENT_ROUND, rnd, private=True, sticky=False)
        self.event(AppEventType.ROUND_STARTED)
        final = FLModel(params_type=ParamsType.FULL, params=learnable[ModelLearnableKey.WEIGHTS], current_round=rnd,
                        total_rounds=rnd + 1, start_round=self.start_round)
        results = self.send_model_and_wait(task_name=self.validate_task, data=final,
                                           targets=self.sample_clients(self.num_clients), timeout=self.task_timeout)
        answered = sorted(_site(r) for r in results)
        self.info(f"round {rnd} (validation only): the final model scored by {answered}")
        if len(answered) < self.min_responses:
            missing = sorted(set(self._asked) - set(answered))
            self.warning(f"round {rnd}: {len(answered)} of {len(self._asked)} sites scored the final model; missing: "
                         f"{self._missing.describe(missing)}; the best model is judged on those that answered")
        self.event(AppEventType.BEFORE_AGGREGATION)

    # ---- weights the server stands behind, sums that cannot overflow ---------------------------------
    def bounded(self, results: List[FLModel]) -> List[FLModel]:
        """``results`` with each reported count replaced by its bounded weight and float arrays (params, SCAFFOLD's
        control diff) as float64 copies; a result whose report is no count is left out (logged, counted missing)."""
        decided = self._bound.bound({_site(r): (r.meta or {}).get(FLMetaKey.NUM_STEPS_CURRENT_ROUND) for r in results})
        for site, why in decided.clipped.items():
            self.warning(f"site '{site}' {why}")
        for site, why in decided.refused.items():
            self.error(f"site '{site}' {why}: its result is left out of round {self.current_round}")
            self._missing.causes[site] = f"refused by the server: {why}"
        out = []
        for r in results:
            if isinstance(r.metrics, dict):
                self._scores[_site(r)] = r.metrics
            if _site(r) not in decided.weights:
                continue
            meta = {**(r.meta or {}), FLMetaKey.NUM_STEPS_CURRENT_ROUND: decided.weights[_site(r)]}
            if isinstance(meta.get(CTRL_DIFF), dict):
                meta[CTRL_DIFF] = as_float64(meta[CTRL_DIFF])
            out.append(FLModel(params_type=r.params_type, params=as_float64(r.params or {}), metrics=r.metrics, meta=meta,
                               current_round=r.current_round, total_rounds=r.total_rounds, start_round=r.start_round))
        return out

    def cast_aggregate(self, aggregate: FLModel, results: List[FLModel]) -> FLModel:
        """``aggregate`` (float64 sums) checked finite and cast back to the results' dtypes; PayloadError otherwise."""
        what = f"{type(self).__name__} round {self.current_round}: the aggregate"
        aggregate.params = cast_back(aggregate.params or {}, _dtypes_of(results), what)
        if isinstance((aggregate.meta or {}).get(CTRL_DIFF), dict):
            aggregate.meta[CTRL_DIFF] = cast_back(aggregate.meta[CTRL_DIFF], _dtypes_of(results, CTRL_DIFF), f"{what} control diff")
        return aggregate

    def update_model(self, model, aggr_result):
        """FLARE's update, then the model checked finite before it is saved or sent (PayloadError naming the keys)."""
        model = super().update_model(model, aggr_result)
        check_finite_params(model.params or {}, f"{type(self).__name__} round {self.current_round}: the updated global model")
        if self.key_metric:  # the sites' scores of the global model they received this round, and the round's time
            self._summary.report(self.fl_ctx, self.current_round, self.start_round + self.num_rounds, self.key_metric,
                                 self._scores)
        return model


class ResilientFedAvg(_Resilient, FedAvg):
    """FLARE's FedAvg with ``ignore_result_error=True``, ``task_timeout`` (default 3600 s, 0 = wait forever) and
    bounded, float64 aggregation, that ends the job when fewer than ``min_responses`` (default 1) sites answered a
    round, and logs each round's mean ``key_metric`` over sites (default "": no line). Other args: FLARE's FedAvg's."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._round_results: list[FLModel] = []
        self._round_lock = threading.Lock()

    def sample_clients(self, num_clients: int = None) -> List[str]:
        with self._round_lock:
            self._round_results = []
        return super().sample_clients(num_clients)

    def _aggregate_one_result(self, result: FLModel) -> bool:
        """Keep the result for the end of the round (FLARE's callback; an empty one is FLARE's to skip)."""
        if not result.params:
            return super()._aggregate_one_result(result)
        with self._round_lock:
            self._round_results.append(result)
        return True

    def _get_aggregated_result(self) -> FLModel:
        with self._round_lock:
            results, self._round_results = self._round_results, []
        kept = self.bounded(results)
        for result in kept:
            super()._aggregate_one_result(result)  # FLARE's in-time helper, now with bounded weights and float64 arrays
        self.check_answers([_site(r) for r in kept])
        return self.cast_aggregate(super()._get_aggregated_result(), results)


class ResilientScaffold(_Resilient, Scaffold):
    """FLARE's Scaffold with ``ignore_result_error=True``, ``task_timeout`` (default 3600 s, 0 = wait forever) and
    bounded, float64 aggregation, that ends the job when fewer than ``min_responses`` (default 1) sites answered a
    round, and logs each round's mean ``key_metric`` over sites (default "": no line). Other args: FLARE's Scaffold's."""

    def aggregate(self, results: List[FLModel], aggregate_fn=None) -> FLModel:
        kept = self.bounded(results)
        self.check_answers([_site(r) for r in kept])
        return self.cast_aggregate(super().aggregate(kept, aggregate_fn=aggregate_fn), results)
