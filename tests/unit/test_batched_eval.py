"""Validation where training runs: whole batches on the model's device give the same numbers as one case at a
time; costly metrics at their cadence; AMP, loader workers and per-device batch sizes from the preset."""

from __future__ import annotations

import math

import pytest
import torch

from medflare import ConfigError, MedflareError
from medflare.common.site_executor import SiteExecutor
from medflare.common.training import batch_size_for, make_loader, make_loss, make_optimizer, train_epochs
from medflare.data import load_site
from medflare.metrics import COSTLY_METRICS, evaluate, mean_pixel_accuracy, metrics_for_round
from medflare.nets import build_from_spec
from medflare.presets import PRESETS, get_preset

TINY = "seg_synthetic_tiny"
ALL_SEG = ["dice", "dice_c1", "dice_c2", "hd95", "hd95_c2", "sensitivity", "specificity_c1", "mpa", "vi", "aji", "object_dice"]
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on the CPU CI machine)")


class _NoisyLabels(torch.nn.Module):
    """A per-case predictor with imperfect, varied output: logits from the image (= label map + noise), so some
    classes are missed, some over-segmented and some cases empty (exercises every empty-mask convention)."""

    def forward(self, x):
        blurred = torch.nn.functional.avg_pool2d(x, 3, stride=1, padding=1)
        return torch.stack([-(blurred[:, 0] - c) ** 2 for c in range(3)], dim=1)


def _cases(n=11, size=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    items = []
    for i in range(n):
        label = torch.zeros(1, size, size, dtype=torch.long)
        if i % 4:  # every 4th case has no foreground at all
            y, x = torch.randint(2, size - 10, (2,), generator=g).tolist()
            label[0, y:y + 8, x:x + 8] = 1
            if i % 3:
                label[0, y + 2:y + 5, x + 2:x + 6] = 2
        image = label.float() + 0.45 * torch.randn(1, size, size, generator=g)
        items.append({"image": image, "label": label, "name": f"case{i}"})
    return items


def _rows(result):
    return [{k: v for k, v in row.items() if k != "name"} for row in result["per_case"]]


def _assert_rows_equal(a, b):
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], abs=1e-6, nan_ok=True), k


def test_validation_on_a_batch_equals_one_case_at_a_time():
    cases = _cases()
    kwargs = dict(task="segmentation", num_classes=3, metrics=ALL_SEG)
    whole = evaluate(_NoisyLabels(), make_loader(cases, 8, False), **kwargs)
    single = evaluate(_NoisyLabels(), make_loader(cases, 1, False), **kwargs)
    _assert_rows_equal(_rows(whole), _rows(single))
    assert whole["mean"] == pytest.approx(single["mean"], nan_ok=True) and whole["nan_count"] == single["nan_count"]
    # the data really exercise the conventions: empty cases give nan HD95, and scores are not all perfect
    assert whole["nan_count"]["hd95"] > 0 and 0.2 < whole["mean"]["dice"] < 0.99


def test_a_real_network_scores_the_same_in_batches_and_alone():
    cfg = get_preset(TINY)
    data = load_site("site-1", cfg["data"])
    torch.manual_seed(0)
    model = build_from_spec(cfg["model"])
    train_epochs(model, make_loader(data.train, 4, True), make_loss("dicece", "segmentation"),
                 make_optimizer("adam", model.parameters(), 1e-2), epochs=1)
    kwargs = dict(task="segmentation", num_classes=3, metrics=["dice", "dice_c1", "dice_c2", "hd95", "mpa"])
    whole = evaluate(model, make_loader(data.val, 8, False), **kwargs)
    single = evaluate(model, make_loader(data.val, 1, False), **kwargs)
    _assert_rows_equal(_rows(whole), _rows(single))


def test_mean_pixel_accuracy_batched_equals_per_case_by_hand():
    cases = _cases(6)
    pred = torch.stack([_NoisyLabels()(c["image"][None]).argmax(1) for c in cases])  # (B, 1, H, W)
    target = torch.stack([c["label"] for c in cases])
    expected = []
    for p, t in zip(pred[:, 0], target[:, 0]):
        present = [c for c in range(3) if (t == c).any()]
        expected.append(sum(((p == c) & (t == c)).sum().item() / (t == c).sum().item() for c in present) / len(present))
    torch.testing.assert_close(mean_pixel_accuracy(pred, target, 3), torch.tensor(expected, dtype=torch.float32))


def test_costly_metrics_follow_their_cadence():
    names = ["dice", "hd95", "hd95_c1", "vi", "mpa", "aji", "object_dice", "sensitivity"]
    cheap = ["dice", "mpa", "sensitivity"]
    assert set(COSTLY_METRICS) == {"hd95", "vi", "aji", "object_dice"}
    assert metrics_for_round(names, 0, 10, 5) == names  # round 0 is a multiple of 5
    assert metrics_for_round(names, 3, 10, 5) == cheap
    assert metrics_for_round(names, 5, 10, 5) == names
    assert metrics_for_round(names, 9, 10, 5) == names  # the last round always
    assert metrics_for_round(names, 4, None, 5) == cheap  # total unknown: no round counts as the last
    assert metrics_for_round(names, 0, 10, 0) == cheap and metrics_for_round(names, 9, 10, 0) == names
    assert metrics_for_round(names, 3, 10, 1) == names
    with pytest.raises(MedflareError, match="costly_every"):
        metrics_for_round(names, 0, 10, -1)


def _executor(preset=TINY, overrides=None):
    """A SiteExecutor with its site data resolved as at START_RUN, without FLARE around it."""
    ex = SiteExecutor(preset=preset, overrides=overrides, device="cpu")
    ex.site, ex.data = "site-1", load_site("site-1", ex.cfg["data"])
    return ex


def test_site_validation_drops_costly_metrics_between_cadence_rounds_and_times_itself():
    ex = _executor(overrides={"eval": {"metrics": ["dice", "hd95"], "costly_every": 3}})
    model = ex.new_model()
    assert set(ex.validate(model, round_num=0, total_rounds=10)) == {"dice", "hd95"}
    assert set(ex.validate(model, round_num=1, total_rounds=10)) == {"dice"}
    assert set(ex.validate(model, round_num=9, total_rounds=10)) == {"dice", "hd95"}
    assert set(ex.validate(model)) == {"dice", "hd95"}  # outside training rounds: everything
    assert set(ex.validate(model, metrics=["dice"])) == {"dice"}
    assert ex._validate_s > 0


def test_inference_loaders_use_the_eval_batch_size_and_training_the_train_batch_size():
    ex = _executor(overrides={"train": {"batch_size": 3}, "eval": {"batch_size": 5}})
    assert ex.loader("val").batch_size == 5 and ex.loader("train", shuffle=True).batch_size == 3
    ex = _executor(overrides={"train": {"batch_size": 3}})
    assert ex.loader("val").batch_size == 3  # eval.batch_size 0: the training batch size
    assert get_preset("seg_paper")["train"]["batch_size"] == 1 and get_preset("seg_paper")["eval"]["batch_size"] == 8


def test_batch_size_per_device():
    train = {"batch_size": 1, "gpu_batch_size": 8}
    assert batch_size_for(train, "cpu") == 1 and batch_size_for(train, "cuda:0") == 8
    assert batch_size_for({"batch_size": 4, "gpu_batch_size": 0}, "cuda") == 4


def test_every_preset_has_the_speed_keys_and_they_can_be_overridden():
    for name in PRESETS:
        cfg = get_preset(name)
        assert {"num_workers", "gpu_batch_size", "amp"} <= set(cfg["train"]), name
        assert {"batch_size", "costly_every"} <= set(cfg["eval"]), name
        assert cfg["train"]["amp"] == "off"  # not measured to help on any device we could test
    cfg = get_preset(TINY, {"train": {"num_workers": 2, "amp": "bf16"}, "eval": {"costly_every": 1}})
    assert (cfg["train"]["num_workers"], cfg["train"]["amp"], cfg["eval"]["costly_every"]) == (2, "bf16", 1)


def test_loader_workers_give_the_same_batches():
    cases = _cases(7)
    a = [b["name"] for b in make_loader(cases, 3, True, seed=4)]
    b = [b["name"] for b in make_loader(cases, 3, True, seed=4, num_workers=2)]
    assert a == b


def _tiny_training(amp):
    cfg = get_preset(TINY)
    data = load_site("site-1", cfg["data"])
    torch.manual_seed(0)
    model = build_from_spec(cfg["model"])
    seen = []
    model.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    loss_fn = make_loss("dicece", "segmentation")
    stats = train_epochs(model, make_loader(data.train, 4, True), loss_fn, make_optimizer("adam", model.parameters(), 1e-2),
                         epochs=3, amp=amp)
    return stats, set(seen), model


@pytest.mark.parametrize("amp, dtype", [("off", torch.float32), ("bf16", torch.bfloat16)])
def test_amp_runs_the_forward_pass_in_its_precision_and_still_learns(amp, dtype):
    stats, dtypes, model = _tiny_training(amp)
    assert dtypes == {dtype}
    assert all(p.dtype == torch.float32 for p in model.parameters())  # weights stay float32
    first, last = sum(stats.losses[:3]) / 3, sum(stats.losses[-3:]) / 3
    assert math.isfinite(last) and last < 0.9 * first


def test_unknown_amp_is_named():
    with pytest.raises(ConfigError, match="train.amp 'fp8'"):
        _tiny_training("fp8")


@GPU
def test_evaluate_on_the_gpu_equals_the_cpu():
    cases = _cases()
    kwargs = dict(task="segmentation", num_classes=3, metrics=ALL_SEG)
    cpu = evaluate(_NoisyLabels(), make_loader(cases, 8, False), device="cpu", **kwargs)
    gpu = evaluate(_NoisyLabels().cuda(), make_loader(cases, 8, False), device="cuda", **kwargs)
    _assert_rows_equal(_rows(gpu), _rows(cpu))


@GPU
def test_cli_evaluate_on_cuda_equals_cpu(tmp_path):
    import json

    from medflare.cli import main
    from medflare.common.persistence import model_from_preset
    from medflare.common.results import describe

    ckpt = tmp_path / "m.pt"
    torch.save({"model": model_from_preset(TINY).state_dict(), "train_conf": {"medflare": describe(TINY)}}, ckpt)
    out = {}
    for device in ("cpu", "cuda"):
        path = tmp_path / f"{device}.json"
        assert main(["evaluate", "--model", str(ckpt), "--site", "site-1", "--device", device,
                     "--metrics", "dice,hd95,mpa", "--out", str(path)]) == 0
        out[device] = json.loads(path.read_text())["evaluations"][0]["sites"]["site-1"]
    _assert_rows_equal(_rows(out["cuda"]), _rows(out["cpu"]))
