"""FedSM functional core without FLARE: SoftPull (Eq. 11), the per-site feature Gaussians and their calibration,
the encoder selector, Algorithm 2 routing, Eq. 1 labels and the FedSM-extra head, one server round with a missing
site, the one-pass site scores, the super-model file and its persistor."""

import numpy as np
import pytest
import torch
from scipy import stats as st

from medflare import ConfigError, MedflareError, PayloadError
from medflare.common.aggregation import weighted_mean
from medflare.common.payload import state_to_numpy
from medflare.common.persistence import model_from_preset
from medflare.fedsm import density
from medflare.fedsm import protocol as P
from medflare.fedsm.aggregate import SiteReply, SuperState, aggregate_models, aggregate_round, refresh_selector
from medflare.fedsm.extra import HeadAdam, extra_labels, head_gradient_step, per_case_losses
from medflare.fedsm.routing import GLOBAL, SuperModelPredictor, route, selection_frequency
from medflare.fedsm.scoring import case_scorer, one_pass, site_score, summarize
from medflare.fedsm.selector import build_selector, encoder_features, selector_spec, unet_down_blocks
from medflare.fedsm.softpull import softpull
from medflare.fedsm.persistor import save_super_model
from medflare.fedsm.results import load_super_model, super_model_description
from medflare.fedsm.supermodel import super_model_network
from medflare.presets import get_preset

TINY = "seg_synthetic_tiny"
MODEL = get_preset(TINY)["model"]


# ---- SoftPull ----------------------------------------------------------------------------------
def _three():
    return [{"w": np.array([1.0, 0.0]), "n": np.array(5)}, {"w": np.array([4.0, 3.0]), "n": np.array(7)}, {"w": np.array([7.0, 9.0]), "n": np.array(9)}]


def test_softpull_k3_hand_computed():
    out = softpull(_three(), 0.7)
    # site 1: 0.7*[1,0] + 0.15*([4,3]+[7,9]) = [2.35, 1.8]; site 2: 0.7*[4,3] + 0.15*([1,0]+[7,9]) = [4.0, 3.45]
    np.testing.assert_allclose(out[0]["w"], [2.35, 1.8])
    np.testing.assert_allclose(out[1]["w"], [4.0, 3.45])
    np.testing.assert_allclose(out[2]["w"], [5.65, 6.75])
    assert [int(o["n"]) for o in out] == [5, 7, 9]  # integer counters (BN num_batches_tracked) stay the site's own


def test_softpull_limits():
    models = _three()
    for o in softpull(models, 1 / 3):
        np.testing.assert_allclose(o["w"], [4.0, 4.0])  # plain mean = FedAvg's hard averaging
    for o, m in zip(softpull(models, 1.0), models):
        np.testing.assert_allclose(o["w"], m["w"])  # local training
    np.testing.assert_allclose(models[0]["w"], [1.0, 0.0])  # inputs untouched
    for lam in (0.2, 1.5):
        with pytest.raises(MedflareError, match="lambda"):
            softpull(models, lam)


def test_weighted_mean_uses_nk():
    out = weighted_mean([{"w": np.array([0.0], dtype=np.float32)}, {"w": np.array([4.0], dtype=np.float32)}], [3, 1])
    np.testing.assert_allclose(out["w"], [1.0])
    assert out["w"].dtype == np.float32


# ---- the density model ---------------------------------------------------------------------------
def _gauss(mean, n, seed, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    return torch.as_tensor(mean, dtype=torch.float64) + scale * torch.randn(n, len(mean), generator=g, dtype=torch.float64)


def test_moments_precision_and_distance_hand_computed():
    x = torch.tensor([[1.0, 2.0], [3.0, 2.0], [2.0, 5.0]], dtype=torch.float64)
    n, mean, cov = density.feature_moments(x)
    assert n == 3
    torch.testing.assert_close(mean, torch.tensor([2.0, 3.0], dtype=torch.float64))
    torch.testing.assert_close(cov, torch.tensor([[1.0, 0.0], [0.0, 3.0]], dtype=torch.float64))
    # shrinkage 0.5 of [[2, 1], [1, 4]] -> [[2, .5], [.5, 4]], inverse = [[4, -.5], [-.5, 2]] / 7.75
    p = density.shrunk_precision(torch.tensor([[2.0, 1.0], [1.0, 4.0]]), 0.5)
    torch.testing.assert_close(p, torch.tensor([[4.0, -0.5], [-0.5, 2.0]], dtype=torch.float64) / 7.75)
    d2 = density.mahalanobis_sq(torch.tensor([[1.0, 1.0]]), torch.zeros(2), p)
    assert float(d2) == pytest.approx((4 - 1 + 2) / 7.75)
    # scale invariance: rescaling a feature leaves the distance unchanged (shrinkage towards the diagonal)
    s = torch.tensor([10.0, 0.1], dtype=torch.float64)
    c = torch.tensor([[2.0, 1.0], [1.0, 4.0]], dtype=torch.float64)
    v = torch.tensor([[0.7, -1.3]], dtype=torch.float64)
    a = density.mahalanobis_sq(v, torch.zeros(2), density.shrunk_precision(c, 0.3))
    b = density.mahalanobis_sq(v * s, torch.zeros(2), density.shrunk_precision(c * torch.outer(s, s), 0.3))
    torch.testing.assert_close(a, b)


def test_calibration_and_typicality():
    # moments 10 / 20 -> dof 2*100/20 = 10, scale 1; capped at dim; under 3 cases dof = dim
    assert density.calibration(5, 10.0, 20.0, 48) == pytest.approx((1.0, 10.0))
    assert density.calibration(5, 10.0, 0.5, 48) == pytest.approx((10.0 / 48, 48.0))
    assert density.calibration(2, 12.0, 50.0, 6) == pytest.approx((2.0, 6.0))
    with pytest.raises(PayloadError):
        density.calibration(0, 1.0, 1.0, 4)
    d2 = torch.tensor([0.0, 3.0, 10.0, 40.0])
    np.testing.assert_allclose(density.typicality(d2, 2.0, 5.0).numpy(), st.chi2.sf(d2.numpy() / 2.0, 5.0), rtol=1e-10)


def test_site_gaussian_is_calibrated_on_held_out_cases_and_rejects_far_ones():
    """Own held-out cases: typicality about uniform (about gamma of them below gamma); a shifted site: near 0."""
    dim = 6
    train, val, test = _gauss([0.0] * dim, 400, 0), _gauss([0.0] * dim, 200, 1), _gauss([0.0] * dim, 2000, 2)
    stats = density.site_gaussian(train, val, shrinkage=0.2)
    assert int(stats["n"]) == 400 and int(stats["val_n"]) == 200
    scale, dof = density.calibration(int(stats["val_n"]), float(stats["val_d2_mean"]), float(stats["val_d2_var"]), dim)
    prec = density.shrunk_precision(torch.as_tensor(stats["cov"]), 0.2)
    typ = lambda x: density.typicality(density.mahalanobis_sq(x, torch.as_tensor(stats["mean"]), prec), scale, dof)  # noqa: E731
    for gamma in (0.05, 0.2):
        assert abs(float((typ(test) <= gamma).double().mean()) - gamma) < 0.25 * gamma + 0.01
    assert float((typ(_gauss([2.0] * dim, 200, 3)) <= 0.05).double().mean()) > 0.95


def test_site_noise_is_relative_fixed_by_the_generator_and_the_calibration_uses_it():
    train, val = _gauss([100.0, 0.0, 5.0], 50, 4, scale=3.0), _gauss([100.0, 0.0, 5.0], 20, 5, scale=3.0)
    clean = density.site_gaussian(train, val, 0.2)
    a = density.site_gaussian(train, val, 0.2, noise=0.1, generator=torch.Generator().manual_seed(7))
    b = density.site_gaussian(train, val, 0.2, noise=0.1, generator=torch.Generator().manual_seed(7))
    np.testing.assert_array_equal(a["mean"], b["mean"])  # the same secret seed gives the same draw every round
    np.testing.assert_allclose(a["cov"], a["cov"].T)
    shift = np.abs(a["mean"] - clean["mean"]) / np.sqrt(np.diag(clean["cov"]))
    assert 0 < shift.max() < 0.5  # noise in units of each feature's std, not absolute
    # the validation moments are those of the noised Gaussian the server will use
    prec = density.shrunk_precision(torch.as_tensor(a["cov"]), 0.2)
    d2 = density.mahalanobis_sq(val, torch.as_tensor(a["mean"]), prec)
    assert float(a["val_d2_mean"]) == pytest.approx(float(d2.mean()))
    with pytest.raises(ConfigError):
        density.add_relative_noise(torch.zeros(2), torch.eye(2), -1.0)


# ---- the selector ---------------------------------------------------------------------------------
def test_unet_down_blocks_are_the_encoder_path():
    net = model_from_preset(TINY, seed=3)
    blocks = unet_down_blocks(net, 2)
    x = torch.rand(2, 1, 32, 32)
    h1 = net.model[0](x)
    h2 = net.model[1].submodule[0](h1)
    with torch.no_grad():
        f = encoder_features(blocks, x)
    expected = torch.cat([h1.mean((2, 3)), torch.log(h1.std((2, 3)) + 1e-4), h2.mean((2, 3)), torch.log(h2.std((2, 3)) + 1e-4)], 1)
    torch.testing.assert_close(f, expected.double())
    assert f.shape == (2, 2 * (8 + 16))
    with pytest.raises(ConfigError, match="levels"):
        unet_down_blocks(net, 4)
    with pytest.raises(ConfigError, match="UNet"):
        unet_down_blocks(torch.nn.Conv2d(1, 1, 1), 1)


def test_selector_stem_copies_the_global_encoder_and_types_sites():
    spec = selector_spec(MODEL, ["a", "b", "c"], global_class=False)
    sel = build_selector(spec)
    net = model_from_preset(TINY, seed=5)
    sel.set_stem_params(state_to_numpy(net))
    x = torch.rand(3, 1, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(sel.features(x), encoder_features(unet_down_blocks(net, 2), x))
    # no Gaussian yet: typicality 0 everywhere (every case to the global model)
    assert torch.count_nonzero(sel(x)) == 0
    with torch.no_grad():
        feats = sel.features(torch.rand(40, 1, 32, 32))
    sel.set_site(1, density.site_gaussian(feats[:30], feats[30:], sel.shrinkage))
    typ = sel(x)
    assert typ.shape == (3, 3) and torch.count_nonzero(typ[:, [0, 2]]) == 0 and (typ[:, 1] > 0).all()
    with pytest.raises(ConfigError, match=r"fedsm\.selector\.width.*valid keys: levels, shrinkage"):
        selector_spec(MODEL, ["a"], False, {"width": 3})
    with pytest.raises(ConfigError, match="unknown selector name 'vgg11_selector'"):
        build_selector({"name": "vgg11_selector", "args": {}})
    with pytest.raises(PayloadError, match="site 0"):
        sel.set_site(0, {"n": 3})


def _style(kind, n, seed):
    """Images of three acquisition styles: dark low-contrast, bright, and (unseen) inverted with strong noise."""
    g = torch.Generator().manual_seed(seed)
    base = torch.rand(n, 1, 32, 32, generator=g)
    if kind == "dark":
        return 0.1 + 0.2 * base
    if kind == "bright":
        return 0.6 + 0.3 * base
    return (1.0 - 0.5 * base + 0.3 * torch.randn(n, 1, 32, 32, generator=g)).clamp(0, 1)


def test_selector_identifies_seen_sites_and_sends_an_unseen_style_to_the_global_model():
    sel = build_selector(selector_spec(MODEL, ["dark", "bright"], global_class=False))
    sel.set_stem(model_from_preset(TINY, seed=0))
    with torch.no_grad():
        for k, kind in enumerate(("dark", "bright")):
            sel.set_site(k, density.site_gaussian(sel.features(_style(kind, 60, k)), sel.features(_style(kind, 30, 10 + k)), sel.shrinkage))
        for k, kind in enumerate(("dark", "bright")):
            choice = route(sel(_style(kind, 40, 20 + k)), gamma=0.05)
            assert (choice == k).double().mean() > 0.85, (kind, choice)
        unseen = route(sel(_style("inverted", 40, 30)), gamma=0.05)
    assert (unseen == GLOBAL).double().mean() > 0.9, unseen


# ---- Algorithm 2 --------------------------------------------------------------------------------
def test_route_gate_and_head():
    typ = torch.tensor([[0.95, 0.05, 0.0], [0.5, 0.3, 0.2], [0.01, 0.0, 0.02]])
    assert route(typ, 0.9).tolist() == [0, GLOBAL, GLOBAL]  # 0.9 is not > 0.9 ... 0.5 <= 0.9
    assert route(typ, 0.0).tolist() == [0, 0, 2]  # gamma 0: always a personalised model
    assert route(typ, 1.0).tolist() == [GLOBAL] * 3  # gamma 1: always the global model
    head = torch.tensor([[0.1, 0.1, 0.7, 0.1], [0.6, 0.2, 0.1, 0.1], [0.0, 0.0, 0.0, 1.0]])  # column 0 = global
    assert route(typ, 0.05, head).tolist() == [1, GLOBAL, GLOBAL]  # the head picks; the gate still sends case 3 home
    with pytest.raises(MedflareError):
        route(typ, 0.5, head[:, :3])


class _FixedSelector(torch.nn.Module):
    """route_scores returns fixed typicalities (one row per case, cycled)."""

    def __init__(self, rows):
        super().__init__()
        self.rows = torch.as_tensor(rows, dtype=torch.float64)

    def route_scores(self, x):
        return self.rows[: x.shape[0]], None


def test_super_model_predictor_runs_the_chosen_network_per_case():
    nets = [model_from_preset(TINY, seed=s) for s in (0, 1, 2)]  # different weights: a swap changes the output
    sel = _FixedSelector([[0.9, 0.0], [0.0, 0.8], [0.01, 0.02]])
    pred = SuperModelPredictor(nets[0], nets[1:], sel, gamma=0.05, sites=["s1", "s2"])
    x = torch.rand(3, 1, 32, 32)
    out = pred(x)
    with torch.no_grad():
        torch.testing.assert_close(out[0], nets[1](x[:1])[0])
        torch.testing.assert_close(out[1], nets[2](x[1:2])[0])
        torch.testing.assert_close(out[2], nets[0](x[2:3])[0])
    assert pred.choices == [0, 1, GLOBAL]
    assert pred.report() == pytest.approx({"global model": 1 / 3, "s1": 1 / 3, "s2": 1 / 3})
    assert selection_frequency([], ["s1"]) == {"global model": 0.0, "s1": 0.0}


# ---- FedSM-extra --------------------------------------------------------------------------------
def test_extra_labels_eq1_toy():
    losses = torch.tensor([[0.5, 0.2, 0.3], [0.1, 0.4, 0.3], [0.7, 0.4, 0.1]])  # rows = [global, person-1, person-2]
    assert extra_labels(losses).tolist() == [1, 0, 2]
    assert extra_labels(torch.tensor([[0.3], [0.3]])).tolist() == [0]
    with pytest.raises(MedflareError):
        extra_labels(torch.zeros(1, 3))


def test_per_case_losses_pick_the_right_model():
    label = torch.zeros(2, 1, 4, 4, dtype=torch.long)
    label[1] = 1

    class Const(torch.nn.Module):
        def __init__(self, v):
            super().__init__()
            self.v = torch.tensor(v)

        def forward(self, x):
            return self.v.view(1, -1, 1, 1).expand(x.shape[0], -1, *x.shape[2:])

    ce = torch.nn.CrossEntropyLoss()
    losses = per_case_losses([Const([5.0, -5.0]), Const([-5.0, 5.0])], torch.zeros(2, 1, 4, 4), label, lambda lo, la: ce(lo, la[:, 0]))
    assert losses.shape == (2, 2) and extra_labels(losses).tolist() == [0, 1]


def test_head_steps_averaged_by_n_are_the_centralised_gradient_and_adam_learns():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(3, 4, generator=g), torch.randn(3, generator=g)
    xa, xb = torch.randn(10, 4, generator=g), torch.randn(30, 4, generator=g)
    ya, yb = torch.zeros(10, dtype=torch.long), torch.randint(1, 3, (30,), generator=g)
    # hand check of one site's step: -d/dW mean CE
    wr = w.clone().requires_grad_(True)
    torch.nn.functional.cross_entropy(xa @ wr.T + b, ya).backward()
    np.testing.assert_allclose(head_gradient_step(w, b, xa, ya)["head.weight"], (-wr.grad).numpy(), rtol=1e-5, atol=1e-7)
    # the n-weighted mean of the two sites' steps = the step on the union (positive-only label skew does not matter)
    head = torch.nn.Linear(4, 3)
    with torch.no_grad():
        head.weight.copy_(w), head.bias.copy_(b)
    steps = [head_gradient_step(w, b, xa, ya), head_gradient_step(w, b, xb, yb)]
    union = head_gradient_step(w, b, torch.cat([xa, xb]), torch.cat([ya, yb]))
    opt = HeadAdam(head, lr=0.1)
    ref = torch.nn.Linear(4, 3)
    with torch.no_grad():
        ref.weight.copy_(w), ref.bias.copy_(b)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.1)
    opt.step(steps, [10, 30])
    ref.weight.grad, ref.bias.grad = -torch.as_tensor(union["head.weight"]), -torch.as_tensor(union["head.bias"])
    ref_opt.step()
    torch.testing.assert_close(head.weight, ref.weight)
    loss = lambda: float(torch.nn.functional.cross_entropy(torch.cat([xa, xb]) @ head.weight.detach().T + head.bias.detach(), torch.cat([ya, yb])))  # noqa: E731
    before = loss()
    for _ in range(30):
        opt.step([head_gradient_step(head.weight, head.bias, xa, ya), head_gradient_step(head.weight, head.bias, xb, yb)], [10, 30])
    assert loss() < 0.7 * before
    with pytest.raises(PayloadError, match="lacks"):
        opt.step([{"head.weight": np.zeros((3, 4))}], [1])


# ---- one server round ------------------------------------------------------------------------------
def _params(v):
    return {"w": np.array([float(v), 2.0 * v], dtype=np.float32)}


def test_aggregate_models_with_a_missing_site_hand_computed():
    sites = ["s1", "s2", "s3"]
    person = {"s1": _params(1), "s2": _params(4), "s3": _params(7)}
    replies = {  # s2 did not answer
        "s1": SiteReply(n=10, diffs={P.GLOBAL: _params(1), P.PERSON: _params(2)}),
        "s3": SiteReply(n=30, diffs={P.GLOBAL: _params(5), P.PERSON: _params(-1)}),
    }
    new_global, new_person = aggregate_models(_params(10), person, replies, sites, lam=0.5)
    # global: 10 + (10*1 + 30*5)/40 = 14 ; personal before SoftPull: s1 1+2=3, s2 4 (kept), s3 7-1=6
    np.testing.assert_allclose(new_global["w"], [14.0, 28.0])
    # SoftPull lambda 0.5, K=3: own*0.5 + 0.25*others, the silent site's previous model among the others
    np.testing.assert_allclose(new_person["s1"]["w"][0], 0.5 * 3 + 0.25 * (4 + 6))
    np.testing.assert_allclose(new_person["s3"]["w"][0], 0.5 * 6 + 0.25 * (3 + 4))
    # the silent site's personalised model is kept exactly, not pulled towards the others (issue 17)
    np.testing.assert_array_equal(new_person["s2"]["w"], person["s2"]["w"])
    assert new_person["s2"]["w"] is not person["s2"]["w"]  # a copy: the caller's state is not aliased
    assert new_global["w"].dtype == np.float32
    with pytest.raises(PayloadError, match="s1"):
        aggregate_models(_params(0), person, {"s1": SiteReply(n=1, diffs={P.GLOBAL: _params(1)})}, sites, 0.5)


def _state(sites, global_class=False):
    spec = selector_spec(MODEL, sites, global_class)
    net = super_model_network(MODEL, sites, spec, initial=model_from_preset(TINY, seed=0))
    state = SuperState(sites=list(sites), global_params=state_to_numpy(net[P.GLOBAL]),
                       person={s: state_to_numpy(net[P.person_key(i)]) for i, s in enumerate(sites)}, selector=net[P.SELECT])
    if global_class:
        state.head_opt = HeadAdam(state.selector.head, lr=0.1)
    return state


def _stats(sel, seed):
    with torch.no_grad():
        f = sel.features(torch.rand(12, 1, 32, 32, generator=torch.Generator().manual_seed(seed)))
    return density.site_gaussian(f[:8], f[8:], sel.shrinkage)


def test_round_main_sets_the_stem_to_the_encoder_the_sites_used_and_only_their_gaussians():
    sites = ["s1", "s2", "s3"]
    state = _state(sites)
    encoder = state_to_numpy(model_from_preset(TINY, seed=9))
    state.global_params = encoder
    zero = {k: np.zeros_like(v) for k, v in encoder.items()}
    replies = {s: SiteReply(n=5, diffs={P.GLOBAL: {k: v + 1 for k, v in zero.items()}, P.PERSON: zero}, stats=_stats(state.selector, i))
               for i, s in enumerate(sites) if s != "s2"}
    aggregate_round(state, replies, P.MAIN, lam=0.5)
    assert state.selector.present.tolist() == [1.0, 0.0, 1.0]  # s2 sent nothing: not selectable for this encoder
    stem = {k: v for k, v in state_to_numpy(state.selector).items() if k.startswith("stem.")}
    own = unet_down_blocks(model_from_preset(TINY, seed=9), 2)
    np.testing.assert_array_equal(stem["stem.0.conv.unit0.conv.weight"], own[0].conv.unit0.conv.weight.detach().numpy())
    key = next(iter(encoder))
    np.testing.assert_allclose(state.global_params[key], encoder[key] + 1)  # FedAvg of the two answering sites
    assert refresh_selector(state.selector, encoder, {"s1": SiteReply(n=1)}, sites) == []  # no statistics: nothing changes
    assert state.selector.present.tolist() == [1.0, 0.0, 1.0]


def test_round_extra_trains_only_the_head():
    sites = ["s1", "s2"]
    state = _state(sites, global_class=True)
    before = (dict(state.global_params), {s: dict(p) for s, p in state.person.items()})
    w, b = state.selector.head.weight.clone(), state.selector.head.bias.clone()
    step = {"head.weight": np.ones((3, state.selector.dim), np.float32), "head.bias": np.array([1.0, 0.0, -1.0], np.float32)}
    aggregate_round(state, {"s1": SiteReply(n=3, head_step=step)}, P.EXTRA, lam=0.7)
    assert float(state.selector.head_trained) == 1.0
    assert state.selector.head.bias[0] > b[0] and state.selector.head.bias[2] < b[2]  # moved along the step
    assert (state.selector.head.weight > w).all()
    assert all(np.array_equal(state.global_params[k], v) for k, v in before[0].items())
    assert all(np.array_equal(state.person[s][k], v) for s, p in before[1].items() for k, v in p.items())
    with pytest.raises(PayloadError, match="phase"):
        aggregate_round(state, {}, "bogus", 0.7)


# ---- one-pass site scores ------------------------------------------------------------------------
def test_summarize_hand_computed():
    scores = {"g": torch.tensor([0.5, 0.6, 0.7, 0.8]), "p": torch.tensor([0.9, 0.9, 0.9, 0.1]),
              "person_0": torch.tensor([0.2, 0.2, 0.2, 0.2]), "person_1": torch.tensor([0.9, 0.9, 0.9, 0.1])}
    typ = torch.tensor([[0.0, 0.9], [0.0, 0.5], [0.8, 0.1], [0.01, 0.02]])  # own = site 1: own, own, other (site 0), global
    out = summarize(scores, typ, None, own=1, gamma=0.05, key="dice", global_name="g", person_names=["person_0", "person_1"], own_name="p")
    assert out["global_dice"] == pytest.approx(0.65) and out["person_dice"] == pytest.approx(0.7)
    assert out["own_or_global_dice"] == pytest.approx((0.9 + 0.9 + 0.7 + 0.8) / 4)  # the case sent to site 0 scored with the global model
    assert out["super_dice"] == pytest.approx((0.9 + 0.9 + 0.2 + 0.8) / 4)  # exact: that case scored with site 0's model
    assert out["selector_acc"] == pytest.approx(0.75)  # argmax typicality: 1, 1, 0, 1
    assert (out["selected_own"], out["selected_global"], out["selected_other"]) == pytest.approx((0.5, 0.25, 0.25))
    assert "super_dice" not in summarize(scores, typ, None, 1, 0.05, "dice", "g", None, "p")


def test_one_pass_scores_every_model_as_evaluate_does():
    from medflare.metrics import evaluate

    g = torch.Generator().manual_seed(0)
    batches = [{"image": torch.rand(3, 1, 32, 32, generator=g), "label": torch.randint(0, 3, (3, 1, 32, 32), generator=g)} for _ in range(2)]
    nets = {"a": model_from_preset(TINY, seed=1), "b": model_from_preset(TINY, seed=2)}
    score = case_scorer("segmentation", 3, "dice", "cpu")
    sel = _FixedSelector([[0.5, 0.5]] * 3)
    scores, typ, head = one_pass(batches, nets, sel, score, "cpu")
    assert typ.shape == (6, 2) and head is None
    for name, net in nets.items():
        ref = evaluate(net, batches, task="segmentation", num_classes=3, metrics=["dice_c1", "dice_c2", "dice"])
        assert scores[name].shape == (6, 2, 2)  # per case: per-class Dice, class presence
        np.testing.assert_allclose(scores[name][:, 0].numpy(), [[r["dice_c1"], r["dice_c2"]] for r in ref["per_case"]])
        assert site_score(scores[name]) == pytest.approx(ref["mean"]["dice"])


def test_site_scores_leave_out_a_class_no_model_ever_predicts_nor_any_label_holds():
    # binary masks under a 3-class preset; the models never predict class 2: FedSM's scores (and so the best
    # super model's choice) must be the class-1 Dice, not inflated by an empty-empty 1.0 for class 2
    g = torch.Generator().manual_seed(0)
    labels = (torch.rand(4, 1, 8, 8, generator=g) > 0.5).long()
    batch = {"image": torch.zeros(4, 1, 8, 8), "label": labels}
    score = case_scorer("segmentation", 3, "dice", "cpu")
    logits = {"g": torch.nn.functional.one_hot(torch.zeros(4, 8, 8).long(), 3).permute(0, 3, 1, 2).float(),  # all background
              "p": torch.nn.functional.one_hot(labels[:, 0], 3).permute(0, 3, 1, 2).float()}  # perfect
    scores = {name: score(batch, out) for name, out in logits.items()}
    typ = torch.tensor([[0.0, 0.9]] * 2 + [[0.9, 0.0]] * 2)  # own = site 1: cases 0, 1 own model, cases 2, 3 elsewhere
    out = summarize(scores, typ, None, own=1, gamma=0.05, key="dice", global_name="g", person_names=["g", "p"], own_name="p")
    assert out["global_dice"] == 0.0 and out["person_dice"] == 1.0  # class 2 left out: not (0 + 1) / 2
    assert out["own_or_global_dice"] == pytest.approx(0.5) and out["super_dice"] == pytest.approx(0.5)


# ---- the super-model file and its persistor ----------------------------------------------------------
def _network(sites):
    spec = selector_spec(MODEL, sites, global_class=False)
    net = super_model_network(MODEL, sites, spec)
    for i, name in enumerate([P.GLOBAL] + [P.person_key(k) for k in range(len(sites))]):
        net[name].load_state_dict(model_from_preset(TINY, seed=10 + i).state_dict())
    with torch.no_grad():
        net[P.SELECT].present[1] = 1.0  # zero precision: every case at distance 0 of site index 1
    return net, spec


def test_super_model_file_roundtrip_keeps_each_network(tmp_path):
    sites = ["site-1", "site-2"]
    net, spec = _network(sites)
    path = tmp_path / "sm.pt"
    save_super_model(path, net, super_model_description(TINY, None, sites, spec, 0.7, 0.05), {"round": 3})
    sm = load_super_model(path)
    assert sm.sites == sites and sm.info["round"] == 3 and sm.info["lambda"] == pytest.approx(0.7)
    for name, loaded in sm.networks.items():
        ref = state_to_numpy(net[name])
        assert all(np.array_equal(v, ref[k]) for k, v in state_to_numpy(loaded).items()), f"{name} came back with other weights"
    x = torch.rand(2, 1, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(sm.predictor(0.05)(x), net[P.person_key(1)](x))  # routed to site-2's own weights
        torch.testing.assert_close(sm.predictor(1.0)(x), net[P.GLOBAL](x))
    torch.save({"model": {}, "train_conf": {"medflare": {**super_model_description(TINY, None, sites, spec, 0.7, 0.05), "version": 1}}}, tmp_path / "v1.pt")
    with pytest.raises(MedflareError, match="version 1"):
        load_super_model(tmp_path / "v1.pt")
    torch.save({"model": state_to_numpy(net[P.GLOBAL]), "train_conf": {"medflare": super_model_description(TINY, None, sites, spec, 0.7, 0.05)}}, tmp_path / "bad.pt")
    with pytest.raises(MedflareError, match="bad.pt"):
        load_super_model(tmp_path / "bad.pt")


def test_persistor_builds_the_container_when_configured_and_writes_the_registry_format(tmp_path):
    from nvflare.apis.fl_context import FLContext

    from medflare.fedsm.persistor import SuperModelPersistor

    sites = ["site-1", "site-2", "site-3"]
    spec = selector_spec(MODEL, sites, global_class=True)
    pers = SuperModelPersistor(preset=TINY, seed=4)
    with pytest.raises(ConfigError, match="configure"):
        pers.load_model(FLContext())
    pers.configure(sites, spec, softpull_lambda=0.6, gamma=0.1)
    learnable = pers.load_model(FLContext())
    weights = learnable["weights"]
    assert {k.split(".")[0] for k in weights} == {P.GLOBAL, P.SELECT, *(P.person_key(i) for i in range(3))}
    start = state_to_numpy(model_from_preset(TINY, seed=4))
    for name in (P.GLOBAL, P.person_key(2)):
        assert all(np.array_equal(weights[f"{name}.{k}"], v) for k, v in start.items())
    pers.save_model_file(str(tmp_path / "sm.pt"))
    sm = load_super_model(tmp_path / "sm.pt")
    assert sm.sites == sites and sm.info["gamma"] == pytest.approx(0.1) and sm.selector.global_class


def test_record_gamma_rewrites_the_best_file_and_every_later_save_keeping_the_weights(tmp_path):
    from nvflare.apis.fl_context import FLContext

    from medflare.fedsm.persistor import BEST_SUPER_MODEL_FILE, SuperModelPersistor

    sites = ["site-1", "site-2"]
    pers = SuperModelPersistor(preset=TINY, seed=4)
    pers.configure(sites, selector_spec(MODEL, sites, global_class=False), softpull_lambda=0.6, gamma=0.05)
    pers.load_model(FLContext())
    pers.log_dir = str(tmp_path)  # the app folder FLARE gives it at START_RUN
    best = tmp_path / BEST_SUPER_MODEL_FILE
    pers.save_model_file(str(best))  # a best file saved in an earlier round, at the configured gamma
    before = load_super_model(best)
    pers.record_gamma(0.01)
    after = load_super_model(best)
    assert (before.info["gamma"], after.info["gamma"]) == (pytest.approx(0.05), pytest.approx(0.01))
    assert all(torch.equal(a, b) for a, b in zip(before.global_model.state_dict().values(), after.global_model.state_dict().values()))
    pers.save_model_file(str(tmp_path / "final.pt"))
    assert load_super_model(tmp_path / "final.pt").info["gamma"] == pytest.approx(0.01)
    # one threshold per site (what a run that chose them from validation records): the default of evaluate
    pers.record_gamma([0.01, 1e-12])
    per_site = load_super_model(best)
    assert per_site.info["gamma"] == [0.01, 1e-12]
    (label, predictor), = per_site.predictors({})
    assert label == "super model, gamma per site (site-1 0.01, site-2 1e-12)" and predictor.gamma == [0.01, 1e-12]
    assert [name for name, _ in per_site.predictors({"gamma": [0.05, 1.0]})] == ["super model, gamma 0.05", "super model, gamma 1.0"]


# ---- the site's reply as FLARE's filters and the server see it ----------------------------------------
def _train_reply():
    from nvflare.apis.dxo import DXO, DataKind, MetaKey
    from nvflare.apis.fl_constant import FLMetaKey

    from medflare.common.egress import site_reply
    from medflare.common.payload import flatten

    g = np.random.default_rng(0)
    diff = flatten({P.GLOBAL: {"w": g.normal(0, 0.01, 50).astype(np.float32)}, P.PERSON: {"w": g.normal(0, 0.01, 50).astype(np.float32)}})
    stats = density.site_gaussian(_gauss([0.0, 1.0], 20, 1), _gauss([0.0, 1.0], 10, 2), 0.2)
    parts = {P.WEIGHTS_PART: DXO(DataKind.WEIGHT_DIFF, data=dict(diff), meta={FLMetaKey.NUM_STEPS_CURRENT_ROUND: 20}),
             P.STATS_PART: DXO(DataKind.STATISTICS, data=dict(stats))}
    scores = {MetaKey.INITIAL_METRICS: DXO(DataKind.METRICS, data={"own_or_global_dice": 0.5})}
    return site_reply(parts, lift=scores, meta={FLMetaKey.NUM_STEPS_CURRENT_ROUND: 20}, rnd=3), diff, stats


def test_site_filters_see_each_part_and_the_server_parses_what_they_let_through():
    from nvflare.apis.filter import ContentBlockedException
    from nvflare.apis.fl_context import FLContext
    from nvflare.app_common.filters.dxo_blocker import DXOBlocker
    from nvflare.app_common.filters.percentile_privacy import PercentilePrivacy
    from nvflare.app_common.utils.fl_model_utils import FLModelUtils

    from medflare.common.egress import Intake
    from medflare.fedsm.controller import parse_reply

    reply, diff, stats = _train_reply()
    with pytest.raises(ContentBlockedException, match="STATISTICS"):  # a scope can refuse the selector's statistics
        DXOBlocker(data_kinds=["STATISTICS"]).process(reply, FLContext())
    reply, diff, stats = _train_reply()
    filtered = PercentilePrivacy(percentile=50, gamma=0.001, data_kinds=["WEIGHT_DIFF"]).process(reply, FLContext())
    filtered = Intake().process(filtered, FLContext())  # the server's view: the scores back in meta for FLARE's selector
    got = parse_reply("site-1", FLModelUtils.from_shareable(filtered), P.MAIN)
    assert got.n == 20 and FLModelUtils.from_shareable(filtered).metrics == {"own_or_global_dice": 0.5}
    w = got.diffs[P.GLOBAL]["w"]
    assert np.count_nonzero(w) < len(w) and np.abs(w).max() <= 0.001 * 20 + 1e-7  # the filter (clip per case x 20 cases) acted ...
    assert all(np.array_equal(got.stats[k], v) for k, v in stats.items())  # ... and left the statistics alone
    with pytest.raises(PayloadError, match="site-1.*selector_head"):
        parse_reply("site-1", FLModelUtils.from_shareable(filtered), P.EXTRA)


def test_persistor_resumes_from_a_saved_super_model_of_the_same_run_only(tmp_path):
    """Resubmission after a server restart: the saved super model's weights, not the preset's, are the initial
    model; a file of other sites, another kind or a relative path is a ConfigError naming it."""
    from nvflare.apis.fl_context import FLContext

    from medflare.fedsm.persistor import SuperModelPersistor

    sites = ["site-1", "site-2"]
    net, spec = _network(sites)
    saved = tmp_path / "FedSM_super_model.pt"
    save_super_model(saved, net, super_model_description(TINY, None, sites, spec, 0.7, 0.05), {"round": 2})
    pers = SuperModelPersistor(preset=TINY, seed=4, source_ckpt_file_full_name=str(saved))
    pers.configure(sites, spec, softpull_lambda=0.7, gamma=0.05)
    weights = pers.load_model(FLContext())["weights"]
    for name in (P.GLOBAL, P.person_key(1), P.SELECT):
        for k, v in state_to_numpy(net[name]).items():
            assert np.array_equal(np.asarray(weights[f"{name}.{k}"]), v), f"{name}.{k} is not the saved model's"
    fresh = state_to_numpy(model_from_preset(TINY, seed=4))
    assert any(not np.array_equal(np.asarray(weights[f"{P.GLOBAL}.{k}"]), v) for k, v in fresh.items())

    other = SuperModelPersistor(preset=TINY, seed=4, source_ckpt_file_full_name=str(saved))
    other.configure(["site-1", "hospital-b"], selector_spec(MODEL, ["site-1", "hospital-b"], False), 0.7, 0.05)
    with pytest.raises(ConfigError, match=r"FedSM_super_model.pt' was trained with sites \['site-1', 'site-2'\]"):
        other.load_model(FLContext())
    plain = tmp_path / "global.pt"
    torch.save({"model": state_to_numpy(net[P.GLOBAL]), "train_conf": {}}, plain)
    foreign = SuperModelPersistor(preset=TINY, source_ckpt_file_full_name=str(plain))
    foreign.configure(sites, spec, 0.7, 0.05)
    with pytest.raises(ConfigError, match="global.pt' is not a FedSM super model"):
        foreign.load_model(FLContext())
    with pytest.raises(ConfigError, match="absolute path"):
        SuperModelPersistor(preset=TINY, source_ckpt_file_full_name="FedSM_super_model.pt")
