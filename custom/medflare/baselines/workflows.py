"""FLARE's FedAvg and Scaffold workflows, resilient to a refused or failed site but not to all of them.

The server's update guard (:mod:`medflare.common.result_guard`) turns a bad result into an error reply, and a dead
site times out; with ``ignore_result_error=True`` FLARE's workflows leave such a site out of the round and average
the others. Left alone they would also go on when *no* site answered (every site's privacy scope refusing its
weights, say), finishing a job that learned nothing. These subclasses end the job instead when fewer than
``min_responses`` sites answered a round, with a PayloadError naming the counts (FLARE's ``control_flow`` turns the
exception into a panic), as :class:`medflare.common.workflow.SiteRounds` does for medflare's own workflows.
"""

from __future__ import annotations

from typing import Any, List

from nvflare.app_common.abstract.fl_model import FLModel
from nvflare.app_common.workflows.fedavg import FedAvg
from nvflare.app_common.workflows.scaffold import Scaffold

from medflare import PayloadError
from medflare.common.checks import check_int
from medflare.common.component import keep_args


class _Resilient:
    """Mixin over a FLARE workflow: ``ignore_result_error=True`` and ``min_responses`` (default 1) per round."""

    def __init__(self, *args: Any, min_responses: int = 1, **kwargs: Any):
        kwargs["ignore_result_error"] = True
        super().__init__(*args, **kwargs)
        check_int(type(self).__name__, "min_responses", min_responses, 1)
        check_int(type(self).__name__, "num_rounds", self.num_rounds, 1)  # FLARE's FedAvg ran 0 rounds and ended rc 0 with no model
        keep_args(self, min_responses=min_responses)

    def check_answers(self, answered: int, asked: int) -> None:
        """PayloadError when fewer than ``min_responses`` of the ``asked`` sites answered this round."""
        if answered < self.min_responses:
            raise PayloadError(f"{type(self).__name__} round {self.current_round}: {answered} of {asked} sites answered (the "
                               "others failed, timed out or were refused by their privacy scope or the server's update "
                               f"guard); min_responses={self.min_responses}")


class ResilientFedAvg(_Resilient, FedAvg):
    """FLARE's FedAvg with ``ignore_result_error=True`` that ends the job when fewer than ``min_responses`` (default
    1) sites answered a round. Other args: FLARE's FedAvg's."""

    def _get_aggregated_result(self) -> FLModel:
        self.check_answers(self._received_count, self._expected_count)
        return super()._get_aggregated_result()


class ResilientScaffold(_Resilient, Scaffold):
    """FLARE's Scaffold with ``ignore_result_error=True`` that ends the job when fewer than ``min_responses``
    (default 1) sites answered a round. Other args: FLARE's Scaffold's."""

    def aggregate(self, results: List[FLModel], aggregate_fn=None) -> FLModel:
        self.check_answers(len(results), self.num_clients)
        return super().aggregate(results, aggregate_fn=aggregate_fn)
