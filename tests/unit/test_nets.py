"""Unit tests of medflare.nets: every named model builds, has the right output shape and a sane size."""

from __future__ import annotations

import pytest
import torch

from medflare import MedflareError
from medflare.nets import MODEL_NAMES, build_model, count_parameters

CLS_ARGS = {
    "convnet": lambda s: {"in_channels": 1, "num_classes": 10, "image_size": s},
    "resnet8": lambda s: {"in_channels": 1, "num_classes": 10, "widths": [16, 32, 64]},
    "resnet18": lambda s: {"in_channels": 1, "num_classes": 10},
}


def test_model_names_cover_all_builders():
    assert set(MODEL_NAMES) == {"unet", *CLS_ARGS}


@pytest.mark.parametrize("size", [28, 32, 64])
@pytest.mark.parametrize("name", sorted(CLS_ARGS))
def test_classifier_forward_shape_and_features(name, size):
    torch.manual_seed(0)
    model = build_model(name, **CLS_ARGS[name](size)).eval()
    x = torch.randn(2, 1, size, size)
    with torch.no_grad():
        logits = model(x)
        feats = model.features(x)
        assert logits.shape == (2, 10)
        assert feats.shape == (2, model.feature_dim)
        torch.testing.assert_close(model.classifier(feats), logits)


@pytest.mark.parametrize("size", [32, 64])
def test_unet_forward_shape(size):
    model = build_model("unet", in_channels=1, out_channels=3, channels=[8, 16, 32], strides=[2, 2]).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 1, size, size)).shape == (2, 3, size, size)
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def test_convnet_feature_size_matches_hand_computation():
    # 28 -> 14 -> 7 -> 3: 128 * 3 * 3 = 1152; reference padding 3: 32 -> 4x4: 2048
    assert build_model("convnet", in_channels=1, num_classes=10, image_size=28).feature_dim == 1152
    assert build_model("convnet", in_channels=1, num_classes=10, image_size=32).feature_dim == 2048
    ref = build_model("convnet", in_channels=1, num_classes=10, image_size=28, first_padding=3)
    assert ref.feature_dim == 2048
    assert count_parameters(ref) == 317_706  # FedVCK reference reports ~318K


@pytest.mark.parametrize(
    "name,args,low,high",
    [
        ("unet", {"in_channels": 1, "out_channels": 3, "channels": [16, 32, 64, 128, 256], "strides": [2, 2, 2, 2], "num_res_units": 2}, 1.5e6, 1.7e6),
        ("convnet", {"in_channels": 1, "num_classes": 10}, 2.5e5, 3.5e5),
        ("resnet8", {"in_channels": 3, "num_classes": 10}, 4e6, 6e6),
        ("resnet18", {"in_channels": 3, "num_classes": 10}, 1.05e7, 1.2e7),
    ],
)
def test_parameter_counts_in_sane_range(name, args, low, high):
    assert low <= count_parameters(build_model(name, **args)) <= high


def test_unknown_name_and_bad_args_raise_medflare_error():
    with pytest.raises(MedflareError, match="unknown model name 'vgg19'"):
        build_model("vgg19")
    with pytest.raises(MedflareError, match="unknown argument.*'kernel'"):
        build_model("convnet", in_channels=1, num_classes=10, kernel=5)
    with pytest.raises(MedflareError, match="missing required.*'num_classes'"):
        build_model("resnet8", in_channels=1)
    with pytest.raises(MedflareError, match="'strides'"):
        build_model("unet", in_channels=1, out_channels=2, channels=[8, 16, 32], strides=[2])
    with pytest.raises(MedflareError, match="'image_size'"):
        build_model("convnet", in_channels=1, num_classes=10, image_size=4)
    with pytest.raises(MedflareError, match="'widths'"):
        build_model("resnet8", in_channels=1, num_classes=3, widths=[16, 32])


@pytest.mark.parametrize(
    "name,args,match",
    [
        ("convnet", {"in_channels": True, "num_classes": 10}, "convnet: 'in_channels' must be a positive int, got True"),
        ("unet", {"in_channels": 1, "out_channels": 0, "channels": [8, 16], "strides": [2]}, "unet: 'out_channels' must be a positive int"),
        ("unet", {"in_channels": 1, "out_channels": 2, "channels": [8, 16], "strides": [2], "dropout": 1.0}, r"unet: 'dropout' must be in \[0, 1\)"),
        ("resnet18", {"in_channels": 1, "num_classes": 3, "cifar_stem": "yes"}, "resnet18: 'cifar_stem' must be true or false"),
        ("resnet8", {"in_channels": 1, "num_classes": 3, "widths": [16, 0, 64]}, "resnet8: 'widths' must be a positive int"),
    ],
)
def test_bad_values_name_model_and_key(name, args, match):
    with pytest.raises(MedflareError, match=match):
        build_model(name, **args)


def test_parameter_counts_by_hand():
    # resnet8 (16, 32, 64), 3 channels: stem 432+32; block1 2*(2304+32); block2 4608+64 + 9216+64 + 512+64;
    # block3 18432+128 + 36864+128 + 2048+128; fc 640+10 -> the ~78K "resnet8" of the KD literature
    assert count_parameters(build_model("resnet8", in_channels=3, num_classes=10, widths=[16, 32, 64])) == 78_042
    frozen = build_model("resnet8", in_channels=3, num_classes=10, widths=[16, 32, 64])
    frozen.classifier.requires_grad_(False)
    assert count_parameters(frozen, trainable_only=True) == 78_042 - 650 and count_parameters(frozen) == 78_042


def test_bn_prior_is_the_distance_of_batch_statistics_from_running_statistics():
    """DeepInversion's R_feature by hand on one BN layer; the model's mode and statistics are left as they were."""
    from medflare.nets.batchnorm import forward_with_bn_prior

    bn = torch.nn.BatchNorm2d(2).eval()
    bn.running_mean.copy_(torch.tensor([1.0, -1.0]))
    bn.running_var.copy_(torch.tensor([4.0, 0.25]))
    x = torch.tensor([[[[0.0, 2.0]], [[1.0, 1.0]]], [[[2.0, 4.0]], [[-1.0, -1.0]]]])  # (B=2, C=2, 1, 2)
    # channel 0: values 0, 2, 2, 4 -> mean 2, var 2; channel 1: 1, 1, -1, -1 -> mean 0, var 1
    expected = torch.tensor([2.0 - 1.0, 0.0 + 1.0]).norm() + torch.tensor([2.0 - 4.0, 1.0 - 0.25]).norm()
    out, prior = forward_with_bn_prior(bn, x)
    assert torch.allclose(prior, expected) and torch.equal(out, bn(x))
    assert not bn.training and bn.running_mean.tolist() == [1.0, -1.0] and bn.num_batches_tracked == 0
    assert not bn._forward_hooks  # hooks removed
    _, none = forward_with_bn_prior(torch.nn.Conv2d(2, 2, 1), x)
    _, untracked = forward_with_bn_prior(torch.nn.BatchNorm2d(2, track_running_stats=False), x)  # nothing to compare with
    assert none.item() == 0.0 and untracked.item() == 0.0


def test_bn_prior_gradient_moves_a_batch_towards_the_teachers_statistics():
    from medflare.nets.batchnorm import forward_with_bn_prior

    torch.manual_seed(0)
    teacher = build_model("convnet", **CLS_ARGS["convnet"](16)).train()
    with torch.no_grad():
        for _ in range(20):
            teacher(torch.rand(32, 1, 16, 16) * 0.5 + 0.25)  # running statistics of "real" data
    teacher.eval()
    x = torch.randn(32, 1, 16, 16).requires_grad_(True)
    opt = torch.optim.Adam([x], lr=0.05)
    first = None
    for _ in range(60):
        _, prior = forward_with_bn_prior(teacher, x)
        first = float(prior.detach()) if first is None else first
        opt.zero_grad()
        prior.backward()
        opt.step()
    assert float(forward_with_bn_prior(teacher, x)[1].detach()) < 0.5 * first
