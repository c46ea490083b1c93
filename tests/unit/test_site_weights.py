"""Aggregation weights are the server's, sums are float64 and checked finite (issue 28): the rule, the math, and the
baseline workflows that use them, against FLARE's own FedAvg / Scaffold aggregation as the control."""

import numpy as np
import pytest
from nvflare.apis.fl_constant import FLMetaKey, ReturnCode
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.aggregators.weighted_aggregation_helper import WeightedAggregationHelper
from nvflare.app_common.app_constant import AlgorithmConstants
from nvflare.app_common.workflows.scaffold import scaffold_aggregate_fn

from medflare import PayloadError
from medflare.baselines.controller import ResilientFedAvg, ResilientScaffold
from medflare.common.aggregation import apply_diff, as_float64, cast_back, weighted_mean
from medflare.common.site_errors import CAUSE_HEADER, error_reply
from medflare.common.site_weights import SiteWeights, reported_count

STEPS = FLMetaKey.NUM_STEPS_CURRENT_ROUND


# ---- the bounding rule -----------------------------------------------------------------------------
def test_a_later_claim_is_clipped_to_the_count_declared_in_the_first_round():
    bound = SiteWeights()
    first = bound.bound({"a": 20, "b": 30, "c": 25})
    assert first.weights == {"a": 20, "b": 30, "c": 25} and not first.clipped and not first.refused
    later = bound.bound({"a": 18, "b": 30, "c": 1e9})
    assert later.weights == {"a": 18, "b": 30, "c": 25}  # fewer steps are taken as they are
    assert list(later.clipped) == ["c"] and "1e+09" in later.clipped["c"] and "declared count 25" in later.clipped["c"]


@pytest.mark.parametrize("claim", [1e9, 1e300, float(np.finfo(np.float64).max)])
def test_a_first_round_claim_is_capped_by_the_median_of_the_other_sites(claim):
    """The liar's own claim never enters its cap: 10 x median(20, 30) = 250, whatever the arrival order."""
    for order in (["c", "a", "b"], ["a", "b", "c"]):
        reports = {"a": 20, "b": 30, "c": claim}
        decided = SiteWeights().bound({s: reports[s] for s in order})
        assert decided.weights == {"a": 20, "b": 30, "c": 250}
        assert list(decided.clipped) == ["c"]


def test_a_lone_site_and_honest_size_differences_are_not_capped():
    assert SiteWeights().bound({"a": 1e6}).weights == {"a": 1e6}
    assert SiteWeights().bound({"a": 10, "b": 90, "c": 30}).weights == {"a": 10, "b": 90, "c": 30}
    assert SiteWeights(max_ratio=2).bound({"a": 10, "b": 90, "c": 30}).weights == {"a": 10, "b": 40, "c": 30}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -5, 0, "12", True, [3], np.float32("nan")])
def test_a_report_that_is_no_count_refuses_the_result(bad):
    decided = SiteWeights(what="FedAvg 'train'").bound({"a": 20, "b": bad})
    assert decided.weights == {"a": 20} and list(decided.refused) == ["b"]
    assert "FedAvg 'train'" in decided.refused["b"] and repr(bad) in decided.refused["b"]


def test_no_report_weighs_one_and_numpy_counts_are_counts():
    assert reported_count(None) == 1.0
    assert reported_count(np.int64(7)) == 7.0 and reported_count(np.float32(2.5)) == 2.5
    with pytest.raises(ValueError, match="max_ratio"):
        SiteWeights(max_ratio=0.5)


# ---- float64 sums, finite results ------------------------------------------------------------------
def test_weighted_mean_sums_in_float64_and_refuses_a_non_finite_result():
    big = np.float32(3e38)
    models = [{"w": np.array([big, 1.0], dtype=np.float32)}, {"w": np.array([big, 3.0], dtype=np.float32)}]
    mean = weighted_mean(models, [1, 1])["w"]  # a float32 sum would overflow to inf
    assert mean.dtype == np.float32 and np.isfinite(mean).all() and mean[1] == 2.0
    with pytest.raises(PayloadError, match=r"apply_diff.*\['w'\]"):
        apply_diff({"w": np.array([big], dtype=np.float32)}, {"w": np.array([big], dtype=np.float32)})
    with pytest.raises(PayloadError, match="positive sum"):
        weighted_mean(models, [1e308, 1e308])  # the weights' sum is not finite


def test_cast_back_refuses_what_does_not_fit_the_models_dtype():
    like = {"w": np.zeros(2, dtype=np.float32), "n": np.zeros((), dtype=np.int64)}
    ok = cast_back(as_float64({"w": np.array([1.0, 2.0]), "n": np.array(3)}), like, "test")
    assert ok["w"].dtype == np.float32 and ok["n"].dtype == np.int64
    with pytest.raises(PayloadError, match=r"test \(cast back.*\['w'\]"):
        cast_back({"w": np.array([1e39, 0.0])}, like, "test")
    with pytest.raises(PayloadError, match=r"test: NaN/Inf in 1 of 1 entries \['w'\]"):
        cast_back({"w": np.array([np.nan, 0.0])}, like, "test")


# ---- FLARE's FedAvg helper: the control, and the baseline workflows -----------------------------------
def result(site, value, steps, rnd=1, ctrl=None):
    meta = {"client_name": site, STEPS: steps}
    if ctrl is not None:
        meta[AlgorithmConstants.SCAFFOLD_CTRL_DIFF] = {"w": np.full(2, ctrl, dtype=np.float32)}
    return FLModel(params_type=ParamsType.DIFF, params={"w": np.full(2, value, dtype=np.float32)}, meta=meta, current_round=rnd)


def flare_fedavg(results):
    """FLARE's in-time FedAvg sum as jobs/fedavg ran it before: weighted by the reported count, in float32."""
    helper = WeightedAggregationHelper()
    for r in results:
        helper.add(data=r.params, weight=float(r.meta[STEPS]), contributor_name=r.meta["client_name"], contribution_round=1)
    return helper.get_result()["w"]


def fedavg(results, asked=("site-1", "site-2", "site-3")):
    """One round of ResilientFedAvg's aggregation as FLARE's FedAvg.run drives it (sample, callbacks, aggregate)."""
    wf = ResilientFedAvg(num_clients=3, num_rounds=1)
    wf._aggr_helper, wf._aggr_metrics_helper, wf._all_metrics = WeightedAggregationHelper(), WeightedAggregationHelper(), True
    wf._received_count, wf._expected_count, wf._site_metric_weights, wf.current_round = 0, len(asked), {}, 1
    wf._asked, wf._round_results = list(asked), []
    for r in results:
        wf._aggregate_one_result(r)
    return wf


HONEST = [result("site-1", 1.0, 20), result("site-2", 1.0, 30)]


def test_flare_fedavg_is_taken_over_by_a_claimed_count_and_overflows_to_nan():
    """The failure the issue measured: a sign-flipped update claiming 1e9 steps moves the mean to -1; 1e300 is NaN."""
    assert flare_fedavg(HONEST + [result("site-3", -1.0, 1e9)])[0] == pytest.approx(-1.0, abs=1e-6)
    assert np.isnan(flare_fedavg(HONEST + [result("site-3", 1.0, 1e300)])).all()


def test_resilient_fedavg_weighs_a_liar_by_its_declared_count():
    wf = fedavg(HONEST + [result("site-3", 1.0, 25, rnd=0)])
    wf._get_aggregated_result()  # round 0: site-3 declares 25 cases
    wf._round_results = []
    for r in HONEST + [result("site-3", -1.0, 1e9)]:
        wf._aggregate_one_result(r)
    mean = wf._get_aggregated_result().params["w"]
    honest_weight = (20 + 30 - 25) / 75  # the same flipped update at its honest weight
    np.testing.assert_allclose(mean, honest_weight, rtol=1e-6)
    assert mean.dtype == np.float32


def test_resilient_fedavg_caps_a_first_round_claim_and_stays_finite_at_1e300():
    mean = fedavg(HONEST + [result("site-3", 1.0, 1e300)])._get_aggregated_result().params["w"]
    assert np.isfinite(mean).all() and mean.dtype == np.float32
    np.testing.assert_allclose(mean, 1.0, rtol=1e-6)


def test_resilient_fedavg_refuses_a_nan_count_and_ends_the_round_naming_every_missing_site():
    wf = fedavg([result("site-3", 1.0, float("nan"))])
    wf._missing.note("site-2", error_reply(ReturnCode.EXECUTION_EXCEPTION, "site 'site-2': no training cases in x.json"))
    with pytest.raises(PayloadError) as info:
        wf._get_aggregated_result()
    text = str(info.value)
    assert "0 of 3 sites answered, min_responses=1" in text and "\n" not in text
    assert "site-1 (no reply: timed out or gone)" in text
    assert "site-2 (EXECUTION_EXCEPTION: site 'site-2': no training cases in x.json)" in text
    assert "site-3 (refused by the server: reported nan as its count" in text


def test_resilient_scaffold_bounds_weights_and_control_diffs():
    wf = ResilientScaffold(num_clients=3, num_rounds=1)
    wf.current_round, wf._asked, wf.fl_ctx = 0, ["site-1", "site-2", "site-3"], None
    wf.event = wf.fire_event_with_data = lambda *a, **k: None  # no FLARE engine here
    wf.aggregate([result("site-1", 1.0, 20, 0, ctrl=1.0), result("site-2", 1.0, 30, 0, ctrl=1.0), result("site-3", 1.0, 25, 0, ctrl=1.0)],
                 aggregate_fn=scaffold_aggregate_fn)  # as Scaffold.run calls it
    out = wf.aggregate([result("site-1", 1.0, 20, 1, ctrl=1.0), result("site-2", 1.0, 30, 1, ctrl=1.0),
                        result("site-3", -1.0, 1e300, 1, ctrl=-1.0)], aggregate_fn=scaffold_aggregate_fn)
    np.testing.assert_allclose(out.params["w"], 25 / 75, rtol=1e-6)
    ctrl = out.meta[AlgorithmConstants.SCAFFOLD_CTRL_DIFF]["w"]
    np.testing.assert_allclose(ctrl, 25 / 75, rtol=1e-6)
    assert out.params["w"].dtype == ctrl.dtype == np.float32


def test_error_reply_carries_one_line_cause():
    reply = error_reply(ReturnCode.EXECUTION_EXCEPTION, "a\nb " + "x" * 1000)
    cause = reply.get_header(CAUSE_HEADER)
    assert "\n" not in cause and len(cause) == 500 and cause.startswith("a b x")


# ---- medflare's own workflows (SiteRounds): the count in each result's meta is rewritten once per exchange ------
@pytest.mark.parametrize("workflow", ["medflare.fedst.controller.FedSTJoinController", "medflare.fedsm.controller.FedSMController"])
def test_site_rounds_bound_the_counts_their_aggregation_reads(workflow):
    """FedST weighs its segmentation FedAvg and metrics by ``_weights`` (the meta count), FedSM by ``parse_reply``'s n;
    both read the rewritten count. Round 0 declares, round 1's claim is clipped, a NaN count drops the site."""
    module, name = workflow.rsplit(".", 1)
    wf = getattr(__import__(module, fromlist=[name]), name)()
    warnings, errors = [], []
    wf.warning, wf.error = warnings.append, errors.append
    wf._bound_counts("train", {s: result(s, 1.0, n, 0) for s, n in (("site-1", 20), ("site-2", 30), ("site-3", 25))})
    results = {"site-1": result("site-1", 1.0, 20), "site-2": result("site-2", 1.0, float("nan")), "site-3": result("site-3", -1.0, 1e9)}
    wf._bound_counts("train", results)
    assert sorted(results) == ["site-1", "site-3"] and results["site-3"].meta[STEPS] == 25
    assert warnings and "site 'site-3' reported 1e+09" in warnings[0]
    assert errors and "site 'site-2' reported nan" in errors[0] and "refused by the server" in wf._missing.causes["site-2"]
    if "fedst" in module:  # FedST: its own weights read the bounded count
        assert wf._weights(results, ["site-1", "site-3"]) == [20.0, 25.0]
    other = {"site-3": result("site-3", 1.0, 1e9)}
    wf._bound_counts("validate", other)  # another task declares afresh (and is capped by its own peers only)
    assert other["site-3"].meta[STEPS] == 1e9
