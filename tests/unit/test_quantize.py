"""The wire's blockwise quantization (medflare.common.quantize) and its FLARE filters (medflare.common.diff_quantizer):
rounding per block, bytes, error feedback, and the order a site's privacy scope and the codec run in."""

import numpy as np
import pytest
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.dxo_filter import DXOFilter
from nvflare.apis.fl_context import FLContext

from medflare import PayloadError
from medflare.common.diff_quantizer import WIRE_BYTES, DiffDequantizer, DiffQuantizer
from medflare.common.egress import Intake, site_reply
from medflare.common.payload import payload_bytes
from medflare.common.quantize import ErrorFeedback, decode, decoded_structure, encode, encoded_bytes, is_encoded


@pytest.mark.parametrize("bits", [8, 4])
def test_each_block_rounds_to_its_own_scale_and_the_bytes_are_counted(bits):
    rng = np.random.default_rng(0)
    # 130 values: two full blocks of 64 and a padded one; the second block 1000x smaller than the first
    value = np.concatenate([rng.normal(size=64), 1e-3 * rng.normal(size=64), rng.normal(size=2)]).astype(np.float32)
    state = {"w": value.reshape(10, 13), "n": np.arange(3)}
    sent = encode(state, bits)
    got = decode(sent, bits)
    assert got["w"].shape == (10, 13) and got["w"].dtype == np.float16 and np.array_equal(got["n"], state["n"])
    flat, levels = got["w"].reshape(-1), 2 ** (bits - 1) - 1
    for block in (slice(0, 64), slice(64, 128), slice(128, 130)):
        step = np.abs(value[block]).max() / levels
        top = np.abs(value[block]).max()  # half a step, plus float16's rounding of the scale and the decoded values
        assert np.abs(flat[block] - value[block]).max() <= 0.5 * step * 1.01 + top * 2.0**-11
    assert np.abs(flat).max() <= np.abs(value).max() * 1.001
    assert payload_bytes(sent) == encoded_bytes(state, bits) == (130 * bits + 7) // 8 + 2 * 3 + 4 * 2 + state["n"].nbytes
    assert not decode(encode({"z": np.zeros(5, np.float32)}, bits), bits)["z"].any()
    assert is_encoded(sent) and not is_encoded(state)


def test_malformed_or_unquantizable_payloads_are_named():
    sent = encode({"w": np.ones(70, np.float32)}, 4)
    with pytest.raises(PayloadError, match="'w' is malformed"):
        decode({**sent, "w": sent["w"][:10]}, 4)
    with pytest.raises(PayloadError, match="'big'"):
        encode({"big": np.array([1e9], np.float32)}, 4)
    with pytest.raises(ValueError, match="bits"):
        encode({"w": np.ones(3, np.float32)}, 3)


def test_error_feedback_keeps_the_received_sum_within_one_rounding():
    """The same small change sent 50 times at 4 bits, beside a large entry that sets the block's scale: without
    feedback every send rounds the small values to 0, with it their received sum tracks the sent sum."""
    change = {"w": np.array([1.0] + [0.01] * 63, np.float32)}
    sender, received, plain = ErrorFeedback(4), np.zeros(64, np.float32), np.zeros(64, np.float32)
    for _ in range(50):
        received += decode(sender.send(change), 4)["w"]
        plain += decode(encode(change, 4), 4)["w"]
    assert not plain[1:].any()  # rounding alone loses the small values every time
    assert np.abs(received - 50 * change["w"]).max() <= 1.0 / 7
    before = sender.residual["w"].copy()
    sender.send({"d": np.ones(3, np.float32)})  # a send of other entries (sync_layers "domain") keeps w's residual
    assert np.array_equal(sender.residual["w"], before) and before[1:].any()


class _Halve(DXOFilter):  # standing for a site's privacy filter on weight diffs
    def __init__(self):
        super().__init__(supported_data_kinds=[DataKind.WEIGHT_DIFF], data_kinds_to_filter=[DataKind.WEIGHT_DIFF])
        self.seen = []

    def process_dxo(self, dxo, shareable, fl_ctx):
        self.seen.append({k: np.array(v) for k, v in dxo.data.items()})
        dxo.data = {k: v * 0.5 for k, v in dxo.data.items()}
        return dxo


def test_the_site_filter_quantizes_what_the_privacy_scope_passed_and_the_server_gets_floats_and_wire_bytes():
    """Site: the scope's filter (first, as FLARE orders a scope before the job's filters) sees float diffs; the
    quantizer sends only WEIGHT_DIFF parts as integers, with error feedback across sends. Server: the parts unpacked,
    then decoded to float32 with the bytes that arrived in meta."""
    rng = np.random.default_rng(1)
    scope, site, server = _Halve(), DiffQuantizer(4), DiffDequantizer(4)
    total_sent, total_got = np.zeros(256, np.float32), np.zeros(256, np.float32)
    for _ in range(20):
        diff = {"gen.w": rng.normal(size=256).astype(np.float32) * 1e-2}
        reply = site_reply({"generator": DXO(DataKind.WEIGHT_DIFF, data=dict(diff))},
                           lift={"summary": DXO(DataKind.STATISTICS, data={"loss": 0.5})}, unwrap="generator")
        reply = site.process(scope.process(reply, FLContext()), FLContext())
        parts = from_shareable(reply).data
        assert is_encoded(parts["generator"].data) and parts["generator"].data["gen.w"].dtype == np.uint8
        assert parts["summary"].data == {"loss": 0.5}  # other kinds pass untouched
        assert not is_encoded(scope.seen[-1]) and scope.seen[-1]["gen.w"].dtype == np.float32
        wire = payload_bytes(parts["generator"].data)
        got = from_shareable(server.process(Intake().process(reply, FLContext()), FLContext()))
        assert got.get_filter_history() == ["_Halve", "DiffQuantizer", "DiffDequantizer"]
        assert got.get_meta_prop(WIRE_BYTES) == wire == encoded_bytes(diff, 4) < payload_bytes(diff) / 6
        assert got.data["gen.w"].dtype == np.float16  # as a whole generator sent in float16
        assert decoded_structure(parts["generator"].data) == {"gen.w": ((256,), np.dtype(np.float16))}
        total_sent += 0.5 * diff["gen.w"]
        total_got += got.data["gen.w"]
    step = np.abs(0.5 * diff["gen.w"]).max() / 7 * 2  # one rounding of a block's scale, with margin for float16 scales
    assert np.abs(total_got - total_sent).max() <= step


def test_with_bits_0_the_filters_pass_everything_through_and_stay_out_of_the_filter_history():
    """A float exchange (``exchange_dtype`` float16 / float32): the always-registered filters neither change a payload
    nor appear in the filter history that the workflow logs as the sites' result filters."""
    diff = {"gen.w": np.ones(70, np.float32)}
    reply = site_reply({"generator": DXO(DataKind.WEIGHT_DIFF, data=dict(diff))}, unwrap="generator")
    reply = DiffQuantizer(0).process(reply, FLContext())
    got = from_shareable(DiffDequantizer(0).process(Intake().process(reply, FLContext()), FLContext()))
    assert not is_encoded(got.data) and np.array_equal(got.data["gen.w"], diff["gen.w"])
    assert not got.get_filter_history() and got.get_meta_prop(WIRE_BYTES) is None
