"""FedIOD's math against hand-computed cases: entropy and JSD with the paper's sign, Eq. 8 per-class weights
normalised across sites (with the discriminator factor), the ensemble A (Eq. 9) and L_mimic (Eq. 10)."""

import math

import pytest
import torch

from medflare import PayloadError
from medflare.fediod import losses as L

BIG = 50.0  # logits this far apart give (numerically) one-hot probabilities


def test_entropy_of_uniform_and_one_hot():
    q = torch.tensor([[0.5, 0.5], [1.0, 0.0], [0.25, 0.75]])
    expected = [math.log(2), 0.0, -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]
    assert torch.allclose(L.entropy(q), torch.tensor(expected), atol=1e-6)


def test_conf_loss_weighs_each_sites_entropy_by_pi():
    z_uniform = torch.zeros(1, 2)  # H = ln 2
    z_sure = torch.tensor([[BIG, -BIG]])  # H = 0
    assert L.conf_loss([z_uniform, z_sure], [0.25, 0.75]).item() == pytest.approx(0.25 * math.log(2), abs=1e-6)


def test_jsd_sign_as_in_the_paper():
    """Eq. 4: JSD = H(sum pi q) - sum pi H(q) >= 0; Eq. 5: L_unique = -JSD, so G *minimising* it seeks disagreement."""
    a, b = torch.tensor([[BIG, -BIG]]), torch.tensor([[-BIG, BIG]])
    assert L.jsd([a, b], [0.5, 0.5]).item() == pytest.approx(math.log(2), abs=1e-6)  # full disagreement
    assert L.jsd([a, a], [0.5, 0.5]).item() == pytest.approx(0.0, abs=1e-6)  # agreement
    assert L.unique_loss([a, b], [0.5, 0.5]).item() == pytest.approx(-math.log(2), abs=1e-6)
    # weighted: pi = (0.25, 0.75), one-hot teachers -> H(mixture) = H(0.25, 0.75)
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert L.jsd([a, b], [0.25, 0.75]).item() == pytest.approx(h, abs=1e-6)
    # the reference code's inverted sign would make disagreeing teachers the *lower* loss for G: ours is
    assert L.unique_loss([a, b], [0.5, 0.5]) < L.unique_loss([a, a], [0.5, 0.5])


def test_per_pixel_terms_average_over_pixels():
    z = torch.zeros(1, 2, 3, 3)
    z[0, 0, 0, 0] = BIG  # one confident pixel, eight uniform ones
    assert L.conf_loss([z], [1.0]).item() == pytest.approx(8 / 9 * math.log(2), abs=1e-6)


def test_site_weights_are_data_shares():
    assert torch.allclose(L.site_weights([10, 30]), torch.tensor([0.25, 0.75], dtype=torch.float64))
    with pytest.raises(PayloadError):
        L.site_weights([0, 0])


def test_label_ratio_is_local_share_over_global_share():
    counts = torch.tensor([[10.0, 0.0, 5.0], [0.0, 10.0, 5.0]])
    # shares: site 1 (2/3, 0, 1/3), site 2 (0, 2/3, 1/3); global (1/3, 1/3, 1/3)
    assert torch.allclose(L.label_ratio(counts), torch.tensor([[2.0, 0.0, 1.0], [0.0, 2.0, 1.0]], dtype=torch.float64))
    # a class no site holds: ratio 1 everywhere (only the discriminator factor decides)
    none = L.label_ratio(torch.tensor([[3.0, 0.0], [1.0, 0.0]]))
    assert torch.allclose(none[:, 1], torch.ones(2, dtype=torch.float64))
    with pytest.raises(PayloadError, match="at least one label"):
        L.label_ratio(torch.tensor([[0.0, 0.0], [1.0, 2.0]]))


def test_eq8_weights_with_discriminator_factor_normalised_per_class():
    ratio = torch.tensor([[2.0, 0.0, 1.0], [0.0, 2.0, 1.0]])
    density = torch.tensor([[1.0, 1.0], [3.0, 1.0]])  # (sites, inputs): site 2 finds input 0 three times as "its own"
    w = L.ensemble_weights(ratio, density)  # (K, B, C)
    assert w.shape == (2, 2, 3)
    assert torch.allclose(w.sum(dim=0), torch.ones(2, 3))  # normalised across sites for every class and input
    # input 0: raw site 1 (2, 0, 1), site 2 (0, 6, 3) -> class 2 split 1:3
    assert torch.allclose(w[:, 0, :], torch.tensor([[1.0, 0.0, 0.25], [0.0, 1.0, 0.75]]))
    # input 1: equal densities -> class 2 split by the label factor alone (1:1)
    assert torch.allclose(w[:, 1, 2], torch.tensor([0.5, 0.5]))
    # without the discriminator factor (the reference code): the same for every input
    plain = L.ensemble_weights(ratio, None)
    assert torch.allclose(plain[:, 0, 2], torch.tensor([0.5, 0.5]))


def test_disjoint_label_sets_give_each_class_to_its_owner():
    counts = torch.tensor([[5.0, 5.0, 0.0, 0.0], [0.0, 0.0, 7.0, 3.0]])
    w = L.ensemble_weights(L.label_ratio(counts), torch.rand(2, 4) + 0.1)
    assert torch.allclose(w[0, :, :2], torch.ones(4, 2)) and torch.allclose(w[1, :, 2:], torch.ones(4, 2))


def test_aggregate_and_mimic_by_hand():
    z1, z2 = torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[3.0, 2.0, 1.0]])
    w = torch.tensor([[[1.0, 0.5, 0.0]], [[0.0, 0.5, 1.0]]])  # (K=2, B=1, C=3)
    A = L.aggregate([z1, z2], w)
    assert torch.allclose(A, torch.tensor([[1.0, 2.0, 1.0]]))
    assert L.mimic_loss(torch.zeros(1, 3), A).item() == pytest.approx(1 + 4 + 1)  # Eq. 10: squared L2 over classes
    # tau > 0: tau^2 KL(p(A) || p(S)); S uniform -> KL = log 3 - H(p(A))
    p = torch.softmax(A, dim=1)[0]
    expected = math.log(3) + float((p * torch.log(p)).sum())
    assert L.mimic_loss(torch.zeros(1, 3), A, tau=1.0).item() == pytest.approx(expected, abs=1e-6)
    # per-pixel ensemble: weights broadcast over the spatial dimensions
    zs = [torch.ones(1, 3, 2, 2) * 1.0, torch.ones(1, 3, 2, 2) * 3.0]
    assert torch.allclose(L.aggregate(zs, w), torch.tensor([1.0, 2.0, 3.0]).view(1, 3, 1, 1).expand(1, 3, 2, 2))


def test_ensemble_of_probabilities_is_tau_log_of_the_weighted_mixture_and_resists_an_overconfident_teacher():
    # teacher 1 is sure of class 0 or 2 on the large scale of a teacher that knows only those two; teacher 2 of class 1
    z1, z2 = torch.tensor([[10.0, 0.0, 9.0]]), torch.tensor([[0.0, 3.0, 0.0]])
    w = torch.full((2, 1, 3), 0.5)
    assert int(L.aggregate([z1, z2], w).argmax()) == 0  # Eq. 9: the large logits outvote
    A = L.aggregate([z1, z2], w, tau=1.0)
    mixture = 0.5 * torch.softmax(z1, 1) + 0.5 * torch.softmax(z2, 1)
    assert torch.allclose(torch.softmax(A, 1), mixture, atol=1e-6) and int(A.argmax()) == 1
    A2 = L.aggregate([z1, z2], w, tau=2.0)  # softmax(A / tau) is the mixture at temperature tau
    assert torch.allclose(torch.softmax(A2 / 2, 1), 0.5 * torch.softmax(z1 / 2, 1) + 0.5 * torch.softmax(z2 / 2, 1), atol=1e-6)
    # tau -> infinity recovers Eq. 9 up to a constant over the classes
    far = L.aggregate([z1, z2], w, tau=1e4)
    assert torch.allclose(far - far.mean(1, keepdim=True), (0.5 * z1 + 0.5 * z2) - (0.5 * z1 + 0.5 * z2).mean(1, keepdim=True), atol=1e-2)
    # per-class weights that do not sum to one over the classes: softmax(A) is the renormalised mixture
    w2 = torch.tensor([[[1.0, 0.5, 0.0]], [[0.0, 0.5, 1.0]]])
    raw = w2[0] * torch.softmax(z1, 1) + w2[1] * torch.softmax(z2, 1)
    assert torch.allclose(torch.softmax(L.aggregate([z1, z2], w2, tau=1.0), 1), raw / raw.sum(), atol=1e-6)
    # per pixel: the mixture over dim 1 at every pixel
    zs = [z1.view(1, 3, 1, 1).expand(2, 3, 2, 2), z2.view(1, 3, 1, 1).expand(2, 3, 2, 2)]
    out = torch.softmax(L.aggregate(zs, w, tau=1.0), 1)
    assert out.shape == (2, 3, 2, 2) and torch.allclose(out[1, :, 1, 0], mixture[0], atol=1e-6)


def test_gan_losses_and_discriminator_score():
    real, fake = torch.full((2, 1, 3, 3), 4.0), torch.full((2, 1, 3, 3), -4.0)
    assert L.discriminator_loss(real, fake).item() == pytest.approx(2 * math.log1p(math.exp(-4.0)), rel=1e-5)
    assert torch.allclose(L.generator_adv_loss(fake), torch.full((2,), math.log1p(math.exp(4.0))))
    assert torch.allclose(L.discriminator_score(real), torch.full((2,), 1 / (1 + math.exp(-4.0))))


def test_balance_is_negative_entropy_of_the_batch_mean_prediction():
    one_class = torch.tensor([[BIG, -BIG], [BIG, -BIG]])
    both = torch.tensor([[BIG, -BIG], [-BIG, BIG]])
    assert L.balance_loss(one_class).item() == pytest.approx(0.0, abs=1e-6)
    assert L.balance_loss(both).item() == pytest.approx(-math.log(2), abs=1e-6)  # minimal: classes used equally


def test_label_loss_is_the_pixel_mean_cross_entropy_to_the_label_map():
    """label_loss by hand: logits BIG on the labelled class give 0, uniform logits give log C, per input."""
    labels = torch.tensor([[[[0, 1], [2, 2]]], [[[1, 1], [1, 1]]]])  # (2, 1, 2, 2)
    right = BIG * torch.nn.functional.one_hot(labels[:, 0], 3).movedim(-1, 1).float()
    assert torch.allclose(L.label_loss(right, labels), torch.zeros(2), atol=1e-6)
    assert torch.allclose(L.label_loss(torch.zeros(2, 3, 2, 2), labels), torch.full((2,), math.log(3)))
    half = right.clone()
    half[0, :, 0, 0] = 0.0  # one of the first input's four pixels uniform
    assert torch.allclose(L.label_loss(half, labels), torch.tensor([math.log(3) / 4, 0.0]), atol=1e-6)


def test_styled_label_generator_gives_the_label_map_once_per_code():
    """With styles the one-hot label map is copied into its code's block of channels (zero elsewhere), so a code changes
    the image through the first convolution despite its instance norm; without a code it refuses."""
    from medflare import ConfigError
    from medflare.nets.gan import LabelGenerator

    torch.manual_seed(0)
    G = LabelGenerator(num_classes=3, width=4, blocks=1, styles=2)
    y = torch.randint(0, 3, (2, 1, 8, 8))
    w = G.condition(y, style=torch.tensor([0, 1]))
    assert w.shape == (2, 3 * 2 + 1, 8, 8)
    onehot = torch.nn.functional.one_hot(y[:, 0], 3).movedim(-1, 1).float()
    assert torch.equal(w[0, :3], onehot[0]) and not w[0, 3:6].any()
    assert torch.equal(w[1, 3:6], onehot[1]) and not w[1, :3].any()
    same = G.condition(y[:1].expand(2, -1, -1, -1), generator=torch.Generator().manual_seed(1), style=torch.tensor([0, 1]))
    same[1, -1] = same[0, -1]  # same noise, same label map, two codes
    assert (G(same)[0] - G(same)[1]).abs().max() > 1e-3
    with pytest.raises(ConfigError, match="style"):
        G.condition(y)
    assert LabelGenerator(num_classes=3, width=4, blocks=1).condition(y).shape == (2, 4, 8, 8)  # the paper's G unchanged


def test_label_generator_resize_upsampling_has_no_transposed_convolution():
    """``upsample="resize"`` doubles the resolution by a nearest resize and a 3x3 convolution (no stride-2 transposed
    convolution, whose uneven overlap draws a checkerboard); same output shape and range; a wrong name is refused."""
    from medflare import ConfigError
    from medflare.nets.gan import LabelGenerator

    torch.manual_seed(0)
    y = torch.randint(0, 3, (2, 1, 16, 16))
    shapes = {}
    for mode in ("deconv", "resize"):
        G = LabelGenerator(num_classes=3, width=4, blocks=1, downsamplings=2, upsample=mode)
        transposed = [m for m in G.modules() if isinstance(m, torch.nn.ConvTranspose2d)]
        assert len(transposed) == (2 if mode == "deconv" else 0)
        assert (len([m for m in G.modules() if isinstance(m, torch.nn.Upsample)]) == 2) == (mode == "resize")
        x = G(G.condition(y))
        shapes[mode] = tuple(x.shape)
        assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    assert shapes["deconv"] == shapes["resize"] == (2, 1, 16, 16)
    with pytest.raises(ConfigError, match="upsample"):
        LabelGenerator(num_classes=3, width=4, blocks=1, upsample="bilinear")


def test_confidence_lets_a_sure_teacher_outvote_two_unsure_wrong_ones():
    """Three teachers that hold the same classes: one right and sure (0.9 on class 0), two wrong and less sure (0.7
    on class 1). The plain mixture follows the majority (class 1); weighted by confidence ** 4 (ensemble_confidence)
    it follows the sure teacher. A segmentation logit map's confidence is the mean over its pixels."""
    probs = torch.tensor([[[0.9, 0.05, 0.05]], [[0.15, 0.7, 0.15]], [[0.15, 0.7, 0.15]]])
    z = list(probs.log())  # three teachers, one input, three classes
    ratio = L.label_ratio(torch.ones(3, 3))
    assert torch.allclose(L.confidence(z[0]), torch.tensor([0.9])) and torch.allclose(L.confidence(z[1]), torch.tensor([0.7]))
    plain = L.aggregate(z, L.ensemble_weights(ratio, None).expand(3, 1, 3), tau=1.0)
    sure = torch.stack([L.confidence(zk) for zk in z]) ** 4
    weighted = L.aggregate(z, L.ensemble_weights(ratio, sure).expand(3, 1, 3), tau=1.0)
    assert int(plain.argmax(1)) == 1 and int(weighted.argmax(1)) == 0
    seg = torch.stack([probs[0, 0], probs[1, 0]], dim=1).log()[None, :, :, None]  # (1, C, 2 pixels, 1)
    assert torch.allclose(L.confidence(seg), torch.tensor([0.8]))
