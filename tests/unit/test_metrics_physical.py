"""Distances in physical units: HD95 and surface Dice use the voxel spacing (mm), per case, anisotropic."""

from __future__ import annotations

import pytest
import torch

from medflare import MedflareError
from medflare.metrics import evaluate, hd95, surface_dice


def _planes(shape, axis, at_pred, at_target):
    """Label maps (1, 1, *shape) holding one full plane each, perpendicular to ``axis``: every surface point of one
    lies exactly ``|at_pred - at_target|`` voxels from the other, so HD95 is that distance times the voxel size."""
    pred, target = torch.zeros((1, 1, *shape), dtype=torch.long), torch.zeros((1, 1, *shape), dtype=torch.long)
    pred.select(axis + 2, at_pred).fill_(1)
    target.select(axis + 2, at_target).fill_(1)
    return pred, target


@pytest.mark.parametrize("axis, shift, expected", [(0, 3, 3 * 0.7), (1, 2, 2 * 0.9), (2, 2, 2 * 3.0)])
def test_hd95_in_mm_for_anisotropic_voxels(axis, shift, expected):
    spacing = [0.7, 0.9, 3.0]
    pred, target = _planes((12, 10, 8), axis, 1, 1 + shift)
    assert float(hd95(pred, target, 2)[0, 0]) == pytest.approx(shift)  # pixels without spacing
    assert float(hd95(pred, target, 2, spacing=spacing)[0, 0]) == pytest.approx(expected)
    # surface Dice: nothing within a tolerance below the distance, everything at it
    assert float(surface_dice(pred, target, 2, expected - 0.05, spacing=spacing)[0, 0]) == 0.0
    assert float(surface_dice(pred, target, 2, expected, spacing=spacing)[0, 0]) == pytest.approx(1.0)


def test_spacing_per_case_and_empty_conventions():
    pred, target = _planes((6, 6), 0, 1, 3)  # 2D: 2 pixels apart along axis 0
    both = torch.cat([pred, pred]), torch.cat([target, target])
    assert hd95(*both, 2, spacing=[[0.5, 1.0], [2.0, 1.0]])[:, 0].tolist() == pytest.approx([1.0, 4.0])
    empty = torch.zeros_like(pred)
    assert float(surface_dice(empty, empty, 2, 1.0)[0, 0]) == 1.0 and float(surface_dice(pred, empty, 2, 1.0)[0, 0]) == 0.0
    with pytest.raises(MedflareError, match="'spacing' must hold 2 voxel sizes"):
        hd95(pred, target, 2, spacing=[1.0, 1.0, 1.0])


def test_evaluate_takes_spacing_from_the_batch_or_the_argument():
    pred, target = _planes((8, 8, 6), 2, 1, 3)
    batch = {"image": pred.float(), "label": target, "spacing": torch.tensor([[1.0, 1.0, 2.5]]), "name": ["v"]}
    metrics = ["hd95", "surface_dice_4mm", "surface_dice_5mm_c1"]
    identity = lambda x: x  # noqa: E731 - the "prediction" is the label map itself
    from_batch = evaluate(None, [batch], task="segmentation", num_classes=2, metrics=metrics, predict=identity)
    assert from_batch["mean"] == pytest.approx({"hd95": 5.0, "surface_dice_4mm": 0.0, "surface_dice_5mm_c1": 1.0})
    given = evaluate(None, [batch], task="segmentation", num_classes=2, metrics=["hd95"], predict=identity, spacing=[1, 1, 1])
    assert given["mean"]["hd95"] == pytest.approx(2.0)
    with pytest.raises(MedflareError, match="unknown metric 'surface_dice_mm'"):
        evaluate(None, [batch], task="segmentation", num_classes=2, metrics=["surface_dice_mm"], predict=identity)
