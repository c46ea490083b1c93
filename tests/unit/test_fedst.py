"""FedST's functional core: the conditioning, L_simple (Eq. 2), Eq. 3, the communication cost (Eq. 4) and the saved files."""

import math

import numpy as np
import pytest
import torch
from monai.losses import DiceLoss, FocalLoss
from monai.networks.schedulers import DDPMScheduler, RFlowScheduler
from nvflare.apis.fl_context import FLContext
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.utils.fl_model_utils import FLModelUtils

from medflare import ConfigError, DataError, PayloadError, ResultFileError
from medflare.common.payload import flatten, payload_bytes, state_to_numpy
from medflare.common.quantize import encode
from medflare.common.results import describe, load_result
from medflare.common.training import make_loader, make_loss, make_optimizer, train_epochs
from medflare.data import load_site
from medflare.data.util import stable_seed
from medflare.fedst import comm
from medflare.fedst import protocol as P
from medflare.fedst.cache import JOIN_KEY
from medflare.fedst.conditioning import check_domain_vectors, domain_vectors, encode_labels, mixture_vectors, participation_mean
from medflare.fedst.controller import FedSTJoinController, FedSTSeparateController
from medflare.fedst.config import DiffusionConfig
from medflare.fedst.executor import GeneratorTrainingExecutor, StyleSamplingExecutor
from medflare.fedst.diffusion import (build_style_generator, cycle, domain_guided, exchange_plan, exchange_steps, frozen_copy, generator_args,
                                      generator_optimizer, in_exchange_dtype, is_domain_entry, other_domain_term, proximal_anchor, proximal_term,
                                      sample_images, sampling_scheduler, select_entries, simple_and_other_domain_losses,
                                      simple_loss, train_generator, training_scheduler)
from medflare.fedst.losses import CrossDomainTerm, segmentation_loss
from medflare.fedst.persistor import fedst_description, fedst_generator_args
from medflare.fedst.persistor import save_result
from medflare.fedst.results import check_compatible, load_fedst_result
from medflare.nets import build_from_spec
from medflare.presets import get_preset

TINY = {"channels": [8, 16], "num_res_blocks": 1, "attention_levels": [False, False], "norm_num_groups": 4, "num_head_channels": 4}


def _perturbed(gen):
    """``gen`` with every weight moved by 0.1 N(0, 1): MONAI zero-initialises the last conv of every block, so an
    untrained UNet outputs 0 whatever the input (and draws the same for every domain)."""
    with torch.no_grad():
        for p in gen.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return gen


def _generator(num_domains=0, num_classes=3, seed=0, perturb=True):
    torch.manual_seed(seed)
    gen = build_style_generator(generator_args(DiffusionConfig.from_dict({"generator": TINY}), 1, num_classes, num_domains))
    return (_perturbed(gen) if perturb else gen).eval()


def _labels(batch=2, size=8):
    lab = torch.zeros(batch, 1, size, size, dtype=torch.long)
    lab[:, :, 2:6, 2:6] = 1
    lab[:, :, 3:5, 3:5] = 2
    return lab


# ---- conditioning ---------------------------------------------------------------------------------
def test_encode_labels_is_one_hot_in_pm1_and_refuses_untrained_classes():
    lab = _labels()
    enc = encode_labels(lab, 3)
    assert enc.shape == (2, 3, 8, 8) and set(enc.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(enc.argmax(1, keepdim=True), lab) and torch.all((enc == 1).sum(1) == 1)
    with pytest.raises(DataError, match=r"class\(es\) \[2\].*trained classes: \[0, 1\]"):
        encode_labels(lab, 3, trained=[0, 1], who="the generator of 'site-2'")
    with pytest.raises(DataError, match=r"\[3\]"):
        encode_labels(lab + 1, 3)


def _forward(gen, labels, domain=None, seed=1):
    torch.manual_seed(seed)
    x = torch.cat([torch.randn(labels.shape[0], 1, 8, 8), encode_labels(labels, gen.num_classes)], dim=1)
    with torch.no_grad():
        return gen(x, torch.full((labels.shape[0],), 500), domain=domain)


def test_label_channels_change_the_output_where_the_label_changes():
    gen = _generator()
    a, b = _labels(1), _labels(1)
    b[:, :, 3:5, 3:5] = 1  # no cup
    out_a, out_a2, out_b = _forward(gen, a), _forward(gen, a), _forward(gen, b)
    assert torch.equal(out_a, out_a2)
    diff = (out_a - out_b).abs()[0, 0]
    assert diff.max() > 1e-3
    # the effect is strongest where the label differs (the receptive field spreads it a little)
    assert diff[3:5, 3:5].mean() > diff[0, :].mean()


def test_domain_module_changes_the_output_and_only_through_the_domain_vector():
    gen = _generator(num_domains=2)
    lab = _labels(1)
    d0, d1 = domain_vectors(0, 2, 1), domain_vectors(1, 2, 1)
    assert (_forward(gen, lab, d0) - _forward(gen, lab, d1)).abs().max() > 1e-3
    # switch the controllable modules off (scale 0, bias 0): both domains give the same image
    with torch.no_grad():
        for mod in gen.modulation:
            mod.proj.weight.zero_()
            mod.proj.bias.zero_()
    assert torch.allclose(_forward(gen, lab, d0), _forward(gen, lab, d1))
    # every residual block of MONAI's UNet carries one module (down, middle and up path)
    from monai.networks.nets.diffusion_model_unet import DiffusionUNetResnetBlock
    assert len(gen.modulation) == sum(isinstance(m, DiffusionUNetResnetBlock) for m in gen.unet.modules()) > 4


def test_all_zero_or_missing_domain_vectors_are_refused():
    gen = _generator(num_domains=3)
    lab = _labels(2)
    with pytest.raises(ValueError, match=r"row\(s\) \[1\] are all zero"):
        _forward(gen, lab, torch.tensor([[1.0, 0, 0], [0, 0, 0]]))
    with pytest.raises(ValueError, match=r"row\(s\) \[0\] are neither one-hot nor the uniform"):
        check_domain_vectors(torch.tensor([[0.5, 0.5, 0]]), 3)
    check_domain_vectors(mixture_vectors(3, 2), 3)  # the mixture vector of domain guidance is allowed
    with pytest.raises(ValueError, match="pass a one-hot 'domain'"):
        _forward(gen, lab)
    with pytest.raises(ValueError, match="no domain input"):
        _forward(_generator(), lab, domain_vectors(0, 2, 2))


def test_the_mixture_vector_gives_every_block_the_mean_of_the_sites_modulations():
    gen = _generator(num_domains=3)
    for mod in gen.modulation[:2]:
        h = torch.randn(1, mod.proj.out_features // 2, 4, 4)
        each = torch.stack([mod.proj(domain_vectors(k, 3, 1)) for k in range(3)]).mean(0)
        assert torch.allclose(mod.proj(mixture_vectors(3, 1)), each, atol=1e-6)
        assert torch.allclose(mod(h, mixture_vectors(3, 1)), torch.stack([mod(h, domain_vectors(k, 3, 1)) for k in range(3)]).mean(0), atol=1e-5)


def test_domain_guidance_extrapolates_away_from_the_mixture_style():
    """f(x, d) + w (f(x, d) - f(x, d_mix)), from one forward pass over the doubled batch; w = 0 is the plain generator."""
    gen, lab = _generator(num_domains=3), _labels(2)
    own, mix = _forward(gen, lab, domain_vectors(1, 3, 2)), _forward(gen, lab, mixture_vectors(3, 2))
    assert (own - mix).abs().max() > 1e-3  # the domains differ, so guidance has something to amplify
    torch.manual_seed(1)
    x = torch.cat([torch.randn(2, 1, 8, 8), encode_labels(lab, 3)], dim=1)
    t = torch.full((1,), 500)  # DiffusionInferer passes one timestep for the batch
    with torch.no_grad():
        assert torch.equal(domain_guided(gen, domain_vectors(1, 3, 2), 0.0)(x, timesteps=t), gen(x, t, domain=domain_vectors(1, 3, 2)))
        for w in (0.5, 2.0):
            guided = domain_guided(gen, domain_vectors(1, 3, 2), w)(x, timesteps=t)
            assert torch.allclose(guided, own + w * (own - mix), atol=1e-5)
            assert torch.allclose((guided - mix).norm(), (1 + w) * (own - mix).norm(), rtol=1e-4)


def test_sampling_with_guidance_changes_only_what_the_domains_change():
    """Through sample_images: with every domain modulated alike (f(x, d) = f(x, d_mix)) guidance draws the same images;
    with distinct domains it draws others."""
    sched, lab = sampling_scheduler(DiffusionConfig.from_dict({"scheduler": "rflow", "sample_steps": 3})), _labels(2)
    gen = _generator(num_domains=3)
    plain, guided = (sample_images(gen, sched, lab, domain_index=2, seed=4, guidance=w) for w in (0.0, 1.0))
    assert (plain - guided).abs().max() > 1e-3
    with torch.no_grad():
        for mod in gen.modulation:  # one column for every domain: the modulation no longer depends on the vector
            mod.proj.weight.copy_(mod.proj.weight[:, :1].expand_as(mod.proj.weight))
    plain, guided = (sample_images(gen, sched, lab, domain_index=2, seed=4, guidance=w) for w in (0.0, 1.0))
    assert torch.allclose(plain, guided, atol=1e-5)


def test_participation_mean_keeps_an_entry_that_one_site_trains_whole():
    diffs = [{"shared": np.array([1.0, 2.0], np.float32), "col": np.array([[3.0, 0.0]], np.float32), "n": np.array(5)},
             {"shared": np.array([3.0, 6.0], np.float32), "col": np.array([[0.0, 8.0]], np.float32), "n": np.array(7)}]
    out = participation_mean(diffs, [1.0, 3.0])
    np.testing.assert_allclose(out["shared"], [(1 + 9) / 4, (2 + 18) / 4])  # both sites changed it: weighted mean
    np.testing.assert_allclose(out["col"], [[3.0, 8.0]])  # each column changed by one site only: that site's update
    assert out["n"] == 5 and out["shared"].dtype == np.float32
    with pytest.raises(ValueError, match="one non-negative weight"):
        participation_mean(diffs, [1.0])


def test_only_the_own_domain_column_of_the_domain_module_learns_at_a_site():
    gen = _generator(num_domains=3, perturb=False)
    before = state_to_numpy(gen)
    lab = _labels(4)
    data = [{"image": torch.rand(1, 8, 8), "label": lab[i]} for i in range(4)]
    cfg = DiffusionConfig.from_dict({"generator": TINY, "scheduler": "rflow"})
    train_generator(gen, training_scheduler(cfg), torch.optim.Adam(gen.parameters(), lr=1e-2),
                    cycle(lambda e: make_loader(data, 2, True, seed=e)), 3, domain_index=1)
    after = state_to_numpy(gen)
    for i in range(len(gen.modulation)):
        key = f"modulation.{i}.proj.weight"
        change = np.abs(after[key] - before[key]).sum(axis=0)  # per domain column
        assert change[1] > 0 and change[0] == 0 and change[2] == 0, (key, change)


def test_generator_optimizer_gives_the_domain_module_its_own_rate():
    cfg = DiffusionConfig.from_dict({"generator": TINY, "lr": 1e-3, "domain_lr": 5e-2})
    joint, plain = _generator(num_domains=2, perturb=False), _generator(perturb=False)
    groups = generator_optimizer(joint, cfg).param_groups
    assert [g["lr"] for g in groups] == [1e-3, 5e-2]
    assert {id(p) for p in groups[1]["params"]} == {id(p) for p in joint.modulation.parameters()}
    assert sum(len(g["params"]) for g in groups) == len(list(joint.parameters()))
    assert [g["lr"] for g in generator_optimizer(plain, cfg).param_groups] == [1e-3]  # FedST-separate: no domain module
    with pytest.raises(ConfigError, match="domain_lr"):
        DiffusionConfig.from_dict({"domain_lr": 0})


# ---- Eq. 2 ----------------------------------------------------------------------------------------
class _Echo(torch.nn.Module):
    """Returns input channel ``channel``: the noisy image (0) or the first label channel (1)."""

    def __init__(self, channel):
        super().__init__()
        self.channel = channel

    def forward(self, x, timesteps, context=None):
        return x[:, self.channel:self.channel + 1]


def test_simple_loss_against_a_hand_computed_case():
    # linear betas [0.1, 0.3] -> alphas_cumprod [0.9, 0.63]; at t = 1: x_t = sqrt(.63) x0 + sqrt(.37) eps
    sched = DDPMScheduler(num_train_timesteps=2, schedule="linear_beta", beta_start=0.1, beta_end=0.3)
    x0, eps = torch.ones(1, 1, 2, 2), -torch.ones(1, 1, 2, 2)
    cond = encode_labels(torch.zeros(1, 1, 2, 2, dtype=torch.long), 2)  # channel 0 = +1, channel 1 = -1
    t = torch.tensor([1])
    x_t = math.sqrt(0.63) - math.sqrt(0.37)  # the echo model predicts x_t; the target is eps = -1
    assert simple_loss(_Echo(0), sched, x0, cond, eps, t).item() == pytest.approx((x_t + 1) ** 2, rel=1e-5)  # 1.40529
    assert simple_loss(_Echo(0), sched, x0, cond, eps, t, kind="l1").item() == pytest.approx(abs(x_t + 1), rel=1e-5)
    # the label map reaches the network concatenated after the noisy image: channel 1 is the encoded class 0 = +1
    assert simple_loss(_Echo(1), sched, x0, cond, eps, t).item() == pytest.approx(4.0)
    # at t = 0: x_t = sqrt(.9) x0 + sqrt(.1) eps
    assert simple_loss(_Echo(0), sched, x0, cond, eps, torch.tensor([0])).item() == pytest.approx((math.sqrt(0.9) - math.sqrt(0.1) + 1) ** 2, rel=1e-5)
    # rectified flow: x_t = (1 - t/T) x0 + (t/T) eps, target x0 - eps = 2
    rf = RFlowScheduler(num_train_timesteps=4, use_discrete_timesteps=True, spatial_dim=2)
    x_rf = 0.75 * 1 + 0.25 * -1
    assert simple_loss(_Echo(0), rf, x0, cond, eps, torch.tensor([1])).item() == pytest.approx((x_rf - 2) ** 2, rel=1e-5)


def test_generator_training_lowers_l_simple_and_sampling_is_seeded():
    cfg = DiffusionConfig.from_dict({"generator": TINY, "scheduler": "rflow", "sample_steps": 4, "lr": 3e-3})
    torch.manual_seed(0)
    gen = build_style_generator(generator_args(cfg, 1, 3))
    lab = _labels(16)
    images = torch.where(lab == 1, 0.8, torch.where(lab == 2, 0.2, 0.5)).float()
    data = [{"image": images[i], "label": lab[i]} for i in range(16)]
    losses = train_generator(gen, training_scheduler(cfg), torch.optim.Adam(gen.parameters(), lr=cfg.lr),
                             cycle(lambda e: make_loader(data, 8, True, seed=e)), 60)
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])
    a = sample_images(gen, sampling_scheduler(cfg), lab[:2], seed=3)
    b = sample_images(gen, sampling_scheduler(cfg), lab[:2], seed=3)
    assert a.shape == (2, 1, 8, 8) and torch.equal(a, b) and 0 <= a.min() and a.max() <= 1
    with pytest.raises(ConfigError, match="multiples of 2"):
        sample_images(gen, sampling_scheduler(cfg), torch.zeros(1, 1, 7, 8, dtype=torch.long))


def test_diffusion_config_names_bad_keys():
    with pytest.raises(ConfigError, match="'diffusion.scheduler'"):
        DiffusionConfig.from_dict({"scheduler": "euler"})
    with pytest.raises(ConfigError, match="unknown key"):
        DiffusionConfig.from_dict({"steps": 3})
    with pytest.raises(ConfigError, match="cannot exceed"):
        DiffusionConfig.from_dict({"train_timesteps": 10, "sample_steps": 20})


def test_sync_steps_split_a_round_into_exchanges():
    assert exchange_steps(DiffusionConfig.from_dict({"steps_per_round": 80, "sync_steps": 5})) == [5] * 16
    assert exchange_steps(DiffusionConfig.from_dict({"steps_per_round": 12, "sync_steps": 5})) == [5, 5, 2]
    assert exchange_steps(DiffusionConfig.from_dict({"steps_per_round": 80, "sync_steps": 0})) == [80]  # the paper's: one exchange per round
    assert exchange_steps(DiffusionConfig.from_dict({"steps_per_round": 3, "sync_steps": 5})) == [3]
    with pytest.raises(ConfigError, match="'diffusion.sync_steps'"):
        DiffusionConfig.from_dict({"sync_steps": -1})


def test_sync_layers_domain_moves_the_whole_generator_once_per_round():
    cfg = {"steps_per_round": 12, "sync_steps": 5}
    assert exchange_plan(DiffusionConfig.from_dict(cfg)) == [(5, "all", "all"), (5, "all", "all"), (2, "all", "all")]
    assert exchange_plan(DiffusionConfig.from_dict({**cfg, "sync_layers": "domain"})) == [
        (5, "all", "domain"), (5, "domain", "domain"), (2, "domain", "all")]
    assert exchange_plan(DiffusionConfig.from_dict({**cfg, "sync_steps": 0, "sync_layers": "domain"})) == [(12, "all", "all")]
    with pytest.raises(ConfigError, match="'diffusion.sync_layers'"):
        DiffusionConfig.from_dict({"sync_layers": "shared"})


def test_the_domain_part_is_the_modulation_that_takes_the_domain_vector():
    gen = _generator(num_domains=3)
    state = state_to_numpy(gen)
    domain = select_entries(state, "domain")
    assert domain and set(domain) == {k for k in state if k.startswith("modulation.")} and select_entries(state, "all") == state
    # exactly the parameters whose gradient depends on the domain vector's entries: a Linear from the one-hot vector
    assert all(state[k].shape[-1] == 3 for k in domain if k.endswith(".weight"))
    assert payload_bytes(domain) < 0.05 * payload_bytes(state)
    assert not any(is_domain_entry(k) for k in state_to_numpy(_generator(num_domains=0)))


def test_proximal_term_pulls_the_shared_layers_and_leaves_the_domain_module_free():
    gen = _generator(num_domains=2, perturb=False)
    anchor = proximal_anchor(gen)
    assert anchor and not any(is_domain_entry(k) for k in anchor)
    assert proximal_term(gen, anchor, 10.0).item() == 0.0
    with torch.no_grad():
        for name, p in gen.named_parameters():
            p.add_(1.0 if not is_domain_entry(name) else 5.0)
    shared = sum(p.numel() for n, p in gen.named_parameters() if not is_domain_entry(n))
    assert proximal_term(gen, anchor, 2.0).item() == pytest.approx(shared, rel=1e-5)  # 2 / 2 * 1^2 per shared entry

    def drift(mu):
        gen = _generator(num_domains=2)
        start = proximal_anchor(gen)
        cfg = DiffusionConfig.from_dict({"generator": TINY, "lr": 1e-2})
        data = [{"image": torch.rand(1, 8, 8), "label": _labels(1)[0]} for _ in range(4)]
        train_generator(gen, training_scheduler(cfg), generator_optimizer(gen, cfg), cycle(lambda e: make_loader(data, 2, False)),
                        20, domain_index=1, prox_mu=mu)
        params = dict(gen.named_parameters())
        return sum(float(((params[n].detach() - a) ** 2).sum()) for n, a in start.items())

    assert drift(100.0) < 0.5 * drift(0.0)


@pytest.mark.parametrize("kind", ["mse", "l1"])
def test_one_pass_losses_equal_the_two_passes_in_value_and_gradient(kind):
    """FedST-join's local step computes L_simple and the other-domain term in one forward pass over both halves: the
    same values and the same gradients as the two functions that define them (a term lost or a half swapped differs)."""
    cfg = DiffusionConfig.from_dict({"generator": TINY})
    sched = training_scheduler(cfg)
    images, cond = torch.rand(4, 1, 8, 8) * 2 - 1, encode_labels(_labels(4), 3)
    noise, t = torch.randn(4, 1, 8, 8), torch.tensor([10, 200, 500, 900])
    gen = _generator(num_domains=2).train()
    ref = _generator(num_domains=2, seed=1)  # another generator: the other-domain term is not zero
    own, other = domain_vectors(1, 2, 4), domain_vectors(0, 2, 4)

    def grads(loss):
        gen.zero_grad()
        loss.backward()
        return [p.grad.clone() for p in gen.parameters()]

    value, kept = simple_and_other_domain_losses(gen, ref, sched, images, cond, noise, t, own, other, kind)
    one_pass = grads(value + 5.0 * kept)
    expected_value = simple_loss(gen, sched, images, cond, noise, t, own, kind)
    expected_kept = other_domain_term(gen, ref, sched, images, cond, noise, t, other)
    assert value.item() == pytest.approx(expected_value.item(), rel=1e-5) and kept.item() > 0
    assert kept.item() == pytest.approx(expected_kept.item(), rel=1e-5)
    two_passes = grads(expected_value + 5.0 * expected_kept)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(one_pass, two_passes))


def test_keeping_the_other_domains_keeps_their_predictions_and_lets_the_own_domain_move():
    cfg = DiffusionConfig.from_dict({"generator": TINY, "lr": 1e-2, "domain_lr": 1e-2})
    sched = training_scheduler(cfg)
    lab = _labels(4)
    images, cond = torch.rand(4, 1, 8, 8) * 2 - 1, encode_labels(lab, 3)
    noise, t = torch.randn(4, 1, 8, 8), torch.tensor([10, 200, 500, 900])
    gen = _generator(num_domains=2)
    assert other_domain_term(gen, frozen_copy(gen), sched, images, cond, noise, t, domain_vectors(0, 2, 4)).item() == 0.0

    def moved(weight):
        """How far 30 steps at domain 1 move the generator's prediction for domain 0 and for domain 1 itself."""
        gen = _generator(num_domains=2)
        ref = frozen_copy(gen)
        data = [{"image": (images[i] + 1) / 2, "label": lab[i]} for i in range(4)]
        train_generator(gen, sched, generator_optimizer(gen, cfg), cycle(lambda e: make_loader(data, 2, False)), 30,
                        domain_index=1, keep_other_domains=weight)
        return [other_domain_term(gen, ref, sched, images, cond, noise, t, domain_vectors(d, 2, 4)).item() for d in (0, 1)]

    free, kept = moved(0.0), moved(100.0)
    assert kept[0] < 0.5 * free[0] and kept[1] > kept[0], (free, kept)


def _join_controller(overrides, sites=("site-1", "site-2")):
    ctrl = FedSTJoinController(num_rounds=3, preset="fedst_tiny", overrides=overrides)
    ctrl.site_names = list(sites)
    ctrl.parts = {P.SEG: {"w": np.zeros(3, np.float32)}, P.GEN: state_to_numpy(_generator(num_domains=len(sites)))}
    return ctrl


@pytest.mark.parametrize("sync_layers", ["all", "domain"])
def test_join_bytes_predicted_match_what_each_exchange_moves(sync_layers):
    ctrl = _join_controller({"diffusion": {"sync_layers": sync_layers}})
    gen = ctrl._on_the_wire(ctrl.parts[P.GEN])  # fedst_tiny sends float16
    G, D = payload_bytes(gen), payload_bytes(select_entries(gen, "domain"))
    plan = ctrl.plan(ctrl.rounds_in_job - 1)
    per_round = sum(payload_bytes(flatten({P.GEN: select_entries(gen, down)})) + payload_bytes(flatten({P.GEN: select_entries(gen, up)}))
                    for _, down, up in plan)
    assert ctrl.predicted_generator_bytes() == len(ctrl.site_names) * ctrl.rounds_in_job * per_round
    E = len(plan)
    assert per_round == (2 * E * G if sync_layers == "all" else 2 * G + 2 * (E - 1) * D)
    assert ctrl.cost_terms()["domain_only_exchanges"] == (0 if sync_layers == "all" else ctrl.rounds_in_job * (E - 1))


def test_warmup_sync_steps_split_only_the_generator_only_rounds():
    cfg = {"steps_per_round": 100, "sync_steps": 34, "warmup_rounds": 3}
    assert exchange_steps(DiffusionConfig.from_dict(cfg), warmup=True) == [34, 34, 32]  # null: the rounds' own split
    cfg["warmup_sync_steps"] = 20
    assert exchange_steps(DiffusionConfig.from_dict(cfg), warmup=True) == [20] * 5
    assert exchange_steps(DiffusionConfig.from_dict(cfg)) == [34, 34, 32]
    ctrl = _join_controller({"diffusion": {"steps_per_round": 100, "sync_steps": 34, "warmup_sync_steps": 20, "warmup_rounds": 2}})
    assert [len(ctrl.plan(r)) for r in range(ctrl.rounds_in_job)] == [5, 5] + [3] * ctrl.num_rounds
    assert ctrl.exchanges_in_job == 10 + 3 * ctrl.num_rounds
    g = ctrl.generator_size()
    assert ctrl.predicted_generator_bytes() == 2 * len(ctrl.site_names) * ctrl.exchanges_in_job * g
    with pytest.raises(ConfigError, match="'diffusion.warmup_sync_steps'"):
        DiffusionConfig.from_dict({"warmup_sync_steps": -1})


def test_a_join_generator_frozen_after_its_warmup_goes_down_once_with_the_sample_task():
    """``diffusion.segmentation_steps`` 0: no generator exchange in the segmentation rounds; the finished generator goes
    to each site once, with its first ``sample`` task, and the byte prediction counts that download (c G)."""
    cfg = {"steps_per_round": 100, "sync_steps": 34, "warmup_rounds": 2}
    assert exchange_steps(DiffusionConfig.from_dict({**cfg, "segmentation_steps": 50})) == [34, 16]
    assert exchange_steps(DiffusionConfig.from_dict({**cfg, "segmentation_steps": 50}), warmup=True) == [34, 34, 32]
    ctrl = _join_controller({"diffusion": {**cfg, "segmentation_steps": 0}})
    warmup = ctrl.diffusion.warmup_rounds
    assert [len(ctrl.plan(r)) for r in range(ctrl.rounds_in_job)] == [3] * warmup + [0] * ctrl.num_rounds
    c, g = len(ctrl.site_names), ctrl.generator_size()
    assert ctrl.predicted_generator_bytes() == 2 * c * 3 * warmup * g + c * g
    ctrl.held = {s: {} for s in ctrl.site_names}  # as _start sets it up
    first = ctrl._sample_payload("site-1", warmup)
    wire = flatten({P.GEN: ctrl._on_the_wire(ctrl.parts[P.GEN])})
    assert set(first) == set(wire) and all(np.array_equal(first[k], wire[k]) for k in wire)
    assert ctrl._sample_payload("site-1", warmup + 1) == {}  # once
    assert set(ctrl._sample_payload("site-2", warmup + 1)) == set(wire)
    training = _join_controller({"diffusion": cfg})  # the generator trains every round: the sites hold the last exchange's
    training.held = {s: {} for s in training.site_names}
    assert training._sample_payload("site-1", warmup) == {} and training.final_downloads_in_job == 0
    with pytest.raises(ConfigError, match="would never train"):
        DiffusionConfig.from_dict({"segmentation_steps": 0, "warmup_rounds": 0})


def test_a_join_site_samples_with_the_finished_generator_the_sample_task_brings(tmp_path, monkeypatch):
    """The sampling executor keeps the generator a ``sample`` task carries (FedST-join frozen after its warm-up) and
    draws the cross-domain images with it, not with the one of its last generator exchange."""
    monkeypatch.chdir(tmp_path)
    _, gen = _tiny_join_generator()
    state = state_to_numpy(gen)
    ex = StyleSamplingExecutor(preset="fedst_tiny", device="cpu", overrides={"diffusion": {"num_synthetic": 3}})
    ex.site, ex.data = "site-1", load_site("site-1", ex.cfg["data"])
    ex.setup(FLContext())
    stale = {k: np.zeros_like(v) for k, v in state.items()}  # what the last exchange left in the site's cache
    ex.cache.put_generator(JOIN_KEY, stale, 1)
    sites, classes = ["site-1", "site-2"], {"site-1": [0, 1, 2], "site-2": [0, 1, 2]}
    task = FLModelUtils.to_shareable(FLModel(params=flatten({P.GEN: state}), current_round=2,
                                             meta={P.VARIANT: "join", P.SITES: sites, P.CLASSES: classes, P.REFRESH: True}))
    ex.sample(task, FLContext(), Signal())
    assert ex.cache.generator_version(JOIN_KEY) == 2
    cached = ex.cache.synthetic("site-2")
    expected, _ = ex.draw("site-2", sites, {"state": {k: torch.as_tensor(v) for k, v in state.items()}}, classes["site-2"], True, 2)
    assert cached is not None and torch.allclose(torch.as_tensor(cached["images"]), expected, atol=1e-5)


def test_a_domain_exchange_averages_only_the_domain_modulation():
    ctrl = _join_controller({"diffusion": {"sync_layers": "domain"}})
    before = {k: v.copy() for k, v in ctrl.parts[P.GEN].items()}
    domain = select_entries(before, "domain")
    diffs = [{k: np.ones_like(v) * (i + 1) for k, v in domain.items()} for i in range(2)]
    results = {s: FLModel(params=flatten({P.GEN: d})) for s, d in zip(ctrl.site_names, diffs)}
    after = ctrl._combine_generator(results, "domain")
    assert all(np.allclose(after[k], before[k] + 1.5) for k in domain)
    assert all(np.array_equal(after[k], before[k]) for k in before if k not in domain)
    with pytest.raises(Exception, match="asked for the 'all' part"):
        ctrl._combine_generator(results, "all")


def test_a_float16_exchange_halves_the_generator_bytes_and_the_server_keeps_float32():
    wide, narrow = (_join_controller({"diffusion": {"exchange_dtype": dtype}}) for dtype in ("float32", "float16"))
    assert narrow.predicted_generator_bytes() * 2 == wide.predicted_generator_bytes() > 0
    assert all(v.dtype == np.float16 for v in narrow._on_the_wire(narrow.parts[P.GEN]).values())
    assert all(v.dtype == np.float32 for v in wide._on_the_wire(wide.parts[P.GEN]).values())
    assert all(v is wide.parts[P.GEN][k] for k, v in wide._on_the_wire(wide.parts[P.GEN]).items())  # float32: no copy
    before = {k: v.copy() for k, v in narrow.parts[P.GEN].items()}
    diffs = [in_exchange_dtype({k: np.full_like(v, 0.25 * (i + 1)) for k, v in before.items()}, "float16") for i in range(2)]
    results = {s: FLModel(params=flatten({P.GEN: d})) for s, d in zip(narrow.site_names, diffs)}
    after = narrow._combine_generator(results)
    assert all(after[k].dtype == before[k].dtype == np.float32 and np.allclose(after[k], before[k] + 0.375) for k in before)
    mixed = in_exchange_dtype({"w": np.ones(3, np.float32), "n": np.arange(3)}, "float16")
    assert mixed["w"].dtype == np.float16 and mixed["n"].dtype == np.arange(3).dtype
    with pytest.raises(PayloadError, match=r"\['big'\] overflow .*'float16'"):  # would travel as inf
        in_exchange_dtype({"w": np.ones(3, np.float32), "big": np.array([1e6], np.float32)}, "float16")


def test_join_generator_bytes_counts_domain_only_exchanges():
    assert comm.join_generator_bytes(2, 5, 1000) == 2 * 2 * 5 * 1000
    assert comm.join_generator_bytes(2, 5, 1000, partial=75, domain_bytes=10) == 2 * 2 * (5 * 1000 + 75 * 10)
    with pytest.raises(ConfigError):
        comm.join_generator_bytes(2, 5, 1000, partial=-1, domain_bytes=10)


# ---- Eq. 3 ----------------------------------------------------------------------------------------
def test_dicefocal_is_softmax_dice_plus_softmax_focal():
    torch.manual_seed(0)
    logits, lab = torch.randn(2, 3, 8, 8), _labels(2)
    expected = DiceLoss(to_onehot_y=True, softmax=True)(logits, lab) + FocalLoss(to_onehot_y=True, use_softmax=True)(logits, lab)
    assert make_loss("dicefocal", "segmentation")(logits, lab).item() == pytest.approx(expected.item(), rel=1e-6)


def test_eq3_is_local_plus_lambda_cross_domain():
    torch.manual_seed(0)
    loss = make_loss("dicefocal", "segmentation")
    real, syn, lab_r, lab_s = torch.randn(2, 3, 8, 8), torch.randn(2, 3, 8, 8), _labels(2), _labels(2).flip(-1)
    lds, cds = loss(real, lab_r).item(), loss(syn, lab_s).item()
    assert segmentation_loss(loss, real, lab_r, syn, lab_s, 0.5).item() == pytest.approx(lds + 0.5 * cds, rel=1e-6)
    assert segmentation_loss(loss, real, lab_r, syn, lab_s, 0.0).item() == pytest.approx(lds, rel=1e-6)
    assert segmentation_loss(loss, real, lab_r, None, None, 1.0).item() == pytest.approx(lds, rel=1e-6)


def test_cross_domain_term_enters_training_through_train_epochs():
    spec = get_preset("fedst_tiny")["model"]
    lab = _labels(4, 16)
    real = [{"image": torch.rand(1, 16, 16), "label": lab[i]} for i in range(4)]
    syn = [{"image": torch.rand(1, 16, 16), "label": lab[i].flip(-1)} for i in range(4)]
    loss = make_loss("dicefocal", "segmentation")

    def run(lam):
        torch.manual_seed(0)
        model = build_from_spec(spec)
        term = CrossDomainTerm(loss, cycle(lambda e: make_loader(syn, 2, False)), lam)
        stats = train_epochs(model, make_loader(real, 2, False), loss, make_optimizer("adam", model.parameters(), 1e-2), epochs=1, extra_loss=term)
        return state_to_numpy(model), stats, term

    w0, s0, t0 = run(0.0)
    w1, s1, t1 = run(1.0)
    assert len(t1.values) == s1.steps == 2
    # step 1's loss is L_LDS + lambda L_CDS of the same initial model
    assert s1.losses[0] == pytest.approx(s0.losses[0] + t1.values[0], rel=1e-5)
    assert any(not np.allclose(w0[k], w1[k]) for k in w0)


# ---- communication cost ---------------------------------------------------------------------------
def test_eq4_crossover_matches_the_paper_counting():
    g = 1000
    for c in range(2, 40):
        for m in range(0, 30):
            cheaper = comm.paper_join_bytes(c, m, g) < comm.separate_generator_bytes(c, g)
            assert cheaper == comm.eq4_join_cheaper(m, c), (c, m)
            # this implementation's join saves the final download: cheaper iff m < c / 2
            assert (comm.join_generator_bytes(c, m, g) < comm.separate_generator_bytes(c, g)) == (m < c / 2)
    # Fig. 9c: 50 rounds -> join cheaper from 102 sites on (paper: "exceeds 100")
    assert not comm.eq4_join_cheaper(50, 101) and comm.eq4_join_cheaper(50, 102)
    assert comm.store_shares(10, 0) == 1 and comm.store_shares(10, 3) == 4 and comm.store_shares(1, 3) == 1


def _separate_controller(sites, gen_params, versions):
    ctrl = FedSTSeparateController(num_rounds=3, preset="fedst_tiny")
    ctrl.site_names = sites
    ctrl.parts = {P.SEG: {"w": np.zeros(3, np.float32)}}
    ctrl.parts.update({P.store_prefix(i): gen_params for i in range(len(sites))})
    ctrl.versions = dict(versions)
    ctrl.held = {s: {} for s in sites}
    return ctrl


@pytest.mark.parametrize("c", [2, 3, 5])
def test_separate_store_sharing_costs_c_squared_generators(c):
    gen = state_to_numpy(_generator(perturb=False))
    G = payload_bytes(gen)
    sites = [f"hospital-{chr(97 + i)}" for i in range(c)]
    ctrl = _separate_controller(sites, gen, {s: 0 for s in sites})
    ledger = comm.Ledger()
    for s in sites:  # upload: each site sends its generator once (FULL weights)
        ledger.record(0, P.TRAIN_GENERATOR, s, "generator", 0, payload_bytes(flatten({P.GEN: gen})))
    for rnd in range(3):  # the store goes out once; later rounds send nothing new
        for s in sites:
            ledger.record(rnd, P.SAMPLE, s, "generator", payload_bytes(ctrl._store_payload(s)), 0)
    assert ledger.total("generator") == comm.separate_generator_bytes(c, G) == c * c * G
    # a refresh (new versions) shares the store again
    ctrl.versions = {s: 2 for s in sites}
    assert sum(payload_bytes(ctrl._store_payload(s)) for s in sites) == c * (c - 1) * G


def test_sites_with_different_image_sizes_are_refused():
    ctrl = _separate_controller(["a", "b"], {}, {})
    ctrl.classes, ctrl.image_size, ctrl.image_size_of = {}, None, {}
    ctrl._note_site("a", FLModel(params={}, meta={P.SUMMARY: {"image_size": [32, 32], "classes": [0, 1, 2]}}))
    with pytest.raises(ConfigError, match=r"a: 32x32, b: 64x64"):
        ctrl._note_site("b", FLModel(params={}, meta={P.SUMMARY: {"image_size": [64, 64]}}))


# ---- saved files ----------------------------------------------------------------------------------
def _save(tmp_path, variant="separate", preset="fedst_tiny", sites=("site-1", "site-2"), classes=None):
    sites = list(sites)
    join = variant == "join"
    args = fedst_generator_args(preset, None, len(sites) if join else 0)
    torch.manual_seed(0)
    seg = state_to_numpy(build_from_spec(get_preset(preset)["model"]))
    gens = {s: state_to_numpy(build_style_generator(args)) for s in sites}
    path = tmp_path / f"{variant}.pt"
    save_result(path, description=fedst_description(preset, None, variant), sites=sites, generator_args=args, segmentation=seg,
                generators=None if join else gens, generator_state=gens[sites[0]] if join else None,
                trained_classes=classes or {s: [0, 1, 2] for s in sites}, image_size=[32, 32], round_num=3)
    return path


@pytest.mark.parametrize("variant", ["separate", "join"])
def test_saved_file_reloads_predicts_and_samples(tmp_path, variant):
    path = _save(tmp_path, variant)
    result = load_result(path)
    assert result.kind == {"separate": "fedst_style_store", "join": "fedst_join_generator"}[variant]
    assert result.domains == ["site-1", "site-2"] and result.info["round"] == 3
    (label, model), = result.predictors({})
    assert model(torch.rand(1, 1, 32, 32)).shape == (1, 3, 32, 32)
    images = result.sample([_labels(1, 32)[0], _labels(1, 32)[0]], {"domain": "site-2", "seed": 0})
    assert len(images) == 2 and images[0].shape == (1, 32, 32)
    with pytest.raises(ConfigError, match=r"no generator for domain 'site-9'.*\['site-1', 'site-2'\]"):
        result.sample([_labels(1, 32)[0]], {"domain": "site-9"})
    with pytest.raises(DataError, match="trained on 32x32"):
        result.sample([_labels(1, 16)[0]], {"domain": "site-1"})
    with pytest.raises(ConfigError, match="--domain"):
        result.sample([_labels(1, 32)[0]], {})


def _tiny_join_generator():
    """A two-domain generator of ``fedst_tiny``'s shape (what a join file of that preset holds), its arguments, and
    weights that make the domains draw apart."""
    args = fedst_generator_args("fedst_tiny", None, 2)
    torch.manual_seed(0)
    return args, _perturbed(build_style_generator(args))


def test_a_join_file_samples_with_its_jobs_domain_guidance(tmp_path):
    """`medflare sample` draws a site's style as the job's sites did: with the saved ``diffusion.domain_guidance``."""
    args, gen = _tiny_join_generator()
    labels = [_labels(1, 32)[0], _labels(1, 32)[0]]
    drawn = {}
    for w in (0.0, 2.0):
        path = tmp_path / f"join_w{w}.pt"
        save_result(path, description=fedst_description("fedst_tiny", {"diffusion": {"domain_guidance": w}}, "join"),
                    sites=["site-1", "site-2"], generator_args=args, segmentation=state_to_numpy(build_from_spec(get_preset("fedst_tiny")["model"])),
                    generator_state=state_to_numpy(gen), trained_classes={"site-1": [0, 1, 2], "site-2": [0, 1, 2]}, image_size=[32, 32])
        drawn[w] = torch.stack(load_result(path).sample(labels, {"domain": "site-2", "seed": 0}))
    assert (drawn[0.0] - drawn[2.0]).abs().max() > 1e-3
    sampler = sampling_scheduler(DiffusionConfig.from_preset(get_preset("fedst_tiny")))
    direct = sample_images(gen, sampler, torch.stack(labels), domain_index=1, seed=0, guidance=2.0)
    assert torch.allclose(drawn[2.0], direct, atol=1e-5)


def test_a_site_draws_another_sites_style_with_the_jobs_domain_guidance(tmp_path, monkeypatch):
    """The sampling executor of a FedST-join site passes the job's ``diffusion.domain_guidance`` to the sampler (the
    numbers of RESULTS_fedst.md's "Domain guidance" depend on it), with the seed of that site, style and round."""
    monkeypatch.chdir(tmp_path)  # the executor's style cache folder, outside FLARE: under the working directory
    _, gen = _tiny_join_generator()
    entry = {"state": {k: v.clone() for k, v in gen.state_dict().items()}, "version": 3}
    drawn = {}
    for w in (0.0, 1.0):
        ex = StyleSamplingExecutor(preset="fedst_tiny", device="cpu",
                                   overrides={"diffusion": {"domain_guidance": w, "num_synthetic": 3}})
        ex.site, ex.data = "site-1", load_site("site-1", ex.cfg["data"])
        ex.setup(FLContext())
        drawn[w], labels = ex.draw("site-2", ["site-1", "site-2"], entry, None, True, 4)
    assert labels.shape[0] == 3 and (drawn[0.0] - drawn[1.0]).abs().max() > 1e-3
    direct = sample_images(gen, sampling_scheduler(ex.diffusion), labels, domain_index=1, batch_size=ex.diffusion.sample_batch,
                           seed=stable_seed("fedst-sample", ex.seed, "site-1", "site-2", 4), guidance=1.0)
    assert torch.allclose(drawn[1.0], direct, atol=1e-5)


def test_a_style_store_missing_a_site_and_untrained_classes_are_named(tmp_path):
    path = _save(tmp_path, sites=["site-1"], classes={"site-1": [0, 1]})
    result = load_fedst_result(path)
    with pytest.raises(ConfigError, match="style store holds \\['site-1'\\]"):
        result.sample([_labels(1, 32)[0]], {"domain": "site-2"})
    with pytest.raises(DataError, match=r"generator of 'site-1'.*class\(es\) \[2\]"):
        result.sample([_labels(1, 32)[0]], {"domain": "site-1"})


def test_a_generator_file_from_another_preset_is_refused(tmp_path):
    path = _save(tmp_path, preset="fedst_tiny")
    assert check_compatible(path, "separate", "fedst_tiny", fedst_generator_args("fedst_tiny", None, 0), 3).kind == "fedst_style_store"
    with pytest.raises(ResultFileError, match=r"separate\.pt' \(preset 'fedst_tiny'\) does not fit this job's preset 'fedst': .*channels: file \[8, 16, 16\] vs job \[8, 16, 32, 32\]"):
        check_compatible(path, "separate", "fedst", fedst_generator_args("fedst", None, 0), 3)
    with pytest.raises(ResultFileError, match="FedST-join starts from a fedst_join_generator"):
        check_compatible(path, "join", "fedst_tiny", fedst_generator_args("fedst_tiny", None, 2), 3)
    plain = tmp_path / "model.pt"
    torch.save({"train_conf": {"medflare": describe("fedst_tiny")}, "model": state_to_numpy(build_from_spec(get_preset("fedst_tiny")["model"]))}, plain)
    with pytest.raises(ResultFileError, match="not a FedST"):
        load_fedst_result(plain)


def test_domain_init_std_sets_the_spread_of_the_domain_modulation_at_start():
    """``diffusion.generator.domain_init_std`` reaches every DomainModulation of a join generator through the saved
    constructor arguments; with 0 every domain vector draws through the same (unmodulated) network at start."""
    def gen(std):
        cfg = DiffusionConfig.from_dict({"generator": {"channels": [8, 8], "attention_levels": [False, False],
                                                       "norm_num_groups": 4, "num_head_channels": 4, "domain_init_std": std}})
        torch.manual_seed(0)
        g = build_style_generator(generator_args(cfg, 1, 3, num_domains=3))
        for p in g.unet.out.parameters():  # MONAI starts the output convolution at zero; make the output see the features
            torch.nn.init.normal_(p, std=0.1)
        return g

    stds = {std: [float(m.proj.weight.detach().std()) for m in gen(std).modulation] for std in (0.02, 1.0)}
    assert all(0.5 < s < 1.5 for s in stds[1.0]) and all(s < 0.05 for s in stds[0.02]), stds
    flat = gen(0.0)
    x, t = torch.randn(2, 4, 8, 8), torch.tensor([10, 10])
    same = flat(x, t, domain=domain_vectors(0, 3, 2)), flat(x, t, domain=domain_vectors(2, 3, 2))
    assert torch.equal(*same)
    wide = gen(1.0)
    assert not torch.allclose(wide(x, t, domain=domain_vectors(0, 3, 2)), wide(x, t, domain=domain_vectors(2, 3, 2)))
    with pytest.raises(ConfigError, match="'diffusion.generator.domain_init_std'"):
        DiffusionConfig.from_dict({"generator": {"domain_init_std": -1}})


def test_a_quantized_exchange_keeps_the_servers_copy_equal_to_what_the_site_holds(tmp_path, monkeypatch):
    """``exchange_dtype`` "int4": a site's first download is the whole generator in float16, every later one a 4-bit
    diff from what it holds; the server's copy of each site's generator and the site's own agree bit for bit (so a
    rounding left out of one diff is in the next), a site that missed an exchange gets the whole generator again, and
    a diff to a site that holds nothing is refused. The prediction counts those bytes."""
    monkeypatch.chdir(tmp_path)
    ex = GeneratorTrainingExecutor(preset="fedst_tiny", device="cpu", overrides={"diffusion": {"exchange_dtype": "int4"}})
    ex.site, ex.data = "site-1", load_site("site-1", ex.cfg["data"])
    ex.setup(FLContext())
    with pytest.raises(PayloadError, match="before the whole one"):
        ex._receive_generator(encode({"w": np.ones(3, np.float32)}, 4), diff=True)
    ex._build(2)
    ctrl = _join_controller({"diffusion": {"exchange_dtype": "int4"}})
    ctrl.parts[P.GEN] = state_to_numpy(_perturbed(ex.generator))
    ctrl.copies = {}
    params, kind, copy = ctrl._download("site-1", "all")
    assert kind == ParamsType.FULL and all(v.dtype == np.float16 for v in params.values())
    ex.base = ex._receive_generator(params)
    rng = np.random.default_rng(0)
    for step in range(3):  # the global generator moves; each download is a diff from the copy
        ctrl.copies["site-1"] = copy
        ctrl.parts[P.GEN] = {k: v + 1e-3 * rng.normal(size=v.shape).astype(np.float32) for k, v in ctrl.parts[P.GEN].items()}
        params, kind, copy = ctrl._download("site-1", "all")
        assert kind == ParamsType.DIFF and 7 * payload_bytes(params) < 2 * payload_bytes(ctrl._on_the_wire(ctrl.parts[P.GEN]))
        ex.base = ex._receive_generator(params, diff=True)
        held = state_to_numpy(ex.generator)
        assert all(np.array_equal(copy[k], ex.base[k]) and np.array_equal(held[k], copy[k]) for k in copy)
        assert max(np.abs(copy[k] - ctrl.parts[P.GEN][k]).max() for k in copy) < 2e-3  # within one rounding, not drifting
    assert ctrl._download("site-2", "all")[1] == ParamsType.FULL  # no copy of site-2: the whole generator
    c, m = len(ctrl.site_names), ctrl.exchanges_in_job
    q, full = ctrl.generator_size(), ctrl.full_generator_size()
    assert q == payload_bytes(params) and full == payload_bytes(ctrl._on_the_wire(ctrl.parts[P.GEN]))
    assert ctrl.predicted_generator_bytes() == c * (full + (2 * m - 1) * q)
    assert comm.join_generator_bytes(2, 5, 100, full_bytes=400) == 2 * (400 + 9 * 100)

