"""SiteRounds.offer_best: the one place a medflare workflow that judges its own models tells FLARE's persistor
which model is the best so far (FedVCK, FedIOD and FedST use it); FedST's final model competes too (issue 32)."""

import math

from nvflare.apis.fl_constant import FLMetaKey
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


def test_fedst_the_final_model_competes_for_the_best_file():
    """Issue 32: FedST scored its final model after the last round but never offered it, so the best file could
    never be the final model. Scripted scores: round 1's model 0.5, the final model 0.7 (then, in a second run, 0.4)."""
    import numpy as np

    from medflare.fedst import protocol as P
    from medflare.fedst.controller import FedSTSeparateController
    from medflare.fedst.persistor import META_ROUND

    def run(final_dice):
        ctrl = FedSTSeparateController(num_rounds=2, preset="fedst_tiny")
        ctrl.fl_ctx = FLContext()
        ctrl.site_names, ctrl.classes, ctrl.image_size, ctrl.versions, ctrl.metrics = ["a", "b"], {}, None, {}, {}
        ctrl.parts = {P.SEG: {"w": np.zeros(3, np.float32)}}
        fired, saved = [], []
        ctrl.event = lambda event_type: fired.append((event_type, ctrl.fl_ctx.get_prop(AppConstants.GLOBAL_MODEL)))
        ctrl.save_model, ctrl._write_ledger = saved.append, lambda: None

        def scores(dice):
            return {s: FLModel(params={}, metrics={"dice": dice}, meta={FLMetaKey.NUM_STEPS_CURRENT_ROUND: 1}) for s in ctrl.site_names}

        ctrl._scored(scores(0.5), ctrl._model(rnd=1), 1)  # round 1: the model the sites scored is published as best
        ctrl.parts[P.SEG] = {"w": np.ones(3, np.float32)}  # training moves on: the final model differs
        ctrl._send = lambda task, payloads, rnd, part: scores(final_dice)
        ctrl._finish(2)
        best = [model for event, model in fired if event == AppEventType.GLOBAL_BEST_MODEL_AVAILABLE]
        return best, saved

    best, saved = run(0.7)
    assert len(best) == 2 and best[-1]["meta"][META_ROUND] == 2 and float(best[-1]["weights"]["seg.w"].sum()) == 3.0
    assert saved[-1].meta[META_ROUND] == 2
    best, _ = run(0.4)
    assert len(best) == 1 and best[0]["meta"][META_ROUND] == 1 and float(best[0]["weights"]["seg.w"].sum()) == 0.0
