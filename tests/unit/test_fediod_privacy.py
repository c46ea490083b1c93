"""A FedIOD site's differential privacy: per-sample clipping, Gaussian noise of the configured std, the accountant
against opacus' published value, settings only from the site's own medflare_site.json, and the budget stop."""

import math

import pytest
import torch

from medflare import ConfigError
from medflare.fediod.privacy import (PrivacySettings, SiteAccountant, clip_and_noise, clip_rows,
                                     release_noise_multiplier)


def test_clip_bounds_every_row_and_leaves_short_rows_alone():
    v = torch.zeros(3, 2, 2)
    v[0, 0, 0], v[1, 1, 1], v[2] = 5.0, 0.5, 1.0  # norms 5, 0.5, 2
    out = clip_rows(v, 1.0)
    norms = out.reshape(3, -1).norm(dim=1)
    assert torch.allclose(norms, torch.tensor([1.0, 0.5, 1.0]))
    assert torch.equal(out[1], v[1])  # below the bound: untouched
    assert torch.allclose(out[0] / out[0].norm(), v[0] / v[0].norm())  # direction kept
    assert torch.equal(clip_rows(v, 0), v)  # 0 = no clipping


def test_noise_has_std_sigma_times_clip():
    g = torch.Generator().manual_seed(0)
    out = clip_and_noise(torch.zeros(4000, 50), clip_norm=0.5, noise_multiplier=2.0, generator=g)
    assert out.mean().abs() < 0.01
    assert out.std().item() == pytest.approx(1.0, rel=0.02)  # sigma * C = 2 * 0.5
    assert torch.equal(clip_and_noise(torch.ones(3, 4), 10.0, 0.0), torch.ones(3, 4))  # sigma 0: no noise


def test_accountant_matches_opacus_published_epsilon():
    """opacus' own RDP accountant test: sigma 1.5, sample rate 0.04, 2250 steps, delta 1e-5 -> epsilon 7.32911117143."""
    acc = SiteAccountant(delta=1e-5)
    assert acc.epsilon() == 0.0
    acc.spend(1.5, 0.04, steps=int(90 / 0.04))
    assert acc.epsilon() == pytest.approx(7.32911117143, rel=1e-9)


def test_release_is_gs_wgan_bound():
    """One release of n clipped vectors with noise sigma*C: sensitivity 2C sqrt(n) -> (alpha, 2 n alpha / sigma^2)-RDP."""
    from opacus.accountants.analysis.rdp import compute_rdp

    sigma, n, alpha = 8.0, 16, 4.0
    rdp = compute_rdp(q=1.0, noise_multiplier=release_noise_multiplier(sigma, n), steps=1, orders=[alpha])
    assert rdp[0] == pytest.approx(2 * n * alpha / sigma**2)


def test_what_if_does_not_spend_and_budget_refuses():
    acc = SiteAccountant(delta=1e-5, budget=5.0)
    release = [(release_noise_multiplier(50.0, 8), 1.0)]
    ok, eps = acc.allows(release)
    assert ok and 0 < eps < 5.0 and acc.epsilon() == 0.0
    while acc.allows(release)[0]:
        acc.spend(*release[0])
    assert acc.epsilon() <= 5.0 < acc.epsilon_after(release)


def test_settings_come_from_the_sites_privacy_section():
    s = PrivacySettings.from_site_config({"privacy": {"fediod_noise_multiplier": 1.1, "fediod_clip_norm": 0.5,
                                                      "fediod_epsilon_budget": 8, "fediod_noise_outputs": True}}, "site-1")
    assert (s.noise_multiplier, s.clip_norm, s.epsilon_budget, s.delta, s.scope) == (1.1, 0.5, 8, 1e-5, "gradients+outputs")
    assert not PrivacySettings.from_site_config({}, "site-1").enabled  # absent: DP off (documented, logged)
    with pytest.raises(ConfigError, match="fediod_clip_norm"):  # noise without a bound is refused
        PrivacySettings.from_site_config({"privacy": {"fediod_noise_multiplier": 1.0}}, "site-1")
    with pytest.raises(ConfigError, match="fediod_delta"):
        PrivacySettings.from_site_config({"privacy": {"fediod_delta": 2}}, "site-2")
    assert math.isclose(release_noise_multiplier(2.0, 4), 0.5)
