"""The site rule for class means (medflare.metrics.site_mean): a class in no label of any case is left out whatever
the predictions (a 3-class preset on binary masks must not score class 2 as a perfect 1.0, nor let stray class-2
pixels move the key metric), a class some label holds keeps the per-case empty-mask conventions, `medflare evaluate`
warns about classes the labels never hold, and classification is untouched. Hand-computed on 4x4 maps."""

from __future__ import annotations

import json
import math

import nibabel as nib
import numpy as np
import pytest
import torch

from medflare import DataError
from medflare.cli import main
from medflare.common.persistence import model_from_preset
from medflare.common.report import metric_header
from medflare.common.results import describe
from medflare.metrics import dice, evaluate
from medflare.metrics.site_mean import site_mean

# binary masks (labels 0/1 only) scored under a 3-class preset
T0 = [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
P0 = [[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]  # class 1: 2*3/(3+4) = 6/7
T1 = [[0, 0, 0, 0], [0, 1, 1, 0], [0, 1, 1, 0], [0, 0, 0, 0]]
P1 = [[0, 0, 0, 0], [0, 1, 1, 0], [0, 1, 1, 0], [0, 0, 0, 0]]  # class 1: 1


def _maps(*rows):
    return torch.tensor(rows, dtype=torch.long).unsqueeze(1)


def _run(pred, target, metrics=("dice", "dice_c1", "dice_c2", "hd95", "sensitivity")):
    loader = [{"image": pred[:1].float(), "label": target[:1], "name": ["a"]},
              {"image": pred[1:].float(), "label": target[1:], "name": ["b"]}]  # two batches: the rule spans the site
    return evaluate(None, loader, task="segmentation", num_classes=3, metrics=list(metrics), predict=lambda x: x.long())


def test_a_class_in_no_label_is_left_out_of_the_mean():
    res = _run(_maps(P0, P1), _maps(T0, T1))
    assert res["mean"]["dice"] == pytest.approx((6 / 7 + 1) / 2)  # the class-1 Dice; inflated it was (6/7 + 1 + 1 + 1) / 4
    assert res["mean"]["dice"] == pytest.approx(res["mean"]["dice_c1"])
    assert [c["dice"] for c in res["per_case"]] == pytest.approx([6 / 7, 1.0])
    assert math.isnan(res["mean"]["dice_c2"]) and all(math.isnan(c["dice_c2"]) for c in res["per_case"])
    assert res["per_class"]["dice"][1] == pytest.approx((6 / 7 + 1) / 2) and math.isnan(res["per_class"]["dice"][2])
    assert res["unseen_classes"] == [2]
    assert res["mean"]["sensitivity"] == pytest.approx((0.75 + 1) / 2) and res["nan_count"]["sensitivity"] == 0
    assert res["nan_count"]["hd95"] == 0  # class 2's nan HD95 no longer counts against every case


def test_a_stray_prediction_of_a_class_no_label_holds_changes_nothing():
    # issue 32: case a predicts one class-2 pixel that no label holds. The rule before counted class 2 at the site
    # then (Dice 0 in case a, the empty-empty 1 in case b: a mean of ((6/7)/2 + 1) / 2 here, and above the class-1
    # Dice where few cases stray), so a few stray pixels moved the key metric that picks the best model
    p0 = [row[:] for row in P0]
    p0[3][3] = 2
    res = _run(_maps(p0, P1), _maps(T0, T1))
    clean = _run(_maps(P0, P1), _maps(T0, T1))
    assert res["mean"]["dice"] == pytest.approx(clean["mean"]["dice"]) == pytest.approx((6 / 7 + 1) / 2)
    assert [c["dice"] for c in res["per_case"]] == pytest.approx([6 / 7, 1.0])
    assert math.isnan(res["mean"]["dice_c2"]) and res["unseen_classes"] == [2]


def test_a_label_map_missing_a_class_keeps_the_per_case_convention():
    # class 2 is in case b's label only: it counts at the site; case a (class 2 in neither map) scores the
    # empty-empty 1 for it, and a class-2 pixel predicted in case a (its label lacks class 2) scores 0
    t1 = [row[:] for row in T1]
    t1[0] = [2, 2, 0, 0]
    p1 = [row[:] for row in P1]
    p1[0] = [2, 2, 0, 0]
    res = _run(_maps(P0, p1), _maps(T0, t1))
    assert [c["dice_c2"] for c in res["per_case"]] == [1.0, 1.0]
    assert [c["dice"] for c in res["per_case"]] == pytest.approx([(6 / 7 + 1) / 2, 1.0])
    p0 = [row[:] for row in P0]
    p0[3][3] = 2
    res = _run(_maps(p0, p1), _maps(T0, t1))
    assert [c["dice_c2"] for c in res["per_case"]] == [0.0, 1.0]
    assert res["mean"]["dice"] == pytest.approx(((6 / 7 + 0) / 2 + 1) / 2) and res["unseen_classes"] == []


def test_per_case_values_are_the_metric_functions_where_every_class_occurs():
    pred, target = _maps(P0, P1), _maps(T0, [[2] * 4] + T1[1:])  # class 2 in case b's label
    res = _run(pred, target, ("dice", "dice_c2"))
    d = dice(pred, target, num_classes=3)
    assert [c["dice"] for c in res["per_case"]] == pytest.approx(d.mean(1).tolist())
    assert res["unseen_classes"] == []


def test_site_mean_by_hand():
    values = torch.tensor([[0.5, 1.0, float("nan")], [float("nan"), 1.0, 0.2]])
    present = torch.tensor([[True, False, False], [True, False, True]])
    out = site_mean(values, present)
    assert out.absent == [2]
    assert out.per_case.tolist() == pytest.approx([0.5, 0.2]) and out.mean == pytest.approx(0.35) and out.nan_count == 0
    assert out.per_class[1] == 0.5 and math.isnan(out.per_class[2]) and out.per_class[3] == pytest.approx(0.2)
    assert site_mean(torch.tensor([0.25, 0.75])).mean == 0.5  # already per case: every value counts
    empty = site_mean(torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.bool))
    assert math.isnan(empty.mean) and empty.nan_count == 2 and empty.absent == [1, 2]


def test_a_label_value_beyond_num_classes_is_a_data_error_naming_the_case():
    with pytest.raises(DataError, match="case 'b'.*num_classes=3"):
        _run(_maps(P0, P1), _maps(T0, [[3] * 4] * 4))


def test_classification_is_unchanged():
    loader = [{"image": torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 0.0], [0.0, 0.0, 1.0]]), "label": torch.tensor([0, 0, 2])}]
    res = evaluate(torch.nn.Identity(), loader, task="classification", num_classes=3, metrics=["accuracy"])
    assert set(res) == {"mean", "per_case", "nan_count", "num_cases"}  # no class rule, no class warnings
    assert res["mean"] == {"accuracy": pytest.approx(2 / 3)} and res["nan_count"] == {"accuracy": 0}
    assert [(c["label"], c["pred"], c["accuracy"]) for c in res["per_case"]] == [(0, 0, 1.0), (0, 1, 0.0), (2, 2, 1.0)]


def test_evaluate_a_3_class_preset_on_binary_masks_warns_and_shows_class_2_absent(tmp_path, capsys):
    preset = "seg_synthetic_tiny"  # 3 classes
    assert main(["data", "--preset", preset, "-n", "1", "--out", str(tmp_path / "d")]) == 0
    datalist = tmp_path / "d" / "site-1.json"
    for entry in json.loads(datalist.read_text())["testing"]:  # binary masks: class 2 merged into class 1
        path = tmp_path / "d" / entry["label"]
        img = nib.load(path)
        nib.save(nib.Nifti1Image(np.minimum(np.asarray(img.dataobj), 1).astype(np.uint8), img.affine), path)
    model = model_from_preset(preset, seed=0)
    with torch.no_grad():  # a network that never predicts class 2: its last layer's class-2 bias far below the rest
        last = [m for m in model.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.ConvTranspose2d))][-1]
        last.bias[2] = -1e4
    ckpt = tmp_path / "m.pt"
    torch.save({"model": model.state_dict(), "train_conf": {"medflare": describe(preset)}}, ckpt)
    out = tmp_path / "r.json"
    capsys.readouterr()
    assert main(["evaluate", "--model", str(ckpt), "--datalist", str(datalist), "--device", "cpu", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    site = json.loads(out.read_text())["evaluations"][0]["sites"][str(datalist)]
    c1 = site["per_class"]["dice"]["1"]
    assert site["mean"]["dice"] == pytest.approx(c1) and c1 < 0.99  # the class-1 Dice, not (c1 + 1) / 2
    assert math.isnan(site["per_class"]["dice"]["2"]) and site["unseen_classes"] == [2]
    assert f"warning: site '{datalist}': the preset has num_classes=3 but class(es) 2 never occur" in printed
    assert f"| site | {metric_header('dice_c1')} | {metric_header('dice_c2')} |" in printed  # headers carry the unit
    assert [line for line in printed.splitlines() if line.startswith(f"| {datalist} |") and line.endswith(" | - |")]


class _NeverClass2(torch.nn.Module):
    """Logits from a label map held in the image: class 1 where the image is 1, else background; class 2 never."""

    def forward(self, x):
        one = (x[:, 0] > 0.5).float()
        return torch.stack([1 - one, one, torch.full_like(one, -1e4)], dim=1)


def test_site_validation_uses_the_rule_and_warns_once_per_split(caplog):
    import logging

    from medflare.common.site_executor import SiteExecutor

    ex = SiteExecutor(preset="seg_synthetic_tiny", device="cpu")  # 3 classes
    maps = _maps(T0, T1, P0)
    val = [{"image": maps[i].float(), "label": maps[i], "name": f"v{i}"} for i in range(3)]
    val[1] = {**val[1], "image": _maps(P0)[0].float()}  # case v1 predicted as P0 against label T1
    ex.site = "site-1"
    ex.data = type("D", (), {"val": val, "task": "segmentation", "num_classes": 3, "whole_volumes": None,
                             "spatial_dims": 2})()
    with caplog.at_level(logging.WARNING):
        first = ex.validate(_NeverClass2())
        again = ex.validate(_NeverClass2(), round_num=1, total_rounds=3)
    ref = dice(_maps(T0, P0, P0), maps, num_classes=3)[:, 0]  # class 1 only
    assert first["dice"] == pytest.approx(float(ref.mean())) and again == first
    warnings = [r.getMessage() for r in caplog.records if "never occur in its labels" in r.getMessage()]
    assert warnings == ["warning: site 'site-1' (val split): the preset has num_classes=3 but class(es) 2 never occur in its "
                        "labels (3 cases); check data.num_classes (they are left out of the class means and shown as '-')"]
