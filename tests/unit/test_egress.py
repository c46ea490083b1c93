"""What leaves a site: declared parts the site's filters see, a manifest the site enforces, analytics the site decides.

Each test fails when its piece of the egress rule is broken: SCAFFOLD's controls back in meta (PercentilePrivacy would
no longer touch them), scores in meta (a DXOBlocker on METRICS could not stop them), an undeclared part let through,
a picture streamed by default, the audit blind to meta or analytics images.
"""

import numpy as np
import pytest
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.filter import ContentBlockedException
from nvflare.apis.fl_constant import FLMetaKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_common.app_constant import AlgorithmConstants
from nvflare.app_common.filters.dxo_blocker import DXOBlocker
from nvflare.app_common.filters.percentile_privacy import PercentilePrivacy

from medflare import PrivacyError
from medflare.common.egress import (Intake, ManifestFilter, Send, declare, reply_problems, resolve_bounds, site_reply,
                                    unpack)
from medflare.common.privacy_filters import ClipAndNoise, clip_and_noise_array
from medflare.common.tracking import LOCAL_EVENT_TYPE, SERVER_EVENT_TYPE, SiteTracker, StreamPolicy
from medflare.jobs.egress import describe_payload, violations

N = {FLMetaKey.NUM_STEPS_CURRENT_ROUND: 20}
CTRL = AlgorithmConstants.SCAFFOLD_CTRL_DIFF
SCORES = MetaKey.INITIAL_METRICS


def _diff(seed=0, n=200):
    return {"w": np.random.default_rng(seed).normal(0, 0.01, n).astype(np.float32)}


def _scaffold_reply():
    lift = {SCORES: DXO(DataKind.METRICS, data={"dice": 0.5}), CTRL: DXO(DataKind.WEIGHT_DIFF, data=_diff(1), meta=dict(N))}
    return site_reply({"update": DXO(DataKind.WEIGHT_DIFF, data=_diff(0), meta=dict(N))}, lift=lift, unwrap="update", rnd=2)


def _manifest(**bounds):
    return declare({"train": [Send("update", "WEIGHT_DIFF", "diff", **bounds), Send(SCORES, "METRICS", "scores"),
                              Send(CTRL, "WEIGHT_DIFF", "controls", **bounds)]})


def test_the_server_reads_a_packed_reply_as_flare_sends_it_and_the_wire_holds_only_parts():
    reply = _scaffold_reply()
    wire = from_shareable(reply)
    assert wire.data_kind == DataKind.COLLECTION and set(wire.data) == {"update", SCORES, CTRL}
    assert all(not isinstance(v, (dict, np.ndarray)) for k, v in wire.meta.items() if k != "medflare_lift")
    server = from_shareable(Intake().process(reply, FLContext()))
    assert server.data_kind == DataKind.WEIGHT_DIFF and set(server.data) == {"w"}
    assert server.meta[SCORES] == {"dice": 0.5} and set(server.meta[CTRL]) == {"w"} and server.meta[FLMetaKey.NUM_STEPS_CURRENT_ROUND] == 20
    assert "medflare_packed" not in server.meta


def test_scaffold_controls_are_filtered_by_percentile_privacy_under_the_strict_scope():
    reply = PercentilePrivacy(percentile=50, gamma=0.0001, data_kinds=["WEIGHT_DIFF"]).process(_scaffold_reply(), FLContext())
    controls = from_shareable(Intake().process(reply, FLContext())).meta[CTRL]["w"]
    raw = _diff(1)["w"]
    assert np.count_nonzero(controls) <= len(raw) // 2 + 1  # the smaller half zeroed ...
    assert np.abs(controls).max() <= 0.0001 * 20 + 1e-9 < np.abs(raw).max()  # ... the rest clipped (per training case x 20)


def test_a_dxo_blocker_on_metrics_stops_the_scores():
    with pytest.raises(ContentBlockedException, match="METRICS"):
        DXOBlocker(data_kinds=["METRICS"]).process(_scaffold_reply(), FLContext())


def test_unpack_leaves_other_dxos_alone_and_keeps_parts_that_are_not_unwrapped():
    plain = DXO(DataKind.METRICS, data={"a": 1.0})
    assert unpack(plain) is plain
    reply = from_shareable(site_reply({"x": DXO(DataKind.STATISTICS, data={"n": np.ones(3)})},
                                      lift={SCORES: DXO(DataKind.METRICS, data={"a": 1.0})}))
    out = unpack(reply)
    assert out.data_kind == DataKind.COLLECTION and set(out.data) == {"x"} and out.meta[SCORES] == {"a": 1.0}
    with pytest.raises(ValueError, match="unwrap"):
        site_reply({"x": plain}, unwrap="y")


def test_a_lifted_part_cannot_replace_the_count_the_server_bounds():
    forged = {FLMetaKey.NUM_STEPS_CURRENT_ROUND: DXO(DataKind.METRICS, data={"n": 1e9})}
    reply = from_shareable(site_reply({"update": DXO(DataKind.WEIGHT_DIFF, data=_diff(), meta=dict(N))}, lift=forged,
                                      unwrap="update"))
    assert unpack(reply).meta[FLMetaKey.NUM_STEPS_CURRENT_ROUND] == 20


@pytest.mark.parametrize("change, expected", [
    (lambda r: r.data.update(extra=DXO(DataKind.STATISTICS, data={"v": np.ones(4)})), "part 'extra' (STATISTICS) is not declared"),
    (lambda r: setattr(r.data["update"], "data_kind", DataKind.WEIGHTS), "part 'update' is WEIGHTS, declared WEIGHT_DIFF"),
    (lambda r: r.meta.update(secret=np.ones(5)), "meta key 'secret' is not declared"),
    (lambda r: r.data["update"].meta.update({FLMetaKey.NUM_STEPS_CURRENT_ROUND: [1, 2]}), "holds list, not a scalar"),
    (lambda r: r.data[SCORES].data.update(image=np.ones((8, 8))), "METRICS but holds more than numbers"),
])
def test_the_manifest_names_what_is_undeclared(change, expected):
    dxo = from_shareable(_scaffold_reply())
    assert reply_problems(_manifest(), "train", dxo) == []
    change(dxo)
    problems = reply_problems(_manifest(), "train", dxo)
    assert any(expected in p for p in problems), problems


def test_the_manifest_bounds_weight_parts_by_the_preset_network_and_refuses_headers_with_arrays():
    dxo = from_shareable(_scaffold_reply())
    tight = resolve_bounds(_manifest(models=1), model_state_bytes=100)  # 200 float32 = 800 B > 100 B
    assert any("holds 800 B, declared at most 100 B" in p for p in reply_problems(tight, "train", dxo))
    assert reply_problems(resolve_bounds(_manifest(models=1), 800), "train", dxo) == []
    assert any("header 'leak'" in p for p in reply_problems(_manifest(), "train", dxo, {"leak": np.ones(10)}))
    assert reply_problems(_manifest(), "validate", dxo) == ["task 'validate' is not in the job's manifest (declared: ['train'])"]


def test_the_site_refuses_an_undeclared_reply_with_a_privacy_error_naming_task_part_and_kind():
    ctx = FLContext()
    ctx.set_prop("__task_name__", "train", private=True, sticky=False)
    flt = ManifestFilter(_manifest())
    assert flt.process(_scaffold_reply(), ctx) is not None
    bad = site_reply({"update": DXO(DataKind.WEIGHT_DIFF, data=_diff()), "pictures": DXO("IMAGES", data={"x": np.ones((4, 32, 32))})})
    with pytest.raises(PrivacyError, match=r"'train' reply.*part 'pictures' \(IMAGES\) is not declared"):
        flt.process(bad, ctx)


class _Recorder:
    """Stands in for a FLARE component: records the events a tracker fires."""

    def __init__(self):
        self.events = []

    def fire_event(self, event_type, fl_ctx):
        self.events.append((event_type, fl_ctx.get_prop("__event_data__")))


@pytest.mark.parametrize("policy, image_event, scalar_event", [
    (StreamPolicy(), LOCAL_EVENT_TYPE, "analytix_log_stats"),  # the default: pictures stay, scalars stream
    (StreamPolicy(images=True), "analytix_log_stats", "analytix_log_stats"),
    (StreamPolicy(scalars=False), LOCAL_EVENT_TYPE, LOCAL_EVENT_TYPE),
])
def test_pictures_of_a_sites_data_stay_at_the_site_unless_its_operator_opts_in(monkeypatch, policy, image_event, scalar_event):
    import medflare.common.tracking as tracking

    fired = []
    monkeypatch.setattr(tracking, "send_analytic_dxo", lambda comp, dxo, fl_ctx, event_type: fired.append((event_type, dxo)))
    tracker = SiteTracker(object(), policy=policy)
    tracker.image(FLContext(), "val/case0", np.zeros((3, 8, 8), np.uint8), 0)
    tracker.scalars(FLContext(), {"dice": 0.5}, 0)
    assert [e for e, _ in fired] == [image_event, scalar_event]
    assert SiteTracker(object(), event_type=SERVER_EVENT_TYPE).policy.images  # the server streams what it makes itself


def test_the_stream_policy_comes_from_the_sites_own_settings_and_refuses_non_booleans():
    from medflare import ConfigError

    assert StreamPolicy.from_site_config({}, "s") == StreamPolicy(scalars=True, images=False)
    assert StreamPolicy.from_site_config({"privacy": {"stream_images": True}}, "s").images
    with pytest.raises(ConfigError, match="privacy.stream_images"):
        StreamPolicy.from_site_config({"privacy": {"stream_images": "yes"}}, "s")


def test_clip_and_noise_acts_on_the_listed_kinds_only():
    x = np.full((4, 10), 3.0, np.float32)  # rows of norm 3 sqrt(10) ~ 9.5
    clipped = clip_and_noise_array(x, 1.0, 0.0, 1, np.random.default_rng(0))
    assert np.allclose(np.linalg.norm(clipped, axis=1), 1.0) and clipped.dtype == np.float32
    reply = site_reply({"logits": DXO("FEDIOD_LOGITS", data={"z": x}), "counts": DXO(DataKind.STATISTICS, data={"c": np.arange(3)})})
    out = from_shareable(ClipAndNoise(["FEDIOD_LOGITS"], clip_norm=1.0, noise_std=0.1, seed=0).process(reply, FLContext()))
    z = out.data["logits"].data["z"]
    assert not np.allclose(z, x) and np.linalg.norm(z, axis=1).max() < 2.0
    assert np.array_equal(out.data["counts"].data["c"], np.arange(3))


def _event(array):
    from nvflare.apis.analytix import AnalyticsDataType, LogWriterName
    from nvflare.apis.utils.analytix_utils import create_analytic_dxo

    kind = AnalyticsDataType.IMAGE if isinstance(array, np.ndarray) else AnalyticsDataType.SCALAR
    return create_analytic_dxo(tag="t", value=array, data_type=kind, writer=LogWriterName.TORCH_TB, global_step=0).to_shareable()


def _records(payloads, site_opts_in=False):
    """Recorder rows of one site that sent ``{(channel, topic): payload}``."""
    rows = [{"site": "site-1", "start": True, "stream_images": site_opts_in}]
    for (channel, topic), payload in payloads.items():
        rows.append({"site": "site-1", "method": "send_request", "channel": channel, "topic": topic, **describe_payload(payload)})
    return rows


def test_the_egress_audit_catches_what_the_old_code_sent():
    """The pre-change wire: SCAFFOLD controls and scores in meta, an overlay picture as an analytics event."""
    old = DXO(DataKind.WEIGHT_DIFF, data=_diff(), meta={**N, CTRL: _diff(1), SCORES: {"dice": 0.5}}).to_shareable()
    old.set_header("__task_name__", "train")
    picture = _event(np.zeros((3, 32, 32), np.uint8))
    rows = _records({("server_command", "submit_update"): old, ("aux_communication", "fed.event"): picture})
    found = violations(rows, None)
    assert any("array in meta: scaffold_c_diff.w" in v for v in found), found
    assert any("meta 'initial_metrics' is a dict" in v for v in found), found
    assert any("a picture streamed to the server, but the site did not opt in" in v for v in found), found
    assert not any("picture" in v for v in violations(_records({("aux_communication", "fed.event"): picture}, site_opts_in=True), None))


def test_the_egress_audit_passes_declared_parts_and_scalar_events_and_flags_unknown_channels():
    reply = _scaffold_reply()
    reply.set_header("__task_name__", "train")
    rows = _records({("server_command", "submit_update"): reply, ("aux_communication", "fed.event"): _event(0.5)})
    assert violations(rows, _manifest()) == []
    undeclared = declare({"train": [Send("update", "WEIGHT_DIFF", "diff")]})
    assert any(f"part '{CTRL}' (WEIGHT_DIFF) of task 'train' is not declared" in v for v in violations(rows, undeclared))
    other = declare({"validate": [Send("update", "WEIGHT_DIFF", "diff")]})
    assert any("task 'train' is not in the job's manifest" in v for v in violations(rows, other))
    other = _records({("my_channel", "x"): Shareable()})
    assert any("a channel the bundle does not declare" in v for v in violations(other, None))


def test_fediod_label_counts_are_noised_under_dp_and_accounted():
    import torch

    from medflare.fediod.privacy import SiteAccountant, noised_counts

    counts = torch.tensor([10.0, 0.0, 5.0], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([noised_counts(counts, 1.0, 2.0, g) for _ in range(400)])
    assert (draws >= 0).all() and (draws == draws.round()).all()
    assert 1.5 < float(draws[:, 0].std()) < 2.5  # std = noise multiplier x sensitivity (1 per record)
    acc = SiteAccountant(1e-5)
    acc.spend(2.0, steps=2)
    assert 0 < acc.epsilon() < float("inf")


def test_a_scope_can_block_fedvcks_condensed_set_or_cap_and_noise_it():
    from medflare.fedvck import protocol as FP
    from medflare.fedvck.filters import CondensedSetFilter
    from medflare.fedvck.protocol import pack_reply

    images, labels = np.full((6, 1, 8, 8), 128, np.uint8), np.array([0, 0, 0, 1, 1, 1])
    reply = lambda: pack_reply(images, labels, np.zeros((2, 2)), np.array([3, 3]), {"accuracy": 0.5}).to_shareable()  # noqa: E731
    with pytest.raises(ContentBlockedException, match=FP.CONDENSED_SET):
        DXOBlocker(data_kinds=[FP.CONDENSED_SET]).process(reply(), FLContext())
    out = from_shareable(CondensedSetFilter(max_per_class=1, noise_std=0.1, levels=16, seed=0).process(reply(), FLContext()))
    kept = out.data[FP.PART_CONDENSED].data
    assert len(kept["labels"]) == 2 and not np.all(kept["images"] == 128)  # one image per class, noised
