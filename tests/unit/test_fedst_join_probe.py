"""benchmarks/fedst_join_probe.py's simulated B-bit exchange (``--quantize-bits``): the rounding, its bytes, and the
error feedback that keeps a site's uploads from drifting."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "fedst_join_probe.py"
_spec = importlib.util.spec_from_file_location("fedst_join_probe", _PATH)
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_rounds_each_block_to_its_own_scale_and_counts_bytes(bits):
    rng = np.random.default_rng(0)
    # 130 values: two full blocks of 64 and a padded one; the second block 1000x smaller than the first
    value = np.concatenate([rng.normal(size=64), 1e-3 * rng.normal(size=64), rng.normal(size=2)]).astype(np.float32)
    got, size = probe.quantized({"w": value.reshape(10, 13)}, bits)
    got = got["w"].reshape(-1)
    levels = 2 ** (bits - 1) - 1
    for block in (slice(0, 64), slice(64, 128), slice(128, 130)):
        step = np.abs(value[block]).max() / levels
        assert np.abs(got[block] - value[block]).max() <= 0.5 * step * 1.01  # half a step, float16 scale aside
    assert np.abs(got).max() <= np.abs(value).max() * 1.001
    assert size == (130 * bits + 7) // 8 + 2 * 3  # packed integers + one float16 scale per block
    zeros, _ = probe.quantized({"z": np.zeros(5, np.float32)}, bits)
    assert not zeros["z"].any()


def test_error_feedback_keeps_the_received_sum_within_one_rounding():
    """The same small change sent 50 times at 4 bits, beside a large entry that sets the block's scale: without
    feedback every send rounds the small values to 0, with it their received sum tracks the sent sum."""
    change = {"w": np.array([1.0] + [0.01] * 63, np.float32)}
    residual, received, plain = {}, np.zeros(64, np.float32), np.zeros(64, np.float32)
    for _ in range(50):
        got, _, residual = probe.sent_with_feedback(change, residual, 4)
        received += got["w"]
        plain += probe.quantized(change, 4)[0]["w"]
    step = 1.0 / 7
    assert not plain[1:].any()  # rounding alone loses the small values every time
    assert np.abs(received - 50 * change["w"]).max() <= step
