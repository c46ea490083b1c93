"""The train.amp switch: mixed precision only on a CUDA device, a clear error for an unknown mode."""

import contextlib

import pytest
import torch

from medflare import ConfigError
from medflare.common.training import mixed_precision


def test_amp_is_off_on_a_cpu_and_checked():
    for mode in ("off", "bf16", "fp16", None):
        autocast, scaler = mixed_precision(mode, "cpu")
        assert isinstance(autocast, contextlib.nullcontext) and scaler is None
    with pytest.raises(ConfigError, match="train.amp 'fp8'"):
        mixed_precision("fp8", "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_amp_on_a_gpu():
    autocast, scaler = mixed_precision("fp16", "cuda")
    assert isinstance(autocast, torch.autocast) and scaler is not None
    assert mixed_precision("bf16", "cuda")[1] is None
