"""The server's update guard: screening rules (plain numpy/torch) and the FLARE result filter on shareables."""

import numpy as np
import pytest
import torch
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_constant import FLContextKey, ReservedKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import make_reply
from nvflare.app_common.aggregators.weighted_aggregation_helper import WeightedAggregationHelper
from nvflare.app_common.app_constant import AlgorithmConstants, AppConstants

from medflare import ConfigError
from medflare.common.payload import collection
from medflare.common.result_guard import UPDATE_REFUSED, UpdateGuard, dxo_parts
from medflare.common.tracking import SERVER_EVENT_TYPE
from medflare.common.site_errors import CAUSE_HEADER
from medflare.common.update_guard import (NormRule, Part, UpdateScreen, nonfinite_parts, nonfinite_paths, structure_mismatch, tree_norm,
                                          weight_structure)
from medflare.testing.poison import PoisonFilter


def diff(value, n=4):
    return Part("WEIGHT_DIFF", {"w": np.full(n, value, dtype=np.float32), "count": np.array(3, dtype=np.int64)})


# ---- screening functions ---------------------------------------------------------------------------
def test_nonfinite_paths_finds_nan_and_inf_in_arrays_and_tensors_at_any_depth():
    tree = {"a": np.array([1.0, np.nan]), "b": {"c": torch.tensor([0.0, float("inf")]), "d": [np.zeros(2), np.array([-np.inf])]},
            "ok": np.ones(3)}
    assert nonfinite_paths(tree) == ["a", "b.c", "b.d[1]"]


def test_integers_and_python_scalars_are_untouched():
    """Integer arrays cannot hold NaN; python floats (e.g. a metric) are not payload arrays."""
    assert nonfinite_paths({"n": np.array([2**62], dtype=np.int64), "t": torch.tensor([7]), "hd95": float("nan")}) == []
    assert tree_norm({"n": np.array([100], dtype=np.int64), "w": np.array([3.0, 4.0], dtype=np.float32)}) == pytest.approx(5.0)


def test_tree_norm_by_hand():
    assert tree_norm({"a": np.array([1.0, 2.0]), "b": {"c": torch.tensor([2.0], dtype=torch.float16)}}) == pytest.approx(3.0)


def test_collection_parts_and_meta_are_screened_but_metrics_are_not():
    parts = {"weights": diff(0.1), "stats": Part("STATISTICS", {"mean": np.array([np.nan])}),
             "scores": Part("METRICS", {"hd95": np.array([np.inf])}),
             "": Part("WEIGHT_DIFF", {"w": np.ones(2)}, meta={"scaffold_c_diff": {"w": np.array([np.nan])}})}
    assert nonfinite_parts(parts) == ["stats:mean", "meta.scaffold_c_diff.w"]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_screen_refuses_nan_and_inf(bad):
    screen = UpdateScreen()
    reason = screen.screen("train", 0, {"": diff(bad)})
    assert reason is not None and "NaN/Inf" in reason and "'w'" in reason


def test_norm_rule_median_multiple_by_hand():
    """Reference = norms accepted this round + last round's; refused = norm > ratio x median; refused norms never join."""
    rule = NormRule(max_ratio=10)
    assert rule.check(0, 100.0) is None  # the job's first result has no reference
    rule.accept(100.0)
    assert rule.check(0, 1001.0) is not None  # 1001 > 10 x 100
    assert rule.check(0, 1000.0) is None  # equal to the bound passes
    rule.accept(2.0)
    rule.accept(4.0)  # round 0 accepted [100, 2, 4] -> median 4
    assert rule.reference(1) == [100.0, 2.0, 4.0]  # round 1 starts with round 0's norms
    assert rule.check(1, 41.0) is not None and rule.check(1, 40.0) is None
    rule.accept(1.0)
    rule.accept(1.0)
    assert rule.reference(1) == [1.0, 1.0, 100.0, 2.0, 4.0]  # median 2
    assert rule.check(1, 21.0) is not None
    assert rule.reference(2) == [1.0, 1.0]  # round 2: round 1's accepted norms only


def test_screen_refuses_an_outlier_and_keeps_it_out_of_the_reference():
    screen = UpdateScreen(max_norm_ratio=10)
    assert screen.screen("train", 0, {"": diff(1.0)}) is None
    refused = screen.screen("train", 0, {"": diff(1e4)})
    assert refused is not None and "x median" in refused
    assert screen.screen("train", 0, {"": diff(1e4)}) is not None  # the refused norm did not raise the bar
    assert screen.screen("other", 0, {"": diff(1e4)}) is None  # each task has its own reference


def test_screen_norm_rule_per_part_and_off_switch():
    screen = UpdateScreen(max_norm_ratio=10)
    assert screen.screen("train", 0, {"weights": diff(1.0), "head": diff(1.0)}) is None
    reason = screen.screen("train", 0, {"weights": diff(1.0), "head": diff(1e3)})
    assert reason is not None and reason.startswith("head:")
    # the refused result's 'weights' norm did not join the reference either
    assert screen.rules[("train", "weights")].current == [pytest.approx(2.0)]
    off = UpdateScreen(max_norm_ratio=0)
    off.screen("train", 0, {"": diff(1.0)})
    assert off.screen("train", 0, {"": diff(1e9)}) is None
    assert off.screen("train", 0, {"": diff(np.nan)}) is not None  # finiteness is always checked


def test_zero_median_disables_the_rule_and_full_weights_are_screened():
    screen = UpdateScreen()
    assert screen.screen("train", 0, {"": diff(0.0)}) is None
    assert screen.screen("train", 0, {"": diff(5.0)}) is None
    weights = UpdateScreen()
    assert weights.screen("t", 0, {"": Part("WEIGHTS", {"w": np.ones(4)})}) is None
    assert weights.screen("t", 0, {"": Part("WEIGHTS", {"w": np.full(4, 100.0)})}) is not None
    assert weights.screen("t", 0, {"": Part("APP_DEFINED", {"x": np.full(4, 1e9)})}) is None  # no norm rule off weights


@pytest.mark.parametrize("bad", [0.5, -1, True, "10"])
def test_bad_ratio_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="max_norm_ratio"):
        UpdateScreen(bad)


# ---- the FLARE filter ------------------------------------------------------------------------------
class Engine:
    """Records the events a component fires (the TensorBoard scalars go out as analytics events)."""

    def __init__(self):
        self.events = []

    def fire_event(self, event_type, fl_ctx):
        data = fl_ctx.get_prop(FLContextKey.EVENT_DATA)
        if event_type == SERVER_EVENT_TYPE:
            dxo = from_shareable(data)
            self.events.append((dxo.data["track_key"], dxo.data["track_value"], dxo.data.get("global_step")))


def context(site, engine):
    ctx = FLContext()
    ctx.set_prop(ReservedKey.ENGINE, engine, private=True, sticky=False)
    peer = FLContext()
    peer.set_prop(ReservedKey.IDENTITY_NAME, site, private=False, sticky=False)
    ctx.set_peer_context(peer)
    ctx.set_prop(FLContextKey.TASK_NAME, "train", private=True, sticky=False)
    return ctx


def result(dxo, rnd):
    s = dxo.to_shareable()
    s.add_cookie(AppConstants.CONTRIBUTION_ROUND, rnd)
    return s


def test_filter_passes_good_results_refuses_bad_ones_and_names_the_site(caplog):
    guard, engine = UpdateGuard(), Engine()
    ok = result(DXO(DataKind.WEIGHT_DIFF, data={"w": np.ones(3, dtype=np.float32)}), 1)
    assert guard.process(ok, context("site-1", engine)) is ok
    nan = result(collection({"weights": DXO(DataKind.WEIGHT_DIFF, data={"global.w": np.array([np.nan])}),
                             "stats": DXO(DataKind.STATISTICS, data={"m": np.zeros(2)})}), 1)
    with caplog.at_level("ERROR"):
        out = guard.process(nan, context("site-2", engine))
    assert out.get_return_code() == UPDATE_REFUSED
    assert out.get_cookie(AppConstants.CONTRIBUTION_ROUND) == 1  # the workflow still knows which round it answers
    with pytest.raises(ValueError):
        from_shareable(out)  # no payload left to aggregate
    assert "site 'site-2'" in caplog.text and "round 1" in caplog.text and "weights:global.w" in caplog.text
    assert engine.events == [("guard/refused/site-1", 0.0, 1), ("guard/refused/site-2", 1.0, 1)]
    big = result(DXO(DataKind.WEIGHT_DIFF, data={"w": np.full(3, 1e3, dtype=np.float32)}), 1)
    assert guard.process(big, context("site-3", engine)).get_return_code() == UPDATE_REFUSED


def test_filter_leaves_error_replies_and_disabled_guard_alone():
    engine = Engine()
    err = make_reply(ReturnCode.EXECUTION_EXCEPTION)
    assert UpdateGuard().process(err, context("site-1", engine)) is err
    nan = result(DXO(DataKind.WEIGHT_DIFF, data={"w": np.array([np.nan])}), 0)
    assert UpdateGuard(enabled=False).process(nan, context("site-1", engine)) is nan
    assert engine.events == []


def test_dxo_parts_flattens_nested_collections():
    inner = collection({"a": DXO(DataKind.WEIGHTS, data={"w": np.ones(1)})})
    parts = dxo_parts(collection({"outer": inner, "m": DXO(DataKind.METRICS, data={"dice": 0.5})}, meta={"k": 1}))
    assert {k: p.kind for k, p in parts.items()} == {"outer/a": "WEIGHTS", "m": "METRICS", "meta": ""}


# ---- the control, at unit level: the poison is real, and the guard is what stops it ----------------
def site_context(site, engine):
    ctx = context(site, engine)
    ctx.set_prop(ReservedKey.IDENTITY_NAME, site, private=False, sticky=False)  # what the site's own filter sees
    return ctx


@pytest.mark.parametrize("guarded", [False, True])
def test_poisoned_site_makes_fedavg_nan_unless_the_guard_refuses_it(guarded):
    """Three sites' WEIGHT_DIFFs, site-3's through the test PoisonFilter, averaged by FLARE's in-time FedAvg helper
    (what jobs/fedavg runs) with and without the server's UpdateGuard in front: NaN without, the n-weighted mean of the
    two other sites with."""
    engine, guard = Engine(), UpdateGuard()
    poison = PoisonFilter(site="site-3", from_round=0)
    helper = WeightedAggregationHelper()
    updates = {"site-1": (np.array([1.0, 2.0], dtype=np.float32), 1), "site-2": (np.array([4.0, 8.0], dtype=np.float32), 3),
               "site-3": (np.array([2.0, 2.0], dtype=np.float32), 1)}
    for site, (w, n) in updates.items():
        sent = poison.process(result(DXO(DataKind.WEIGHT_DIFF, data={"w": w.copy()}), 0), site_context(site, engine))
        received = guard.process(sent, context(site, engine)) if guarded else sent
        if received.get_return_code(ReturnCode.OK) == ReturnCode.OK:  # FedAvg skips a result whose code is not OK
            helper.add(data=from_shareable(received).data, weight=n, contributor_name=site, contribution_round=0)
    mean = helper.get_result()["w"]
    if guarded:
        np.testing.assert_allclose(mean, (1 * updates["site-1"][0] + 3 * updates["site-2"][0]) / 4)
    else:
        assert np.isnan(mean).all()


# ---- structure: keys, shapes and dtypes of what the server sent (issue 28) --------------------------
MODEL = {"model.conv.weight": np.zeros((8, 1, 3, 3), dtype=np.float32), "model.conv.bias": np.zeros(8, dtype=np.float32),
         "model.bn.num_batches_tracked": np.array(0, dtype=np.int64)}


def sent_of(params):
    return weight_structure({"": Part("WEIGHTS", params)})


@pytest.mark.parametrize("change,named", [
    (lambda d: d.update({"model.conv.bias": np.zeros(1, dtype=np.float32)}), "key 'model.conv.bias' is (1,) float32, the server sent (8,) float32"),
    (lambda d: d.update({"model.conv.weight": np.zeros((8, 3, 3), dtype=np.float32)}), "key 'model.conv.weight' is (8, 3, 3)"),
    (lambda d: d.update({"model.extra": np.zeros(2, dtype=np.float32)}), "1 keys the server did not send: ['model.extra']"),
    (lambda d: d.pop("model.conv.bias"), "1 keys missing: ['model.conv.bias']"),
    (lambda d: d.update({"model.conv.bias": np.zeros(8, dtype=np.float16)}), "key 'model.conv.bias' is (8,) float16"),
    (lambda d: d.update({"model.conv.bias": np.array(["x"] * 8)}), "key 'model.conv.bias' is (8,) <U1"),
])
def test_structure_mismatch_names_the_key(change, named):
    got = {k: v.copy() for k, v in MODEL.items()}
    change(got)
    assert structure_mismatch(sent_of(MODEL), got).startswith(named)


def test_structure_accepts_the_same_model_tensors_and_a_float_counter():
    """An int counter may come back float (FLARE's PercentilePrivacy divides every entry by the step count)."""
    got = {**{k: torch.as_tensor(v) for k, v in MODEL.items()}, "model.bn.num_batches_tracked": np.array(1.0)}
    assert structure_mismatch(sent_of(MODEL), got) is None


def test_structure_of_flattened_multi_model_payloads():
    """FedSM: the sites send the global and their own model back but not the selector, and the extra rounds' head step
    by the selector's own key names; a model left half out is refused."""
    sent = sent_of({"global.w": np.zeros(3, np.float32), "global.b": np.zeros(1, np.float32), "person.w": np.zeros(3, np.float32),
                    "select.stem.w": np.zeros(2, np.float32), "select.head.weight": np.zeros((3, 4), np.float32),
                    "select.head.bias": np.zeros(3, np.float32)})
    assert structure_mismatch(sent, {"global.w": np.ones(3, np.float32), "global.b": np.ones(1, np.float32),
                                     "person.w": np.ones(3, np.float32)}) is None
    assert structure_mismatch(sent, {"head.weight": np.ones((3, 4), np.float32), "head.bias": np.ones(3, np.float32)}) is None
    assert structure_mismatch(sent, {"head.weight": np.ones((3, 4), np.float32)}) == "1 keys missing: ['head.bias']"
    assert structure_mismatch(sent, {"global.w": np.ones(3, np.float32), "person.w": np.ones(3, np.float32)}) == \
        "1 keys missing: ['global.b']"
    assert structure_mismatch(sent, {"head.weight": np.ones((4, 4), np.float32), "head.bias": np.ones(3, np.float32)}).startswith(
        "key 'head.weight' is (4, 4)")


def test_screen_checks_structure_only_when_the_server_sent_weights():
    screen = UpdateScreen()
    bad = {"": Part("WEIGHT_DIFF", {**MODEL, "model.extra": np.zeros(1, np.float32)})}
    assert "does not fit the model the server sent: 1 keys the server did not send" in screen.screen("train", 0, bad, sent_of(MODEL))
    assert screen.screen("train", 0, bad, {}) is None  # FedST-separate's generator upload: nothing sent to compare with


class _Task:
    def __init__(self, data):
        self.data = data


class _ClientTask:
    def __init__(self, data):
        self.task = _Task(data)


class _Comm:
    """FLARE's WFCommServer as the guard reads it: the client task of a task id, holding the data the workflow sent."""

    def __init__(self, data):
        self.data = data

    def process_task_check(self, task_id, fl_ctx):
        return _ClientTask(self.data) if task_id == "t1" else None


def _with_task(ctx, sent):
    runner = type("Runner", (), {})()
    runner.current_wf = type("WF", (), {})()
    runner.current_wf.controller = type("C", (), {"communicator": _Comm(sent)})()
    ctx.set_prop(FLContextKey.RUNNER, runner, private=True, sticky=False)
    ctx.set_prop(FLContextKey.TASK_ID, "t1", private=True, sticky=False)
    return ctx


def test_filter_refuses_a_wrong_structure_against_the_task_sent_and_names_site_and_key(caplog):
    """FedAvg's sent WEIGHTS and a result with an extra key; SCAFFOLD's control diff without the buffers, and with an
    extra key or a wrong shape."""
    guard, engine = UpdateGuard(), Engine()
    sent = DXO(DataKind.WEIGHTS, data=dict(MODEL)).to_shareable()
    ok = result(DXO(DataKind.WEIGHT_DIFF, data=dict(MODEL)), 1)
    assert guard.process(ok, _with_task(context("site-1", engine), sent)) is ok
    extra = result(DXO(DataKind.WEIGHT_DIFF, data={**MODEL, "bogus": np.zeros(2, np.float32)}), 1)
    with caplog.at_level("ERROR"):
        out = guard.process(extra, _with_task(context("site-2", engine), sent))
    assert out.get_return_code() == UPDATE_REFUSED
    assert "site 'site-2'" in caplog.text and "['bogus']" in caplog.text
    assert "the server's update guard refused it" in out.get_header(CAUSE_HEADER) and "bogus" in out.get_header(CAUSE_HEADER)
    # SCAFFOLD's control diff covers the trainable parameters only (FLARE's PTScaffoldHelper): without the BatchNorm
    # counter it is the diff an honest site sends (a classification ConvNet's SCAFFOLD was refused for it); a key the
    # server did not send or a wrong shape is still refused
    params_only = {k: v for k, v in MODEL.items() if k != "model.bn.num_batches_tracked"}
    scaffold = result(DXO(DataKind.WEIGHT_DIFF, data=dict(MODEL), meta={AlgorithmConstants.SCAFFOLD_CTRL_DIFF: params_only}), 1)
    assert guard.process(scaffold, _with_task(context("site-3", engine), sent)) is scaffold
    for ctrl, why in (({**params_only, "bogus": np.zeros(2, np.float32)}, "['bogus']"),
                      ({**params_only, "model.conv.bias": np.zeros(3, np.float32)}, "model.conv.bias")):
        scaffold = result(DXO(DataKind.WEIGHT_DIFF, data=dict(MODEL), meta={AlgorithmConstants.SCAFFOLD_CTRL_DIFF: ctrl}), 1)
        out = guard.process(scaffold, _with_task(context("site-3", engine), sent))
        assert out.get_return_code() == UPDATE_REFUSED and "meta.scaffold_c_diff" in out.get_header(CAUSE_HEADER)
        assert why in out.get_header(CAUSE_HEADER)
    unknown = result(DXO(DataKind.WEIGHT_DIFF, data={**MODEL, "bogus": np.zeros(2, np.float32)}), 1)
    assert guard.process(unknown, context("site-1", engine)) is unknown  # no task to compare with: other rules only
