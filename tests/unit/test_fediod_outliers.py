"""Outlier exposure of a FedIOD classification teacher (``fediod.teacher_outliers``, :mod:`medflare.fediod.outliers`):
the mosaics are the site's own patches reordered, the uniform term is minimal at a uniform answer, the setting reaches
stage 1 (and the checkpoint's name), and a teacher trained with it answers the classes its site lacks without the
confidence it has on its own, while still knowing those."""

import math

import pytest
import torch

from medflare import ConfigError
from medflare.fediod.outliers import OutlierExposure, shuffled_patches, uniform_cross_entropy
from medflare.fediod.teacher import checkpoint_file, teacher_settings, train_teacher
from medflare.fedvck.condense import stack_dataset
from medflare.presets import get_preset


def _patches(image: torch.Tensor, p: int) -> list[torch.Tensor]:
    h, w = image.shape[-2:]
    return [image[..., i:i + p, j:j + p] for i in range(0, h - p + 1, p) for j in range(0, w - p + 1, p)]


def test_a_mosaic_is_the_images_own_patches_reordered():
    x = torch.arange(3 * 2 * 30 * 29, dtype=torch.float32).reshape(3, 2, 30, 29)
    y = shuffled_patches(x, 4, torch.Generator().manual_seed(0))
    assert y.shape == x.shape and not torch.equal(x, y)
    assert torch.equal(y[..., 28:, :], x[..., 28:, :]) and torch.equal(y[..., :, 28:], x[..., :, 28:])  # the remainder stays
    for b in range(3):  # every 7x7 patch of the mosaic is a whole patch of the same image (all channels moved together)
        own = _patches(x[b, :, :28, :28], 7)
        for patch in _patches(y[b, :, :28, :28], 7):
            assert sum(torch.equal(patch, o) for o in own) == 1
    for b in range(3):  # and nothing else: no pixel of another image, none lost
        assert torch.equal(y[b].flatten().sort().values, x[b].flatten().sort().values)
    orders = {tuple(int(v) for v in (y[b, 0, ::7, ::7] - x[b, 0, 0, 0]).flatten()) for b in range(3)}
    assert len(orders) > 1  # each image has its own order
    v = torch.rand(2, 1, 8, 9, 10)  # 3D: same multiset of voxels
    w = shuffled_patches(v, 2, torch.Generator().manual_seed(1))
    assert torch.equal(v.flatten(1).sort().values, w.flatten(1).sort().values) and not torch.equal(v, w)
    with pytest.raises(ValueError, match="cannot be cut"):
        shuffled_patches(torch.rand(1, 1, 3, 28), 4)


def test_the_uniform_term_is_least_at_a_uniform_answer():
    flat = torch.zeros(4, 10)
    assert uniform_cross_entropy(flat).item() == pytest.approx(math.log(10))
    sure = torch.zeros(4, 10)
    sure[:, 3] = 8.0
    assert uniform_cross_entropy(sure).item() > math.log(10) + 2
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 3))
    oe = OutlierExposure(model, torch.nn.CrossEntropyLoss(), 0.5, grid=2)
    x, y = torch.rand(5, 1, 4, 4), torch.tensor([0, 1, 2, 0, 1])
    logits = oe(x)
    assert logits.shape == (10, 3)
    expected = torch.nn.functional.cross_entropy(logits[:5], y) + 0.5 * uniform_cross_entropy(logits[5:])
    assert oe.loss(logits, y).item() == pytest.approx(expected.item())
    oe.eval()
    assert torch.equal(oe(x), model(x))  # in eval mode the classifier alone


def test_the_setting_reaches_stage_one_and_the_checkpoint_name(tmp_path):
    cfg = get_preset("fediod_cls_tiny", {"fediod": {"teacher_outliers": 0.5}})
    spec, train, _, _ = teacher_settings({}, cfg, "site-1", 10, 1, 28)
    assert train["outliers"] == 0.5
    assert teacher_settings({}, get_preset("fediod_cls"), "site-1", 10, 1, 28)[1]["outliers"] == 0.5  # the preset's default
    _, plain, _, _ = teacher_settings({}, get_preset("fediod_cls_tiny"), "site-1", 10, 1, 28)
    assert "outliers" not in plain  # off: the name of a teacher trained without it is unchanged
    _, own, _, _ = teacher_settings({"fediod": {"teacher_train": {"outliers": 0}}}, cfg, "site-1", 10, 1, 28)
    assert "outliers" not in own  # a site turns it off for its teacher
    name = lambda t: checkpoint_file(tmp_path, "site-1", tmp_path / "d.npz", spec, t, 0)  # noqa: E731
    assert name(train) != name(plain)
    for bad in (-1, "x", float("inf")):
        with pytest.raises(ConfigError, match="outlier weight"):
            teacher_settings({"fediod": {"teacher_train": {"outliers": bad}}}, cfg, "site-1", 10, 1, 28)
    seg = get_preset("fediod_seg_tiny", {"fediod": {"teacher_outliers": 0.5}})
    spec, train, _, _ = teacher_settings({}, seg, "site-1", 3, 1, 32)
    with pytest.raises(ConfigError, match="classification teachers"):
        train_teacher(spec, train, [], "segmentation", torch.device("cpu"))


def test_a_teacher_with_outlier_exposure_is_unsure_on_the_classes_its_site_lacks():
    """``fediod_cls`` at Dir(0.1), 4 sites: site-3 holds classes 1 / 4 / 7. Trained as stage 1 trains it, its teacher
    gives the other sites' test images of the seven classes it lacks a mean top probability of 0.89, above 0.9 on 65 %
    of them (confident wrong votes in the ensemble); with outlier exposure 0.78 and 44 %, while it still knows its own
    classes (0.98 accuracy on its own test images, 0.95 without)."""
    from medflare.data import load_site

    cfg = get_preset("fediod_cls", {"data": {"beta": 0.1, "num_sites": 4}, "fediod": {"teacher_outliers": 0.5}})
    data = {s: load_site(s, cfg["data"]) for s in ("site-1", "site-2", "site-3", "site-4")}
    own_classes = {int(item["label"]) for item in data["site-3"].train}

    foreign, _ = stack_dataset([i for s, d in data.items() if s != "site-3" for i in d.test if int(i["label"]) not in own_classes])
    x_own, y_own = stack_dataset([i for i in data["site-3"].test if int(i["label"]) in own_classes])
    results = {}
    for weight in (0.0, 0.5):
        spec, train, _, _ = teacher_settings({"fediod": {"teacher_train": {"outliers": weight}}}, cfg, "site-3", 10, 1, 28)
        teacher, _ = train_teacher(spec, train, data["site-3"].train, "classification", torch.device("cpu"), seed=3)
        with torch.no_grad():
            top = teacher(foreign).softmax(1).max(1).values
            accuracy = (teacher(x_own).argmax(1) == y_own).float().mean().item()
        results[weight] = (top.mean().item(), accuracy, (top > 0.9).float().mean().item())
    (top_plain, acc_plain, sure_plain), (top_oe, acc_oe, sure_oe) = results[0.0], results[0.5]
    assert top_plain > 0.8 and top_oe < top_plain - 0.07, results
    assert sure_oe < sure_plain - 0.12, results
    assert acc_oe > 0.85 and acc_oe > acc_plain - 0.1, results
