"""SiteRounds.offer_best: the one place a medflare workflow that judges its own models tells FLARE's persistor
which model is the best so far (FedVCK, FedIOD and FedST use it)."""

import math

from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType

from medflare.common.workflow import SiteRounds


class _Judging(SiteRounds):
    def run(self):  # the rounds do not matter here
        pass


def _workflow():
    wf = _Judging(num_rounds=1)
    wf.fl_ctx = FLContext()
    fired = []
    wf.event = lambda event_type: fired.append((event_type, wf.fl_ctx.get_prop(AppConstants.VALIDATION_RESULT),
                                                wf.fl_ctx.get_prop(AppConstants.GLOBAL_MODEL)))
    return wf, fired


def test_only_a_strictly_better_value_publishes_and_fires_the_best_model_event():
    wf, fired = _workflow()
    model = FLModel(params_type=ParamsType.FULL, params={"w": [1.0]}, meta={"round": 0})
    assert wf.offer_best(0.5, model)
    event, value, published = fired[-1]
    assert event == AppEventType.GLOBAL_BEST_MODEL_AVAILABLE and value == 0.5 and published is not None
    for worse in (0.5, 0.4, math.nan, -math.inf):
        assert not wf.offer_best(worse)
    assert len(fired) == 1 and wf.best_value == 0.5
    assert wf.offer_best(0.75) and fired[-1][1] == 0.75 and len(fired) == 2
