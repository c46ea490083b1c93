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
    """One SGD step on a known gradient with c != c_i: the step, c_i+ and the delta are all hand-computable and non-zero.

    Loss 0.5 * ||W x||^2 with x = (1, 0, 0) has gradient g = W[:, 0] in column 0 of W (0 elsewhere, 0 for the bias).
    w1 = w0 - lr * g - lr * (c - c_i);  option II: c_i+ = c_i - c + (w0 - w1) / (K lr) = g  (K = 1), delta = g - c_i.
    """
    model = _model()
    state = ScaffoldState(model)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    lr = 0.1
    state.helper.c_local.load_state_dict({k: torch.full_like(p, 0.5) for k, p in model.named_parameters()})  # drifted before: c_i = 0.5
    c_global = {k: np.full(tuple(v.shape), 2.0, np.float32) for k, v in model.named_parameters()}
    after_step = state.begin_round(model, c_global, lr)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x = torch.tensor([[1.0, 0.0, 0.0]])
    loss = 0.5 * (torch.nn.functional.linear(x, model.weight) ** 2).sum()
    loss.backward()
    grad = model.weight.grad.clone()
    opt.step()
    after_step(model)
    assert torch.allclose(model.weight, start["weight"] - lr * grad - lr * (2.0 - 0.5))
    assert torch.allclose(model.bias, start["bias"] - lr * (2.0 - 0.5))
    delta = state.end_round(model)
    assert set(delta) == {"weight", "bias"}
    assert np.allclose(delta["weight"], grad.numpy() - 0.5, atol=1e-5)  # g - c_i: not zero
    assert np.allclose(delta["bias"], -0.5, atol=1e-5)
    assert np.abs(delta["weight"]).max() > 0.1
