"""FedVCK functional core against hand-computed cases: MMD (both kernels), BN-statistic replay (Eq. 4), importance
weights and sampling (Eq. 5-8), prototypes and hard negatives (Eq. 11-14), the relational contrastive loss
(Eq. 15-16), condensation and the server update learning, the reply format, the site filter, the result file."""

import math

import numpy as np
import pytest
import torch
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_context import FLContext
from torch import nn

from medflare import ConfigError, PayloadError
from medflare.common.results import describe, load_result
from medflare.fedvck import protocol as P
from medflare.fedvck.audit import nearest_distances
from medflare.fedvck.augment import DiffAugment, check_strategy
from medflare.fedvck.persistor import save_result
from medflare.fedvck.results import FedVCKResult
from medflare.fedvck.condense import CondensedSet, condense, condensed_sizes, dequantize, quantize
from medflare.fedvck.config import FedVCKConfig
from medflare.fedvck.contrastive import Projector, relation_mask, relational_contrastive_loss
from medflare.fedvck.executor import check_encoder
from medflare.fedvck.filters import CondensedSetFilter, filter_condensed
from medflare.fedvck.importance import ImportanceSampler, class_probabilities, ensemble_error, importance_weights
from medflare.fedvck.latent import bn_statistics
from medflare.fedvck.mmd import MULTIPLIERS, classwise_mmd, mmd2
from medflare.fedvck.prototypes import aggregate_prototypes, feature_prototypes, hard_negatives, logit_prototypes
from medflare.fedvck.protocol import pack_reply, unpack_reply
from medflare.fedvck.update import kept_images, train_global
from medflare.nets import build_model
from medflare.presets import get_preset


# ---- MMD (Eq. 2, 3, 9) ---------------------------------------------------------------------------
def test_linear_mmd_hand_computed():
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    y = torch.tensor([[1.0, 1.0]])
    # mean(x) = (.5, .5), mean(y) = (1, 1): ||diff||^2 = 0.5; via kernel means: K_xx = .5, K_yy = 2, K_xy = 1 -> .5 + 2 - 2
    assert mmd2(x, y, "linear").item() == pytest.approx(0.5)
    assert mmd2(x, x, "linear").item() == pytest.approx(0.0)


def test_gaussian_mmd_hand_computed():
    x = torch.tensor([[0.0], [2.0]])
    y = torch.tensor([[1.0]])
    # stacked [0, 2, 1]: squared distances 4, 1, 1 -> bandwidth sigma^2 = 2*(4+1+1) / (9-3) = 2
    k = lambda d2: sum(math.exp(-d2 / (s * 2.0)) for s in MULTIPLIERS)  # noqa: E731
    kxx = (2 * k(0) + 2 * k(4)) / 4
    kyy = k(0)
    kxy = (k(1) + k(1)) / 2
    assert mmd2(x, y, "gaussian").item() == pytest.approx(kxx + kyy - 2 * kxy, rel=1e-5)
    assert mmd2(y, y, "gaussian").item() == pytest.approx(0.0, abs=1e-6)


def test_gaussian_mmd_sees_more_than_the_mean():
    """Same mean, different spread: the linear kernel sees nothing, the Gaussian kernel does."""
    x = torch.tensor([[-1.0], [1.0]])
    y = torch.tensor([[0.0], [0.0]])
    assert mmd2(x, y, "linear").item() == pytest.approx(0.0)
    assert mmd2(x, y, "gaussian").item() > 0.1


def test_classwise_mmd_sums_over_condensed_classes():
    real = torch.tensor([[0.0], [2.0], [10.0], [30.0]])
    real_labels = torch.tensor([0, 0, 1, 1])
    syn = torch.tensor([[0.0], [20.0]])
    syn_labels = torch.tensor([0, 1])
    total, per_class = classwise_mmd(real, real_labels, syn, syn_labels, "linear")
    # class 0: (1 - 0)^2 = 1; class 1: (20 - 20)^2 = 0
    assert per_class == {0: pytest.approx(1.0), 1: pytest.approx(0.0)}
    assert total.item() == pytest.approx(1.0)
    with pytest.raises(ConfigError, match="class 2"):
        classwise_mmd(real, real_labels, syn, torch.tensor([0, 2]))


def test_unknown_kernel_is_refused():
    with pytest.raises(ConfigError, match="kernel"):
        mmd2(torch.ones(2, 1), torch.ones(1, 1), "rbf")


# ---- latent distribution constraints (Eq. 4) -------------------------------------------------------
def _bn():
    bn = nn.BatchNorm2d(1)
    with torch.no_grad():
        bn.weight.fill_(2.0)
        bn.bias.fill_(1.0)
        bn.running_mean.fill_(100.0)
        bn.running_var.fill_(9.0)
    return bn.eval()


def test_replay_normalises_the_synthetic_batch_with_the_real_batch_statistics():
    bn = _bn()
    real = torch.tensor([0.0, 2.0, 4.0, 6.0]).view(2, 1, 1, 2)  # mean 3, biased variance (9+1+1+9)/4 = 5
    syn = torch.tensor([3.0, 8.0]).view(1, 1, 1, 2)
    with bn_statistics(bn, "record") as stats:
        out_real = bn(real)
    with bn_statistics(bn, "replay", stats):
        out_syn = bn(syn)
    expected = 2 * (torch.tensor([3.0, 8.0]) - 3) / math.sqrt(5 + bn.eps) + 1
    torch.testing.assert_close(out_syn.flatten(), expected)
    torch.testing.assert_close(out_real.flatten(), 2 * (torch.tensor([0.0, 2, 4, 6]) - 3) / math.sqrt(5 + bn.eps) + 1)
    # "own": the synthetic batch with its own statistics (mean 5.5, variance 6.25) -- what Eq. 4 replaces
    with bn_statistics(bn, "own"):
        own = bn(syn)
    torch.testing.assert_close(own.flatten(), 2 * (torch.tensor([3.0, 8.0]) - 5.5) / math.sqrt(6.25 + bn.eps) + 1)
    # the network is left exactly as it was: running statistics, counter, mode, forward
    assert bn.running_mean.item() == 100.0 and bn.running_var.item() == 9.0 and int(bn.num_batches_tracked) == 0
    assert not bn.training
    torch.testing.assert_close(bn(syn).flatten(), 2 * (torch.tensor([3.0, 8.0]) - 100) / 3.0 + 1, atol=1e-4, rtol=1e-4)


def test_replay_covers_every_bn_layer_of_the_encoder_and_passes_gradients():
    torch.manual_seed(0)
    net = build_model("convnet", in_channels=1, num_classes=3, image_size=12, width=4, depth=2).eval()
    real = torch.rand(6, 1, 12, 12)
    with torch.no_grad(), bn_statistics(net, "record") as stats:
        ref = net.features(real)
    assert len(stats.layers) == 2
    with bn_statistics(net, "replay", stats):
        again = net.features(real)  # the real batch with its own recorded statistics reproduces itself
    torch.testing.assert_close(again, ref)
    syn = torch.rand(2, 1, 12, 12, requires_grad=True)
    with bn_statistics(net, "replay", stats):
        replayed = net.features(syn)
    with bn_statistics(net, "own"):
        own = net.features(syn)
    assert not torch.allclose(replayed, own)  # the replay really changed the normalisation
    replayed.sum().backward()
    assert syn.grad is not None and syn.grad.abs().sum() > 0
    with pytest.raises(ConfigError, match="replay"):
        with bn_statistics(net, "replay", None):
            pass


# ---- importance (Eq. 5-8) --------------------------------------------------------------------------
def test_importance_weights_hand_computed():
    now = torch.tensor([[2.0, 0.0], [0.0, 0.0]])
    prev = torch.tensor([[0.0, 0.0], [0.0, 2.0]])
    labels = torch.tensor([0, 0])
    s = 1 / (1 + math.exp(-2))  # softmax([2, 0])[0] = 0.8808
    # image 0: 0.5 * 0.8808 + 0.5 * 0.5; image 1: 0.5 * 0.5 + 0.5 * (1 - 0.8808)
    p0, p1 = 0.5 * s + 0.25, 0.25 + 0.5 * (1 - s)
    err = ensemble_error(now, prev, labels, alpha=0.5)
    torch.testing.assert_close(err, torch.tensor([-math.log(p0), -math.log(p1)]))
    # alpha = 1: the current model alone (Eq. 6)
    torch.testing.assert_close(ensemble_error(now, prev, labels, alpha=1.0), torch.tensor([-math.log(s), -math.log(0.5)]))
    w = importance_weights(err, b=0.7)
    torch.testing.assert_close(w, 1 / (1 + torch.exp(-err + 0.7)))
    assert w[1] > w[0]  # the image the ensemble gets wrong matters more


def test_sampling_probabilities_within_each_class():
    probs = class_probabilities(torch.tensor([0.2, 0.6, 0.5, 0.1, 0.3]), torch.tensor([0, 0, 1, 2, 2]))
    torch.testing.assert_close(probs, torch.tensor([0.25, 0.75, 1.0, 0.25, 0.75], dtype=torch.float64))


def test_sampler_draws_by_p_w_and_uniform_without_weights():
    labels = torch.tensor([0, 0, 1, 1])
    g = torch.Generator().manual_seed(0)
    draws = ImportanceSampler(labels, torch.tensor([0.1, 0.3, 0.5, 0.5])).sample(0, 20000, g)
    assert set(draws.tolist()) <= {0, 1}
    assert (draws == 1).float().mean().item() == pytest.approx(0.75, abs=0.015)
    uniform = ImportanceSampler(labels).sample(1, 20000, g)
    assert set(uniform.tolist()) <= {2, 3} and (uniform == 3).float().mean().item() == pytest.approx(0.5, abs=0.015)


# ---- prototypes and hard negatives (Eq. 11-14) -------------------------------------------------------
def test_logit_prototypes_hand_computed():
    logits = torch.tensor([[1.0, 0, 0], [3.0, 2, 0], [0.0, 0, 4], [0.0, 2, 6]])
    labels = torch.tensor([0, 0, 2, 2])
    protos, counts = logit_prototypes(logits, labels, 3)
    torch.testing.assert_close(protos, torch.tensor([[2.0, 1, 0], [0, 0, 0], [0, 1, 5]]))
    assert counts.tolist() == [2, 0, 2]
    protos, counts = logit_prototypes(logits, labels, 3, classes=[2])  # class 0 held back by the site
    assert counts.tolist() == [0, 0, 2] and protos[0].abs().sum() == 0


def test_aggregate_prototypes_weights_by_counts():
    a = torch.tensor([[1.0, 0], [0, 0]])
    b = torch.tensor([[4.0, 3], [0, 0]])
    protos, total = aggregate_prototypes([a, b], [torch.tensor([1, 0]), torch.tensor([2, 0])])
    # class 0: (1*[1,0] + 2*[4,3]) / 3 = [3, 2]; class 1: nobody holds it
    torch.testing.assert_close(protos, torch.tensor([[3.0, 2.0], [0.0, 0.0]]))
    assert total.tolist() == [3, 0]
    with pytest.raises(PayloadError, match="site 1"):
        aggregate_prototypes([a, torch.zeros(3, 3)], [torch.tensor([1, 0]), torch.tensor([1, 0, 0])])


def test_hard_negatives_top_k_without_the_class_itself():
    p = torch.tensor([[9.0, 5, 1, 7], [2.0, 8, 2, 0], [0.0, 0, 1, 0], [3.0, 1, 6, 9]])
    assert hard_negatives(p, 2) == {0: [3, 1], 1: [0, 2], 2: [0, 1], 3: [2, 0]}  # ties to the lower index
    available = torch.tensor([True, True, False, True])
    assert hard_negatives(p, 2, available) == {0: [3, 1], 1: [0, 3], 3: [0, 1]}


def test_feature_prototypes_are_class_means():
    feats = torch.tensor([[1.0, 1], [3.0, 5], [10.0, 0]])
    protos, present = feature_prototypes(feats, torch.tensor([1, 1, 2]), 3)
    torch.testing.assert_close(protos, torch.tensor([[0.0, 0], [2.0, 3], [10.0, 0]]))
    assert present.tolist() == [False, True, True]


# ---- relational contrastive loss (Eq. 15-16) ------------------------------------------------------------
def test_relational_contrastive_loss_hand_computed():
    protos = torch.tensor([[1.0, 0.0], [0.0, 3.0], [-2.0, 0.0]])  # normalised: (1,0), (0,1), (-1,0)
    relation = relation_mask({0: [1], 1: [0, 2]}, 3)
    assert relation.tolist() == [[True, True, False], [True, True, True], [False, False, False]]
    z = torch.tensor([[5.0, 0.0]])  # cosine 1 with class 0, 0 with class 1
    loss = relational_contrastive_loss(z, torch.tensor([0]), protos, relation, temperature=1.0)
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-1)))  # -log(e / (e + 1))
    z1 = torch.tensor([[0.0, 1.0]])  # class 1 against {1, 0, 2}: cosines 1, 0, 0 at tau 0.5
    loss1 = relational_contrastive_loss(z1, torch.tensor([1]), protos, relation, temperature=0.5)
    assert loss1.item() == pytest.approx(-math.log(math.exp(2) / (math.exp(2) + 2)))
    # a class without hard negatives does not enter; nothing qualifying gives 0
    both = relational_contrastive_loss(torch.cat([z, z]), torch.tensor([0, 2]), protos, relation, 1.0)
    assert both.item() == pytest.approx(loss.item())
    assert relational_contrastive_loss(z, torch.tensor([2]), protos, relation, 1.0).item() == 0.0


def _two_class_images(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, 12, 12, generator=g) * 0.2
    y = torch.arange(n) % 2
    x[y == 1, :, 3:9, 3:9] += 0.7  # class 1: a bright square
    return x.clamp(0, 1), y


def test_server_update_learns_and_trains_the_projector_only_with_l_rc():
    x, y = _two_class_images()
    torch.manual_seed(0)
    model = build_model("convnet", in_channels=1, num_classes=2, image_size=12, width=8, depth=2)
    projector = Projector(model.feature_dim, 16)
    before = {k: v.clone() for k, v in projector.state_dict().items()}
    stats = train_global(model, projector, x, y, steps=40, batch_size=16, lr=0.05, momentum=0.9, weight_decay=0.0)
    assert all(torch.equal(before[k], v) for k, v in projector.state_dict().items())  # beta = 0: no L_rc, projector idle
    assert stats.rc == 0.0 and stats.ce < 0.3
    with torch.no_grad():
        assert (model.eval()(x).argmax(1) == y).float().mean() == 1.0
    protos = torch.stack([model.features(x[y == c]).mean(0) for c in (0, 1)]).detach()
    rel = relation_mask({0: [1], 1: [0]}, 2)
    stats = train_global(model, projector, x, y, steps=10, batch_size=16, lr=0.05, momentum=0.9, weight_decay=0.0,
                         contrastive_weight=0.5, temperature=0.1, protos=protos, relation=rel)
    assert stats.rc > 0 and stats.total == pytest.approx(stats.ce + 0.5 * stats.rc, rel=1e-5)
    assert any(not torch.equal(before[k], v) for k, v in projector.state_dict().items())


# ---- condensation ---------------------------------------------------------------------------------
def test_condensed_sizes_hand_computed():
    counts = {0: 100, 1: 3, 2: 0, 3: 40}
    assert condensed_sizes(counts, 5, 5) == {0: 5, 1: 3, 3: 5}  # ceil(5) = 5; n_c = 3 caps; ceil(2) -> min 5
    assert condensed_sizes(counts, 10, 5) == {0: 10, 1: 3, 3: 5}
    assert condensed_sizes(counts, 100, 1) == {0: 100, 1: 3, 3: 40}
    for bad in (0, -1, 100.5):
        with pytest.raises(ConfigError, match="ipc_percent"):
            condensed_sizes(counts, bad, 5)


def test_quantisation_round_trip_error_is_at_most_half_a_level():
    x = torch.rand(4, 1, 5, 5)
    q = quantize(x)
    assert q.dtype == np.uint8
    assert (dequantize(q) - x).abs().max() <= 0.5 / 255 + 1e-7
    assert quantize(torch.tensor([[[[-0.3, 1.7]]]])).tolist() == [[[[0, 255]]]]


@pytest.mark.parametrize("latent", [True, False])
def test_condensation_lowers_the_loss_and_leaves_the_encoder_alone(latent):
    x, y = _two_class_images(64)
    torch.manual_seed(0)
    model = build_model("convnet", in_channels=1, num_classes=2, image_size=12, width=8, depth=2).eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    cset = CondensedSet({0: 2, 1: 2}, (1, 12, 12), float(x.mean()), float(x.std()), g)
    stats = condense(model, cset, x, y, ImportanceSampler(y), iterations=60, real_batch=16, image_lr=0.5, image_momentum=0.5,
                     clip_norm=10.0, latent_constraints=latent, augment=DiffAugment(""), generator=g)
    assert stats.steps == 60 and stats.last_loss < 0.3 * stats.first_loss
    assert cset.images.min() >= 0 and cset.images.max() <= 1
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert not model.training and all(p.requires_grad for p in model.parameters())
    # class 1's condensed images pick up the bright square of class 1's real images
    centre = cset.images[:, 0, 3:9, 3:9].mean((1, 2))
    assert centre[cset.labels == 1].min() > centre[cset.labels == 0].max()


def test_condensed_images_are_not_copies_of_real_images():
    """The condensed sets a site sends are not copies of its real images, audited as the job makes them: the e2e job's
    rounds of its preset (3 x ``fedvck.iterations`` steps, warm-started, each round with the global model the server
    trained on the previous round's condensed set, importance sampling as the site does it). Every set that leaves stays
    farther from its nearest real image than half the typical spacing of the real images themselves; the same check
    flags a set that copies real images."""
    from medflare.data import load_site
    from medflare.fedvck.condense import predict_logits, stack_dataset
    from medflare.fedvck.executor import DEFAULT_MIN_CLASS_IMAGES

    cfg, rounds = get_preset("fedvck_synthetic_tiny"), 3  # as tests/e2e/test_fedvck.py runs the job
    fv = FedVCKConfig.from_preset(cfg)
    x, y = stack_dataset(load_site("site-4", cfg["data"]).train)
    torch.manual_seed(0)
    model = build_model(cfg["model"]["name"], **cfg["model"]["args"])
    projector = Projector(model.feature_dim, fv.projector_dim)
    counts = {c: int((y == c).sum()) for c in torch.unique(y).tolist()}
    g = torch.Generator().manual_seed(0)
    cset = CondensedSet(condensed_sizes({c: n for c, n in counts.items() if n >= DEFAULT_MIN_CLASS_IMAGES}, fv.ipc_percent, fv.min_ipc),
                        tuple(x.shape[1:]), float(x.mean()), float(x.std()), g)
    augment = DiffAugment(fv.augment)
    spacing = nearest_distances(x, x, exclude_self=True).median()
    previous, accuracy = None, []
    for rnd in range(rounds):
        now = predict_logits(model, x)  # the site's condense task with the global model it received
        weights = importance_weights(ensemble_error(now, now if previous is None else previous, y, fv.alpha), fv.b)
        previous = now
        stats = condense(model, cset, x, y, ImportanceSampler(y, weights), iterations=fv.iterations, real_batch=fv.real_batch,
                         image_lr=fv.image_lr, image_momentum=fv.image_momentum, clip_norm=fv.clip_norm, kernel=fv.kernel,
                         latent_constraints=fv.latent_constraints, augment=augment, generator=g)
        assert stats.steps == fv.iterations
        images, labels = cset.quantized()  # what leaves the site
        sent = dequantize(images)
        nearest = float(nearest_distances(sent, x).min())
        assert nearest > 0.5 * spacing, f"round {rnd}: a condensed image {nearest:.4f} from a real one (real spacing {spacing:.4f})"
        # the server's update: the global model learns from the condensed set alone (Eq. 16's CE term)
        train_global(model, projector, sent, torch.as_tensor(labels), steps=fv.update_steps(len(labels)), batch_size=fv.server_batch,
                     lr=fv.server_lr, momentum=fv.server_momentum, weight_decay=fv.server_weight_decay, augment=augment, generator=g)
        accuracy.append(float((predict_logits(model, x).argmax(1) == y).double().mean()))
    # the last round condensed with a trained encoder: that global model beats the majority class on the real images
    assert accuracy[-2] > max(counts.values()) / len(y) + 0.05, (accuracy, counts)
    copies = dequantize(quantize(x[:5] + 0.01 * torch.randn(5, *x.shape[1:], generator=g)))  # near-copies of 5 patients
    assert nearest_distances(copies, x).max() < 0.5 * spacing


# ---- augmentation ------------------------------------------------------------------------------------
def test_augmentation_is_siamese_differentiable_and_validated():
    assert check_strategy("") == () and check_strategy("crop_flip") == ("crop", "flip")
    with pytest.raises(ConfigError, match="blur"):
        check_strategy("crop_blur", "fedvck.augment")
    x = torch.rand(3, 1, 8, 8, requires_grad=True)
    for op in ("color", "crop", "cutout", "flip", "scale", "rotate"):
        aug = DiffAugment(op)
        params = aug.draw(1, torch.Generator().manual_seed(1))
        out_a, out_b = aug.apply(x, params), aug.apply(x[:1], params)  # one transform for batches of any size
        torch.testing.assert_close(out_a[:1], out_b)
        out_a.sum().backward()
        assert x.grad is not None
        x.grad = None
    assert DiffAugment("").apply(x, DiffAugment("").draw(3)) is x
    flip = DiffAugment("flip")
    torch.testing.assert_close(flip.apply(x, {"op": "flip", "flip": torch.tensor([True])}), x.flip(-1))


# ---- configuration ------------------------------------------------------------------------------------
@pytest.mark.parametrize("change, key", [({"kernel": "rbf"}, "fedvck.kernel"), ({"ipc_percent": 0}, "fedvck.ipc_percent"),
                                         ({"ipc_percent": 120}, "fedvck.ipc_percent"), ({"alpha": 1.5}, "fedvck.alpha"),
                                         ({"iterations": -1}, "fedvck.iterations"), ({"augment": "warp"}, "fedvck.augment"),
                                         ({"importance": "yes"}, "fedvck.importance")])
def test_config_errors_name_the_key(change, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        FedVCKConfig(**change)


def test_config_from_preset_and_overrides():
    cfg = FedVCKConfig.from_preset(get_preset("fedvck_synthetic", {"fedvck": {"kernel": "gaussian", "importance": False}}))
    assert cfg.kernel == "gaussian" and not cfg.importance
    assert FedVCKConfig.from_preset(get_preset("cls_synthetic")) == FedVCKConfig()
    paper = FedVCKConfig.from_preset(get_preset("cls_medmnist_paper"))
    assert paper.ipc_percent == 1.0 and paper.iterations == 5000 and paper.update_steps(1000) == 1000 * 4
    with pytest.raises(ConfigError, match="fedvck.bogus"):
        FedVCKConfig.from_preset({"fedvck": {"bogus": 1}})


def test_encoder_check_names_the_mismatch():
    with pytest.raises(ConfigError, match="num_classes"):
        check_encoder(build_model("convnet", in_channels=1, num_classes=4, image_size=12, width=4, depth=2), 10, "p")
    with pytest.raises(ConfigError, match="features"):
        check_encoder(nn.Linear(3, 10), 10, "p")


# ---- reply, filter, result file --------------------------------------------------------------------------
def _reply(n=4):
    images = np.arange(n * 16, dtype=np.uint8).reshape(n, 1, 4, 4)
    labels = np.array([0, 0, 1, 2][:n])
    return pack_reply(images, labels, np.ones((3, 3), np.float32), np.array([5, 3, 2]), {"accuracy": 0.5, "val_cases": 10})


def test_reply_holds_only_the_allowed_parts_and_round_trips():
    dxo = _reply()
    assert dxo.data_kind == DataKind.COLLECTION
    assert {k: (v.data_kind, sorted(v.data)) for k, v in dxo.data.items()} == {
        "condensed": (P.CONDENSED_SET, ["images", "labels"]), "prototypes": (P.LOGIT_PROTOTYPES, ["counts", "logits"]),
        "metrics": (DataKind.METRICS, ["accuracy", "val_cases"])}
    up = unpack_reply(from_shareable(dxo.to_shareable()).data, "site-x", 3, (1, 4, 4))
    assert up.images.shape == (4, 1, 4, 4) and up.images.max() <= 1 and up.labels.tolist() == [0, 0, 1, 2]
    assert up.counts.tolist() == [5, 3, 2] and up.metrics["accuracy"] == 0.5


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.update(model=DXO(DataKind.WEIGHTS, data={"w": np.ones(1)})), "unexpected parts"),
    (lambda d: d.update(condensed=DXO(DataKind.WEIGHTS, data={"images": 1, "labels": 2})), "CONDENSED_SET"),
    (lambda d: d["condensed"].data.update(labels=np.array([0, 0, 1, 7])), r"\[0, 3\)"),
    (lambda d: d["condensed"].data.update(images=np.zeros((4, 1, 5, 5), np.uint8)), "job's images"),
    (lambda d: d["prototypes"].data.update(counts=np.array([1, -1, 0])), "non-negative"),
])
def test_bad_replies_are_refused_naming_the_site(mutate, match):
    data = dict(_reply().data)
    data = {k: DXO(v.data_kind, dict(v.data)) for k, v in data.items()}
    mutate(data)
    with pytest.raises(PayloadError, match=f"site 'site-x'.*{match}"):
        unpack_reply(data, "site-x", 3, (1, 4, 4))


def test_condensed_set_filter_caps_noises_quantises_and_leaves_other_parts():
    images = np.full((6, 1, 4, 4), 128, np.uint8)
    labels = np.array([0, 0, 0, 1, 1, 2])
    out_x, out_y = filter_condensed(images, labels, max_per_class=2, levels=256, rng=np.random.default_rng(0))
    assert np.bincount(out_y).tolist() == [2, 2, 1] and np.array_equal(out_x, images[:5])
    noisy, _ = filter_condensed(images, labels, noise_std=0.05, rng=np.random.default_rng(0))
    assert noisy.dtype == np.uint8 and 5 < np.abs(noisy.astype(int) - 128).mean() < 20  # ~0.8 * 0.05 * 255
    coarse, _ = filter_condensed(np.arange(16, dtype=np.uint8).reshape(1, 1, 4, 4) * 16, np.array([0]), levels=3)
    assert set(np.unique(coarse).tolist()) <= {0, 128, 255}
    flt = CondensedSetFilter(max_per_class=1, seed=0)
    out = from_shareable(flt.process(_reply().to_shareable(), FLContext())).data
    assert out["condensed"].data["labels"].tolist() == [0, 1, 2]
    assert out["condensed"].get_filter_history() == ["CondensedSetFilter"]
    assert out["prototypes"].data["counts"].tolist() == [5, 3, 2] and not out["prototypes"].get_filter_history()
    for bad in ({"max_per_class": -1}, {"noise_std": -0.1}, {"levels": 1}):
        with pytest.raises(ConfigError):
            CondensedSetFilter(**bad)


def test_result_file_loads_scores_and_samples(tmp_path):
    cfg = get_preset("fedvck_synthetic_tiny")
    torch.manual_seed(0)
    model = build_model(cfg["model"]["name"], **cfg["model"]["args"])
    projector = Projector(model.feature_dim, 8)
    images = np.random.default_rng(0).integers(0, 255, (3, 1, 28, 28)).astype(np.uint8)
    path = tmp_path / "FedVCK_result.pt"
    save_result(path, description=describe("fedvck_synthetic_tiny", kind="fedvck_result"),
                global_state={k: v.numpy() for k, v in model.state_dict().items()}, projector=projector,
                projector_dims=(model.feature_dim, 8), condensed={0: {"site-1": (images, np.array([0, 1, 1]))}},
                sites=["site-1"], round_num=1, metrics={"val_accuracy_pooled": 0.5})
    result = load_result(path)
    assert isinstance(result, FedVCKResult) and result.info["round"] == 1
    parts = result.parts()
    assert "global model" in parts and "projector" in parts and "per class {0: 1, 1: 2}" in parts["condensed round 0"]
    (label, predictor), = result.predictors({})
    x = torch.rand(2, 1, 28, 28)
    torch.testing.assert_close(predictor(x), model.eval()(x))
    samples = result.sample([], {"num": 2})
    assert len(samples) == 2 and samples[0].shape == (1, 28, 28)
    torch.testing.assert_close(samples[1], torch.from_numpy(images[1]).float() / 255)
    xs, ys = result.condensed_images()
    assert xs.shape == (3, 1, 28, 28) and ys.tolist() == [0, 1, 1]


def test_kept_images_window():
    rounds = {r: [(torch.full((1, 1, 2, 2), float(r)), torch.tensor([r]))] for r in range(4)}
    assert kept_images(rounds, 2)[1].tolist() == [2, 3]
    assert kept_images(rounds, 0, before=2)[1].tolist() == [0, 1]
    assert kept_images(rounds, 2, before=1)[1].tolist() == [0]
    assert len(kept_images({}, 2)[1]) == 0


def test_empty_condensed_set_is_a_valid_reply():
    """A site whose every class is below its fedvck_min_class_images sends an empty set and zero counts."""
    dxo = pack_reply(np.zeros((0, 1, 4, 4), np.uint8), np.zeros(0), np.zeros((3, 3)), np.zeros(3, np.int64), {"accuracy": 0.0})
    up = unpack_reply(from_shareable(dxo.to_shareable()).data, "site-x", 3, (1, 4, 4))
    assert up.images.shape == (0, 1, 4, 4) and up.counts.sum() == 0


@pytest.mark.parametrize("overrides, key", [({"fedvck": {"kernel": "laplace"}}, "fedvck.kernel"),
                                            ({"fedvck": {"ipc_percent": 0.0}}, "fedvck.ipc_percent"),
                                            ({"fedvck": {"ipc_percent": 101}}, "fedvck.ipc_percent")])
def test_job_components_refuse_bad_settings_when_built(overrides, key):
    from medflare.fedvck.controller import FedVCKController
    from medflare.fedvck.executor import FedVCKExecutor

    for component in (FedVCKController, FedVCKExecutor):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            component(preset="fedvck_synthetic_tiny", overrides=overrides)
