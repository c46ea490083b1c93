"""FedSM functional core: SoftPull (Eq. 11), weighted averaging, Algorithm 2 routing, Eq. 1 labels,
selector head calibration from feature statistics and the super-model file; no FLARE involved."""

import numpy as np
import pytest
import torch

from medflare import MedflareError
from medflare.fedsm.extra import extra_labels, per_case_losses
from medflare.fedsm.calibrate import add_noise, feature_stats, fit_head, fold_standardisation, head_of, selector_features, set_head
from medflare.fedsm.routing import GLOBAL, SuperModelPredictor, route, selection_frequency
from medflare.fedsm.selector import StyleSelector, build_selector
from medflare.common.aggregation import weighted_mean
from medflare.fedsm.softpull import softpull
from medflare.fedsm.supermodel import load_super_model, save_super_model
from medflare.common.results import describe
from medflare.common.payload import state_to_numpy


def _three():
    return [{"w": np.array([1.0, 0.0]), "n": np.array(5)}, {"w": np.array([4.0, 3.0]), "n": np.array(7)}, {"w": np.array([7.0, 9.0]), "n": np.array(9)}]


def test_softpull_k3_hand_computed():
    out = softpull(_three(), 0.7)
    # site 1: 0.7*[1,0] + 0.15*([4,3]+[7,9]) = [0.7+1.65, 0+1.8] = [2.35, 1.8]
    np.testing.assert_allclose(out[0]["w"], [2.35, 1.8])
    # site 2: 0.7*[4,3] + 0.15*([1,0]+[7,9]) = [2.8+1.2, 2.1+1.35] = [4.0, 3.45]
    np.testing.assert_allclose(out[1]["w"], [4.0, 3.45])
    # site 3: 0.7*[7,9] + 0.15*([1,0]+[4,3]) = [4.9+0.75, 6.3+0.45] = [5.65, 6.75]
    np.testing.assert_allclose(out[2]["w"], [5.65, 6.75])
    assert [int(o["n"]) for o in out] == [5, 7, 9]  # integer counters (BN num_batches_tracked) stay the site's own


def test_softpull_limits():
    models = _three()
    for o in softpull(models, 1 / 3):
        np.testing.assert_allclose(o["w"], [4.0, 4.0])  # plain mean = FedAvg's hard averaging
    for o, m in zip(softpull(models, 1.0), models):
        np.testing.assert_allclose(o["w"], m["w"])  # local training
    np.testing.assert_allclose(models[0]["w"], [1.0, 0.0])  # inputs untouched


@pytest.mark.parametrize("lam", [0.2, 1.5])
def test_softpull_rejects_lambda_outside_range(lam):
    with pytest.raises(MedflareError, match="lambda"):
        softpull(_three(), lam)


def test_softpull_rejects_mismatched_models():
    with pytest.raises(MedflareError, match="different parameter names"):
        softpull([{"a": np.zeros(1)}, {"b": np.zeros(1)}], 0.7)


def test_weighted_mean_uses_nk():
    out = weighted_mean([{"w": np.array([0.0], dtype=np.float32)}, {"w": np.array([4.0], dtype=np.float32)}], [3, 1])
    np.testing.assert_allclose(out["w"], [1.0])
    assert out["w"].dtype == np.float32
    with pytest.raises(MedflareError, match="weight"):
        weighted_mean([{"w": np.zeros(1)}], [0])


def test_route_gamma_algorithm2():
    probs = torch.tensor([[0.95, 0.05, 0.0], [0.5, 0.3, 0.2], [0.1, 0.0, 0.9]])
    assert route(probs, 0.9).tolist() == [0, GLOBAL, GLOBAL]  # 0.9 is not > 0.9
    assert route(probs, 0.0).tolist() == [0, 0, 2]  # gamma 0: always a personalised model
    assert route(probs, 1.0).tolist() == [GLOBAL] * 3  # gamma 1: always the global model
    # FedSM-extra selector: column 0 is the global model
    assert route(probs, 0.0, global_class=True).tolist() == [GLOBAL, GLOBAL, 1]


class _Const(torch.nn.Module):
    """Outputs a constant: logits (B, C, H, W) filled with ``value`` or selector logits ``value``."""

    def __init__(self, value, shape=None):
        super().__init__()
        self.value, self.shape = torch.as_tensor(value, dtype=torch.float32), shape

    def forward(self, x):
        if self.shape is None:
            return self.value.expand(x.shape[0], -1)
        return self.value.view(1, -1, 1, 1).expand(x.shape[0], -1, *x.shape[2:])


def test_super_model_predictor_uses_selected_model():
    g = _Const([9.0, 0.0], shape=True)
    p = [_Const([0.0, 9.0], shape=True), _Const([0.0, 9.0], shape=True)]
    confident = SuperModelPredictor(g, p, _Const([10.0, 0.0]), gamma=0.9)
    out = confident(torch.zeros(2, 1, 4, 4))
    assert out.argmax(1).unique().tolist() == [1] and confident.choices == [0, 0]
    unsure = SuperModelPredictor(g, p, _Const([0.1, 0.0]), gamma=0.9)
    assert unsure(torch.zeros(3, 1, 4, 4)).argmax(1).unique().tolist() == [0]
    assert selection_frequency(unsure.choices, ["site-1", "site-2"]) == {"GM": 1.0, "site-1": 0.0, "site-2": 0.0}


def test_extra_labels_eq1_toy():
    # rows = models [global, person-1, person-2], columns = 3 cases: lowest loss wins, ties -> lower index
    losses = torch.tensor([[0.5, 0.2, 0.3], [0.1, 0.4, 0.3], [0.7, 0.4, 0.1]])
    assert extra_labels(losses).tolist() == [1, 0, 2]
    assert extra_labels(torch.tensor([[0.3], [0.3]])).tolist() == [0]
    with pytest.raises(MedflareError):
        extra_labels(torch.zeros(1, 3))


def test_per_case_losses_pick_the_right_model():
    label = torch.zeros(2, 1, 4, 4, dtype=torch.long)
    label[1] = 1
    models = [_Const([5.0, -5.0], shape=True), _Const([-5.0, 5.0], shape=True)]
    ce = torch.nn.CrossEntropyLoss()
    losses = per_case_losses(models, torch.zeros(2, 1, 4, 4), label, lambda lo, la: ce(lo, la[:, 0]))
    assert losses.shape == (2, 2) and extra_labels(losses).tolist() == [0, 1]


def _gaussian_site(mean, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.as_tensor(mean, dtype=torch.float64) + 0.5 * torch.randn(n, len(mean), generator=g, dtype=torch.float64)


def test_feature_stats_match_numpy():
    x = _gaussian_site([1.0, 2.0, 3.0], 40, 0)
    stats = feature_stats(x, [0] * 25 + [2] * 15)
    assert sorted(stats) == ["0", "2"] and int(stats["2"]["n"]) == 15
    np.testing.assert_allclose(stats["0"]["mean"], x[:25].mean(0).numpy())
    np.testing.assert_allclose(stats["2"]["cov"], np.cov(x[25:].numpy().T))
    assert np.all(feature_stats(x[:1], [1])["1"]["cov"] == 0)  # one case: zero covariance, no NaN


def test_fit_head_separates_two_gaussian_sites_on_raw_features():
    # Two sites whose features differ in one dimension on a large offset and scale: the fitted head works on
    # raw features (the standardisation is folded into the Linear weights).
    a, b = _gaussian_site([100.0, 5.0, -3.0], 60, 1), _gaussian_site([100.0, 8.0, -3.0], 60, 2)
    w, bias = fit_head([feature_stats(a, [0] * 60), feature_stats(b, [1] * 60)], 2)
    pred = lambda x: (x.float() @ w.T + bias).argmax(1)  # noqa: E731
    assert (pred(_gaussian_site([100.0, 5.0, -3.0], 50, 3)) == 0).float().mean() > 0.95
    assert (pred(_gaussian_site([100.0, 8.0, -3.0], 50, 4)) == 1).float().mean() > 0.95
    # deterministic for a seed
    w2, b2 = fit_head([feature_stats(a, [0] * 60), feature_stats(b, [1] * 60)], 2)
    assert torch.equal(w, w2) and torch.equal(bias, b2)


def test_fold_standardisation_is_exact():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(3, 5, generator=g, dtype=torch.float64), torch.randn(3, generator=g, dtype=torch.float64)
    mean, std = torch.randn(5, generator=g, dtype=torch.float64), torch.rand(5, generator=g, dtype=torch.float64) + 0.1
    x = torch.randn(7, 5, generator=g, dtype=torch.float64)
    wf, bf = fold_standardisation(w, b, mean, std)
    torch.testing.assert_close(x @ wf.T + bf, ((x - mean) / std) @ w.T + b)


def test_fit_head_three_classes_one_absent_and_pooled_sites():
    # FedSM-extra: label 0 (global) reported by nobody; label 1 reported by two sites (pooled).
    s1 = feature_stats(_gaussian_site([0.0, 0.0], 40, 7), [1] * 40)
    s2 = feature_stats(_gaussian_site([0.2, 0.0], 40, 8), [1] * 20 + [2] * 20)
    s2["2"] = feature_stats(_gaussian_site([5.0, 5.0], 20, 9), [2] * 20)["2"]
    w, bias = fit_head([s1, s2], 3)
    logits = _gaussian_site([5.0, 5.0], 10, 10).float() @ w.T + bias
    assert logits.argmax(1).eq(2).all() and torch.count_nonzero(w[0]) == 0 and bias[0] < bias[1:].min()
    with pytest.raises(MedflareError, match="at least 2 labels"):
        fit_head([s1], 3)
    with pytest.raises(MedflareError, match="outside"):
        fit_head([s1, feature_stats(_gaussian_site([0.0, 0.0], 5, 0), [3] * 5)], 3)


def test_add_noise_keeps_covariance_symmetric_and_fit_still_works():
    stats = feature_stats(_gaussian_site([0.0, 0.0, 0.0], 30, 11), [0] * 30)
    noisy = add_noise(stats, 0.1, seed=0)
    np.testing.assert_allclose(noisy["0"]["cov"], noisy["0"]["cov"].T)
    assert not np.allclose(noisy["0"]["mean"], stats["0"]["mean"])
    other = add_noise(feature_stats(_gaussian_site([3.0, 3.0, 3.0], 30, 12), [1] * 30), 0.1, seed=1)
    w, bias = fit_head([noisy, other], 2)  # noise can make a covariance indefinite: still samples
    assert torch.isfinite(w).all()


def test_style_selector_head_calibration_end_to_end():
    torch.manual_seed(0)
    net = StyleSelector(1, 2, width=4, depth=2)
    dark, bright = 0.1 * torch.rand(20, 1, 16, 16), 0.5 + 0.5 * torch.rand(20, 1, 16, 16)
    stats = [feature_stats(selector_features(net, [dark]), [0] * 20), feature_stats(selector_features(net, [bright]), [1] * 20)]
    set_head(net, *fit_head(stats, 2))
    with torch.no_grad():
        assert net(dark).argmax(1).eq(0).all() and net(bright).argmax(1).eq(1).all()
    with pytest.raises(MedflareError, match="cannot be calibrated"):
        head_of(build_selector({"name": "vgg11_selector", "args": {"in_channels": 1, "num_classes": 2}}))


def test_style_selector_shapes_and_builder():
    net = build_selector({"name": "style_selector", "args": {"in_channels": 1, "num_classes": 4}})
    assert net(torch.rand(3, 1, 32, 32)).shape == (3, 4)
    vgg = build_selector({"name": "vgg11_selector", "args": {"in_channels": 1, "num_classes": 4}})
    assert vgg(torch.rand(2, 1, 32, 32)).shape == (2, 4)
    with pytest.raises(MedflareError, match="num_classes"):
        StyleSelector(1, 0)


def test_super_model_file_roundtrip(tmp_path):
    """Global and each personalised model have their own weights: a swap or reordering on save/load fails this."""
    from medflare.common.persistence import model_from_preset

    nets = {name: state_to_numpy(model_from_preset("seg_synthetic_tiny", seed=seed)) for name, seed in (("global", 0), ("site-1", 1), ("site-2", 2))}
    spec = {"name": "style_selector", "args": {"in_channels": 1, "num_classes": 2, "width": 4, "depth": 2}}
    sel = state_to_numpy(build_selector(spec))
    path = tmp_path / "sm.pt"
    save_super_model(
        path, description=describe("seg_synthetic_tiny", kind="fedsm_super_model"), sites=["site-1", "site-2"],
        selector_spec=spec, global_class=False, global_params=nets["global"],
        person_params={"site-1": nets["site-1"], "site-2": nets["site-2"]},
        selector_params=sel, lam=0.7, round_num=3, metrics={"super_dice": 0.5},
    )
    assert torch.load(path, weights_only=True)["sites"] == ["site-1", "site-2"]
    sm = load_super_model(path)
    assert len(sm.person_models) == 2 and sm.info["round"] == 3 and sm.info["lambda"] == pytest.approx(0.7)
    for net, name in ((sm.global_model, "global"), *zip(sm.person_models, ("site-1", "site-2"))):
        loaded = state_to_numpy(net)
        assert all(np.array_equal(loaded[k], nets[name][k]) for k in loaded), f"{name} came back with other weights"
    assert all(np.array_equal(v, sel[k]) for k, v in state_to_numpy(sm.selector).items())
    out = sm.predictor(0.9)(torch.rand(2, 1, 32, 32))
    assert out.shape == (2, 3, 32, 32)
    torch.save({"model": nets["global"], "train_conf": {"medflare": describe("seg_synthetic_tiny")}}, tmp_path / "plain.pt")
    with pytest.raises(MedflareError, match="not a FedSM super model"):
        load_super_model(tmp_path / "plain.pt")
