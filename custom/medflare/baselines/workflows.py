"""FLARE's FedAvg and Scaffold workflows, resilient to a refused or failed site but not to all of them.

The server's update guard (:mod:`medflare.common.result_guard`) turns a bad result into an error reply, and a dead
site times out; with ``ignore_result_error=True`` FLARE's workflows leave such a site out of the round and average
the others. Left alone they would also go on when *no* site answered (every site's privacy scope refusing its
weights, say), finishing a job that learned nothing. These subclasses end the job instead when fewer than
``min_responses`` sites answered a round, with an error naming the counts (FLARE's ``control_flow`` turns the
exception into a panic).
"""

from __future__ import annotations

from typing import Any, List

from nvflare.app_common.abstract.fl_model import FLModel
from nvflare.app_common.workflows.fedavg import FedAvg
from nvflare.app_common.workflows.scaffold import Scaffold

from medflare.common.checks import check_int
from medflare.common.component import keep_args


class TooFewResults(RuntimeError):
    """Fewer sites than ``min_responses`` answered a round."""


def _check_answers(name: str, rnd: Any, answered: int, asked: int, min_responses: int) -> None:
    if answered < max(1, min_responses):
        raise TooFewResults(f"{name} round {rnd}: {answered} of {asked} sites answered (the others failed, timed out or "
                            f"were refused by their privacy scope or the server's update guard); min_responses={min_responses}")


class ResilientFedAvg(FedAvg):
    """FLARE's FedAvg with ``ignore_result_error=True`` that ends the job when fewer than ``min_responses`` (default
    1) sites answered a round. Other args: FLARE's FedAvg's."""

    def __init__(self, *args: Any, min_responses: int = 1, **kwargs: Any):
        kwargs["ignore_result_error"] = True
        super().__init__(*args, **kwargs)
        check_int("ResilientFedAvg", "min_responses", min_responses, 1)
        keep_args(self, min_responses=min_responses)

    def _get_aggregated_result(self) -> FLModel:
        _check_answers("FedAvg", self.current_round, self._received_count, self._expected_count, self.min_responses)
        return super()._get_aggregated_result()


class ResilientScaffold(Scaffold):
    """FLARE's Scaffold with ``ignore_result_error=True`` that ends the job when fewer than ``min_responses``
    (default 1) sites answered a round. Other args: FLARE's Scaffold's."""

    def __init__(self, *args: Any, min_responses: int = 1, **kwargs: Any):
        kwargs["ignore_result_error"] = True
        super().__init__(*args, **kwargs)
        check_int("ResilientScaffold", "min_responses", min_responses, 1)
        keep_args(self, min_responses=min_responses)

    def aggregate(self, results: List[FLModel], aggregate_fn=None) -> FLModel:
        _check_answers("SCAFFOLD", self.current_round, len(results), self.num_clients, self.min_responses)
        return super().aggregate(results, aggregate_fn=aggregate_fn)
