import copy

import numpy as np
import pytest
import torch

from medflare.baselines.corrections import ScaffoldState, fedprox_term


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def test_fedprox_term_is_zero_at_the_global_model_and_quadratic_away_from_it():
    model = _model()
    term = fedprox_term(model, mu=0.5)
    assert term(model).item() == pytest.approx(0.0)
    with torch.no_grad():
        model.weight.add_(1.0)  # 6 entries moved by 1 -> mu/2 * 6
    assert term(model).item() == pytest.approx(0.25 * 6)
    assert term(model).requires_grad  # it is part of the loss, so it must carry gradients


def test_scaffold_correction_and_control_update_follow_option_two():
    model = _model()
    state = ScaffoldState(model)
    start = copy.deepcopy(model.state_dict())
    c_global = {k: np.full(tuple(v.shape), 2.0, np.float32) for k, v in model.named_parameters()}
    lr = 0.1
    after_step = state.begin_round(model, c_global, lr)
    after_step(model)  # one step with zero gradient: only the correction -lr * (c - c_i) = -0.2 moves w
    assert torch.allclose(model.weight, start["weight"] - 0.2)
    delta = state.end_round(model)
    # c_i+ = c_i - c + (w_global - w_local) / (K * lr) = 0 - 2 + 0.2 / 0.1 = 0 -> delta = c_i+ - c_i = 0
    assert set(delta) == {"weight", "bias"}
    assert np.allclose(delta["weight"], 0.0, atol=1e-5)
