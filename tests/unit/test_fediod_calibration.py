"""The segmentation student's decision offset (medflare.fediod.calibration): the folded student computes the shifted
logits exactly, one forward pass scores every offset as evaluating the shifted model would, the chosen offset is the
best mean over sites (0 on a tie), and a student without a per-class output bias, or a classification preset, is
refused."""

import pytest
import torch

from medflare import ConfigError
from medflare.common.payload import state_to_numpy
from medflare.fediod.calibration import (best_offset, check_offsets, fold_offset, lower_background, offset_means, offset_metric,
                                         output_bias, scores_at_offsets, split_logits)
from medflare.metrics import evaluate
from medflare.fediod.config import FedIODConfig
from medflare.fediod.networks import server_networks
from medflare.presets import get_preset


def _student(preset="fediod_seg_tiny"):
    cfg = get_preset(preset)
    return server_networks(cfg, FedIODConfig.from_preset(cfg), 0).student.eval(), cfg


def test_the_folded_student_computes_the_lowered_background_logit():
    student, cfg = _student()
    size = cfg["data"]["image_size"]
    x = torch.randn(3, 1, size, size, generator=torch.Generator().manual_seed(0))
    name = output_bias(student, x)
    with torch.no_grad():
        raw = student(x)
        folded, _ = _student()
        folded.load_state_dict({k: torch.as_tensor(v) for k, v in fold_offset(state_to_numpy(student), name, 1.5).items()})
        shifted = folded(x)
    assert torch.allclose(shifted, lower_background(raw, 1.5), atol=1e-5)
    assert torch.allclose(shifted[:, 1:], raw[:, 1:], atol=1e-5) and (shifted[:, 0] < raw[:, 0] - 1.4).all()
    # more foreground pixels at a positive offset, the probe left the student as it was (bit for bit)
    assert (shifted.argmax(1) > 0).sum() >= (raw.argmax(1) > 0).sum()
    with torch.no_grad():
        assert torch.equal(student(x), raw)


def test_one_forward_pass_scores_every_offset_as_the_shifted_model_scores():
    student, cfg = _student()
    size, g = cfg["data"]["image_size"], torch.Generator().manual_seed(1)
    loader = [{"image": torch.randn(4, 1, size, size, generator=g), "label": torch.randint(0, 3, (4, 1, size, size), generator=g)}
              for _ in range(3)]
    offsets = [-1.0, 0.0, 1.5, 3.0]
    scores = scores_at_offsets(split_logits(student, loader), offsets, "dice", 3)
    for d in offsets:
        shifted = evaluate(None, loader, task="segmentation", num_classes=3, metrics=["dice"],
                           predict=lambda x, d=d: lower_background(student(x), d))["mean"]["dice"]
        assert scores[d] == pytest.approx(shifted, abs=1e-6)
    assert len({round(v, 6) for v in scores.values()}) > 1  # the offsets change the decision


def test_a_student_whose_output_is_normalised_has_no_offset_to_fold():
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3, padding=1), torch.nn.InstanceNorm2d(3))
    with pytest.raises(ConfigError, match="calibrate_offsets"):
        output_bias(net, torch.randn(2, 1, 8, 8))


def test_the_offset_is_the_best_mean_over_the_sites_and_0_on_a_tie():
    sites = [{offset_metric("dice", 0.0): 0.60, offset_metric("dice", 1.0): 0.70, offset_metric("dice", 2.0): 0.50},
             {offset_metric("dice", 0.0): 0.70, offset_metric("dice", 1.0): 0.64, offset_metric("dice", 2.0): 0.90},
             {offset_metric("dice", 1.0): float("nan")}]
    means = offset_means(sites, "dice", [0.0, 1.0, 2.0, 3.0])
    assert means == pytest.approx({0.0: 0.65, 1.0: 0.67, 2.0: 0.70})
    assert best_offset(means) == 2.0
    assert best_offset({-1.0: 0.5, 0.0: 0.5, 1.0: 0.5}) == 0.0 and best_offset({}) == 0.0
    # a site that claims a score out of range counts as 1 at most: it cannot outvote the others alone
    liar = {offset_metric("dice", 0.0): 0.0, offset_metric("dice", 1.0): 0.0, offset_metric("dice", 2.0): 1e9}
    honest = [{offset_metric("dice", 0.0): 0.5, offset_metric("dice", 1.0): 0.7, offset_metric("dice", 2.0): 0.3}] * 5
    assert best_offset(offset_means([*honest, liar], "dice", [0.0, 1.0, 2.0])) == 1.0


def test_offsets_are_a_segmentation_setting():
    check_offsets([0.0, 1.0], "segmentation")
    check_offsets([], "classification")
    with pytest.raises(ConfigError, match="calibrate_offsets"):
        check_offsets([1.0], "classification")
