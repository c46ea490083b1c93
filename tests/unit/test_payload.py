import numpy as np
import pytest
import torch

from medflare import MedflareError
from medflare.common.payload import (
    check_finite,
    flatten,
    load_numpy_state,
    nbytes,
    state_to_numpy,
    unflatten,
    weight_diff,
)


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2))


def test_state_round_trip_and_diff():
    a, b = _net(), _net()
    with torch.no_grad():
        b[0].weight.add_(1.0)
    diff = weight_diff(state_to_numpy(b), state_to_numpy(a))
    assert np.allclose(diff["0.weight"], 1.0)
    assert np.allclose(diff["0.bias"], 0.0)
    load_numpy_state(a, state_to_numpy(b))
    assert torch.equal(a[0].weight, b[0].weight)
    assert a[1].num_batches_tracked.dtype == torch.int64


def test_mismatched_model_names_keys_and_shapes():
    params = state_to_numpy(_net())
    params.pop("0.bias")
    params["0.weight"] = np.zeros((3, 1, 3, 3), np.float32)
    params["extra"] = np.zeros(1)
    with pytest.raises(MedflareError) as e:
        load_numpy_state(_net(), params, who="site-x")
    msg = str(e.value)
    assert "site-x" in msg and "0.bias" in msg and "0.weight" in msg and "extra" in msg


def test_nan_update_is_refused_with_site_name():
    with pytest.raises(MedflareError, match="site-3"):
        check_finite({"w": np.array([1.0, np.nan])}, "site-3")
    check_finite({"w": np.array([1.0]), "n": np.array(3)}, "site-3")


def test_flatten_unflatten_and_bytes():
    models = {"global": {"w": np.ones(3, np.float32)}, "select": {"fc.w": np.zeros(2, np.float32)}}
    flat = flatten(models)
    assert set(flat) == {"global.w", "select.fc.w"}
    assert unflatten(flat)["select"]["fc.w"].shape == (2,)
    assert nbytes(flat) == 5 * 4
    with pytest.raises(MedflareError):
        unflatten({"noprefix": np.ones(1)})
