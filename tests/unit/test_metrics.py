"""Unit tests of medflare.metrics against hand-computed values on tiny 4x4 / 6x6 examples."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from medflare import MedflareError
from medflare.metrics import (
    accuracy,
    aggregated_jaccard_index,
    dice,
    evaluate,
    hd95,
    mean_pixel_accuracy,
    nanmean_with_count,
    object_dice,
    overlay_image,
    sensitivity,
    specificity,
    to_instances,
    variation_of_information,
)

# Case 0: two foreground classes. Case 1: target has one class-1 pixel, prediction is empty.
TARGET0 = [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 2, 2], [0, 0, 2, 2]]
PRED0 = [[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 2, 2], [0, 2, 2, 2]]
TARGET1 = [[0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
PRED1 = [[0] * 4] * 4


def _maps(*rows_list):
    return torch.tensor(rows_list, dtype=torch.long).unsqueeze(1)  # (B, 1, H, W)


PRED = _maps(PRED0, PRED1)
TARGET = _maps(TARGET0, TARGET1)


def test_dice_by_hand():
    # case 0, class 1: |P|=3, |T|=4, |P∩T|=3 -> 6/7; class 2: |P|=5, |T|=4, |P∩T|=4 -> 8/9
    # case 1, class 1: pred empty, target not -> 0; class 2: both empty -> 1
    expected = torch.tensor([[6 / 7, 8 / 9], [0.0, 1.0]])
    torch.testing.assert_close(dice(PRED, TARGET, num_classes=3), expected)


def test_sensitivity_specificity_by_hand():
    # case 0 class 1: TP 3, FN 1 -> 0.75; class 2: TP 4, FN 0 -> 1. case 1 class 1: 0/1; class 2: no positives -> nan
    sens = sensitivity(PRED, TARGET, num_classes=3)
    torch.testing.assert_close(sens[0], torch.tensor([0.75, 1.0]))
    assert sens[1, 0] == 0 and math.isnan(sens[1, 1])
    # case 0 class 1: 12 negatives, FP 0 -> 1; class 2: 12 negatives, FP 1 -> 11/12. case 1: no FP -> 1, 1
    spec = specificity(PRED, TARGET, num_classes=3)
    torch.testing.assert_close(spec, torch.tensor([[1.0, 11 / 12], [1.0, 1.0]]))


def test_hd95_by_hand_and_empty_is_nan():
    target = torch.zeros(2, 1, 6, 6, dtype=torch.long)
    pred = torch.zeros_like(target)
    target[0, 0, 1:3, 1:3] = 1
    pred[0, 0, 1:3, 3:5] = 1  # same 2x2 square shifted right by 2 px: distances {1, 2} both ways -> HD95 2
    target[1, 0, 1:3, 1:3] = 1  # case 1: prediction empty -> nan
    out = hd95(pred, target, num_classes=2)
    assert out.shape == (2, 1)
    assert out[0, 0].item() == pytest.approx(2.0)
    assert math.isnan(out[1, 0].item())
    assert nanmean_with_count(out) == (pytest.approx(2.0), 1)


def test_mean_pixel_accuracy_by_hand():
    # case 0: class 0: 7/8 right, class 1: 3/4, class 2: 4/4 -> (7/8 + 3/4 + 1) / 3 = 0.875
    # case 1: class 0: 15/15, class 1: 0/1 -> 0.5 (class 2 absent from target: left out)
    torch.testing.assert_close(mean_pixel_accuracy(PRED, TARGET, num_classes=3), torch.tensor([0.875, 0.5]))


def test_variation_of_information_by_hand():
    halves = [[1, 1, 0, 0]] * 4
    quarters = [[1, 1, 2, 2]] * 2 + [[3, 3, 4, 4]] * 2
    zeros = [[0] * 4] * 4
    swapped = [[0, 0, 1, 1]] * 4
    # all-zero pred vs halves: H(T|P) = H(T) = log2(2) = 1 bit, H(P|T) = 0
    # quarters refine halves: H(P|T) = 1 bit, H(T|P) = 0; relabelled identical partition: 0
    out = variation_of_information(_maps(zeros, quarters, swapped), _maps(halves, halves, halves))
    torch.testing.assert_close(out, torch.tensor([math.log2(2), 1.0, 0.0]))


def _instance_pair():
    target = np.zeros((6, 6), dtype=np.int64)
    target[0:2, 0:2] = 1  # G1, area 4
    target[3:6, 3:6] = 2  # G2, area 9
    pred = np.zeros((6, 6), dtype=np.int64)
    pred[0:2, 0:3] = 7  # S1, area 6, covers G1 (IoU 4/6)
    pred[4:6, 4:6] = 3  # S2, area 4, inside G2 (IoU 4/9)
    pred[5, 0] = 9  # S3, area 1, false positive
    return pred, target


def test_aji_by_hand():
    pred, target = _instance_pair()
    # C = |G1∩S1| + |G2∩S2| = 4 + 4; U = |G1∪S1| + |G2∪S2| + |S3| = 6 + 9 + 1 -> 8 / 16
    assert aggregated_jaccard_index(pred, target) == pytest.approx(0.5)
    # one prediction chosen by two ground-truth objects: its union counts twice (Kumar's AJI)
    t = np.array([[1, 1, 0, 2, 2]])
    p = np.array([[5, 5, 5, 5, 5]])
    assert aggregated_jaccard_index(p, t) == pytest.approx((2 + 2) / (5 + 5))
    assert aggregated_jaccard_index(np.zeros((3, 3), int), np.zeros((3, 3), int)) == 1.0
    assert aggregated_jaccard_index(p, np.zeros_like(p)) == 0.0


def test_object_dice_by_hand():
    pred, target = _instance_pair()
    # ground-truth side: weights 4/13, 9/13; Dice(G1,S1) = 8/10, Dice(G2,S2) = 8/13
    term_g = 4 / 13 * 0.8 + 9 / 13 * 8 / 13
    # prediction side: weights 6/11, 4/11, 1/11; S3 overlaps nothing -> 0
    term_s = 6 / 11 * 0.8 + 4 / 11 * 8 / 13 + 1 / 11 * 0
    assert object_dice(pred, target) == pytest.approx(0.5 * (term_g + term_s))
    assert object_dice(target, target) == pytest.approx(1.0)
    assert object_dice(np.zeros((3, 3), int), np.zeros((3, 3), int)) == 1.0


def test_to_instances_connectivity():
    mask = np.array([[1, 0, 0], [0, 1, 0], [0, 0, 0]])
    assert to_instances(mask).max() == 1  # diagonal neighbours join under full connectivity
    assert to_instances(mask, connectivity=1).max() == 2


def test_accuracy_by_hand():
    logits = torch.tensor([[2.0, 1.0], [0.0, 3.0], [1.0, 0.0]])
    assert accuracy(logits, torch.tensor([0, 1, 1])) == pytest.approx(2 / 3)
    assert accuracy(torch.tensor([0, 1, 1]), torch.tensor([0, 1, 1])) == 1.0


def test_bad_inputs_raise_medflare_error():
    with pytest.raises(MedflareError, match="'pred' shape"):
        dice(PRED[:, :, :3], TARGET, num_classes=3)
    with pytest.raises(MedflareError, match="num_classes=2"):
        dice(PRED, TARGET, num_classes=2)
    with pytest.raises(MedflareError, match="'target' has 2 labels"):
        accuracy(torch.zeros(3, 4), torch.zeros(2))


class _OneHotModel(torch.nn.Module):
    """Fake segmentation net: image holds the true label map; returns perfect (or all-background) logits."""

    def __init__(self, num_classes: int, perfect: bool):
        super().__init__()
        self.num_classes, self.perfect = num_classes, perfect
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        labels = x[:, 0].long() if self.perfect else torch.zeros_like(x[:, 0]).long()
        return torch.nn.functional.one_hot(labels, self.num_classes).permute(0, 3, 1, 2).float() * 10


def _seg_loader():
    labels = _maps(TARGET0, TARGET0, [[0] * 4] * 4)  # third case has no foreground at all
    return [
        {"image": labels[:2].float(), "label": labels[:2], "name": ["a", "b"]},
        {"image": labels[2:].float(), "label": labels[2:], "name": ["empty"]},
    ]


def test_evaluate_perfect_and_background_models():
    model = _OneHotModel(3, perfect=True).train()
    metrics = ["dice", "dice_c1", "dice_c2", "hd95", "mpa", "vi", "aji", "object_dice", "sensitivity"]
    res = evaluate(model, _seg_loader(), task="segmentation", num_classes=3, metrics=metrics)
    assert model.training  # training mode restored
    assert [c["name"] for c in res["per_case"]] == ["a", "b", "empty"]
    for name in ("dice", "dice_c1", "dice_c2", "mpa", "aji", "object_dice", "sensitivity"):
        assert res["mean"][name] == pytest.approx(1.0), name
    assert res["mean"]["hd95"] == 0.0 and res["mean"]["vi"] == 0.0
    assert res["nan_count"]["hd95"] == 1 and res["nan_count"]["sensitivity"] == 1  # the empty case

    res = evaluate(_OneHotModel(3, perfect=False), _seg_loader(), task="seg", num_classes=3, metrics=["dice", "hd95"])
    # cases a, b: Dice 0 for both classes; empty case: both empty -> 1
    assert [c["dice"] for c in res["per_case"]] == [0.0, 0.0, 1.0]
    assert res["mean"]["dice"] == pytest.approx(1 / 3)
    assert math.isnan(res["mean"]["hd95"]) and res["nan_count"]["hd95"] == 3


def test_evaluate_predict_callable_and_classification():
    loader = _seg_loader()
    res = evaluate(None, loader, task="segmentation", num_classes=3, predict=lambda x: x.long())  # label-map output
    assert res["mean"]["dice"] == pytest.approx(1.0) and res["num_cases"] == 3

    cls_loader = [{"image": torch.tensor([[2.0, 1.0], [0.0, 3.0]]), "label": torch.tensor([0, 0])}]
    res = evaluate(torch.nn.Identity(), cls_loader, task="classification", num_classes=2, metrics=["accuracy"])
    assert res["mean"]["accuracy"] == 0.5
    assert [c["name"] for c in res["per_case"]] == ["case_0000", "case_0001"]


def test_evaluate_rejects_unknown_metric_and_task():
    with pytest.raises(MedflareError, match="unknown metric 'iou'.*known: dice, hd95"):
        evaluate(_OneHotModel(3, True), _seg_loader(), task="segmentation", num_classes=3, metrics=["iou"])
    with pytest.raises(MedflareError, match="'dice_c3'"):
        evaluate(_OneHotModel(3, True), _seg_loader(), task="segmentation", num_classes=3, metrics=["dice_c3"])
    with pytest.raises(MedflareError, match="unknown metric 'dice'.*known: accuracy"):
        evaluate(torch.nn.Identity(), [], task="classification", num_classes=2, metrics=["dice"])
    with pytest.raises(MedflareError, match="unknown task 'detection'"):
        evaluate(torch.nn.Identity(), [], task="detection", num_classes=2)


def test_overlay_image_layout():
    image = torch.arange(16, dtype=torch.float32).reshape(1, 4, 4)
    label, pred = _maps(TARGET0)[0], _maps(PRED0)[0]
    panel = overlay_image(image, label, pred)
    assert panel.dtype == np.uint8 and panel.shape == (3, 4, 12)
    assert panel[:, 0, 0].tolist() == [0, 0, 0] and panel[:, 3, 3].tolist() == [255, 255, 255]  # min-max grey
    # background stays grey in every panel; label (1,1)=1 is coloured, pred (1,1)=0 is not
    assert np.array_equal(panel[:, 0, 2], panel[:, 0, 6]) and np.array_equal(panel[:, 0, 2], panel[:, 0, 10])
    assert len(set(panel[:, 1, 5].tolist())) > 1
    assert np.array_equal(panel[:, 1, 9], panel[:, 1, 1])
    # grey 5/15*255 = 85 blended half-and-half with PALETTE[0] (class 1) = (230, 25, 75)
    assert panel[:, 1, 5].tolist() == [158, 55, 80]
    # pred class 2 at (3, 1): grey 13/15*255 = 221 with PALETTE[1] = (60, 180, 75); rint halves to even
    assert panel[:, 3, 9].tolist() == [140, 200, 148] and panel[:, 3, 5].tolist() == [221, 221, 221]


def test_overlay_image_accepts_rgb_and_multichannel():
    label = _maps(TARGET0)[0]
    assert overlay_image(torch.rand(3, 4, 4), label, label).shape == (3, 4, 12)
    assert overlay_image(torch.rand(2, 4, 4), label[0], label[0]).shape == (3, 4, 12)
    with pytest.raises(MedflareError, match="shapes differ"):
        overlay_image(torch.rand(1, 5, 4), label, label)


def test_evaluate_per_case_matches_the_metric_functions():
    # an imperfect predictor (PRED vs TARGET), so a swapped pred/target or a wrong class/case index shows
    loader = [{"image": PRED.float(), "label": TARGET, "name": ["c0", "c1"]}]
    metrics = ["dice", "dice_c2", "hd95", "sensitivity", "sensitivity_c1", "specificity", "mpa", "vi", "aji", "object_dice"]
    res = evaluate(None, loader, task="segmentation", num_classes=3, metrics=metrics, predict=lambda x: x.long())
    per_class = {f.__name__: f(PRED, TARGET, num_classes=3) for f in (dice, hd95, sensitivity, specificity)}
    mpa, vi = mean_pixel_accuracy(PRED, TARGET, num_classes=3), variation_of_information(PRED, TARGET)
    for b, row in enumerate(res["per_case"]):
        for name, values in per_class.items():
            assert row[name] == pytest.approx(nanmean_with_count(values[b])[0], nan_ok=True), (b, name)
        assert row["dice_c2"] == pytest.approx(float(per_class["dice"][b, 1]))
        assert row["sensitivity_c1"] == pytest.approx(float(per_class["sensitivity"][b, 0]))
        assert row["mpa"] == pytest.approx(float(mpa[b])) and row["vi"] == pytest.approx(float(vi[b]))
        p_inst, t_inst = to_instances(PRED[b, 0].numpy()), to_instances(TARGET[b, 0].numpy())
        assert row["aji"] == pytest.approx(aggregated_jaccard_index(p_inst, t_inst))
        assert row["object_dice"] == pytest.approx(object_dice(p_inst, t_inst))
    # hand values from the tests above: case 0 sensitivity (0.75 + 1) / 2; case 1 dice (0 + 1) / 2, mpa 0.5
    assert res["per_case"][0]["sensitivity"] == pytest.approx(0.875) and res["per_case"][0]["sensitivity_c1"] == 0.75
    assert res["per_case"][1]["dice"] == pytest.approx(0.5) and res["per_case"][1]["mpa"] == pytest.approx(0.5)
    assert res["per_case"][1]["aji"] == 0.0 and res["per_case"][1]["object_dice"] == 0.0  # empty pred, one object
    assert res["nan_count"]["hd95"] == 1 and res["nan_count"]["sensitivity"] == 0  # case 1 class 1 exists in target
