"""Embedded synthetic data: determinism, site heterogeneity, class patterns, Dirichlet partition."""

from __future__ import annotations

import nibabel as nib
import numpy as np
import pytest
import torch

from medflare.data import (
    STYLE_TABLE,
    dirichlet_label_skew,
    load_npz_split,
    load_seg_split,
    make_cls_sites,
    make_seg_site,
    segmentation_style,
)
from medflare.data.synthetic_cls import render_image


def _site_arrays(json_path):
    """All raw (image, label) arrays of a generated site, in datalist order."""
    import json

    content = json.loads(json_path.read_text())
    entries = content["training"] + content["validation"] + content["testing"]
    return [(nib.load(json_path.parent / e["image"]).get_fdata(), nib.load(json_path.parent / e["label"]).get_fdata()) for e in entries]


def test_seg_generation_is_deterministic(tmp_path):
    a = _site_arrays(make_seg_site("site-2", tmp_path / "a", image_size=32, scale=0.2))
    b = _site_arrays(make_seg_site("site-2", tmp_path / "b", image_size=32, scale=0.2))
    assert len(a) == len(b) >= 8
    for (ia, la), (ib, lb) in zip(a, b):
        assert ia.tobytes() == ib.tobytes() and la.tobytes() == lb.tobytes()
    c = _site_arrays(make_seg_site("site-2", tmp_path / "c", image_size=32, scale=0.2, seed=1))
    assert not np.array_equal(a[0][0], c[0][0])


def test_seg_site_loads_as_channel_first_with_valid_labels(tmp_path):
    path = make_seg_site("site-1", tmp_path, image_size=32, scale=0.1)
    ds = load_seg_split(path, "training", num_classes=3)
    item = ds[0]
    assert item["image"].shape == (1, 32, 32) and item["image"].dtype == torch.float32
    assert item["label"].shape == (1, 32, 32) and item["label"].dtype == torch.int64
    assert 0.0 <= item["image"].min() and item["image"].max() <= 1.0
    assert set(torch.unique(item["label"]).tolist()) == {0, 1, 2}
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=2)))
    assert type(batch["image"]) is torch.Tensor and batch["image"].shape == (2, 1, 32, 32)
    assert batch["name"][0].endswith(".nii.gz")


def test_seg_two_classes_is_a_disc(tmp_path):
    ds = load_seg_split(make_seg_site("site-3", tmp_path, image_size=32, num_classes=2, scale=0.1), "testing", num_classes=2)
    assert set(torch.unique(ds[0]["label"]).tolist()) == {0, 1}


def test_seg_sites_differ_in_intensity_contrast_and_size(tmp_path):
    stats = {}
    for k in (1, 2, 4, 5):
        arrays = _site_arrays(make_seg_site(f"site-{k}", tmp_path, image_size=32, scale=0.25))
        disc = np.mean([img[lbl > 0].mean() for img, lbl in arrays])
        background = np.mean([img[lbl == 0].mean() for img, lbl in arrays])
        noise = np.mean([np.abs(np.diff(img, axis=0)).mean() for img, _ in arrays])
        stats[k] = dict(n=len(arrays), disc=disc, background=background, noise=noise, mean=np.mean([a[0].mean() for a in arrays]))
    assert stats[1]["disc"] > stats[1]["background"] + 0.2  # bright disc (fundus / MRI-like)
    assert stats[2]["disc"] < stats[2]["background"] - 0.2  # inverted contrast (CT-like)
    assert stats[4]["noise"] > 2 * stats[1]["noise"]
    assert max(s["mean"] for s in stats.values()) - min(s["mean"] for s in stats.values()) > 0.2
    assert stats[1]["n"] >= 4 * stats[4]["n"]  # very different dataset sizes
    assert any(s["invert"] for s in STYLE_TABLE) and not all(s["invert"] for s in STYLE_TABLE)


def test_styles_cycle_with_jitter_and_hash_names_are_stable():
    assert segmentation_style("site-1") == segmentation_style("site-1", seed=0)
    s7 = segmentation_style("site-7")
    assert s7["family"] == STYLE_TABLE[0]["family"] and s7 != segmentation_style("site-1")
    assert s7["gamma"] == pytest.approx(STYLE_TABLE[0]["gamma"], rel=0.16)
    h = segmentation_style("hospital-berlin", seed=3)
    assert h == segmentation_style("hospital-berlin", seed=3)
    assert h["family"] in {s["family"] for s in STYLE_TABLE}
    families = {segmentation_style(f"h{i}")["family"] for i in range(40)}
    assert len(families) >= 4


def test_seg_scale_keeps_every_split_non_empty(tmp_path):
    path = make_seg_site("site-4", tmp_path, image_size=16, scale=0.01)
    for split in ("training", "validation", "testing"):
        assert len(load_seg_split(path, split, num_classes=3, cache=False)) >= 2
    # scale 0.01 leaves round(40 * 0.01) = 0 cases; the floor of 8 splits 50/25/25
    assert [len(load_seg_split(path, s, num_classes=3, cache=False)) for s in ("training", "validation", "testing")] == [4, 2, 2]


def test_cls_generation_is_deterministic_and_medmnist_layout(tmp_path):
    a = make_cls_sites(tmp_path / "a", num_sites=4, scale=0.1)
    b = make_cls_sites(tmp_path / "b", num_sites=4, scale=0.1)
    assert list(a) == ["site-1", "site-2", "site-3", "site-4"]
    for site in a:
        za, zb = np.load(a[site]), np.load(b[site])
        assert sorted(za.files) == sorted(["train_images", "train_labels", "val_images", "val_labels", "test_images", "test_labels"])
        for key in za.files:
            assert np.array_equal(za[key], zb[key])
        assert za["train_images"].dtype == np.uint8 and za["train_images"].shape[1:] == (28, 28)
        assert za["train_labels"].shape[1] == 1
    # the pool of round(6000 * 0.1) = 600 images, 60 per class, is dealt out whole, each site split 70/15/15
    counts, total = np.zeros(10, int), 0
    for site in a:
        z = np.load(a[site])
        n = [len(z[f"{s}_labels"]) for s in ("train", "val", "test")]
        assert n[1] == n[2] == max(1, round(0.15 * sum(n))) and all(len(z[f"{s}_images"]) == k for s, k in zip(("train", "val", "test"), n))
        for s in ("train", "val", "test"):
            counts += np.bincount(z[f"{s}_labels"][:, 0], minlength=10)
        total += sum(n)
    assert total == 600 and counts.tolist() == [60] * 10


def test_cls_three_channels(tmp_path):
    paths = make_cls_sites(tmp_path, num_sites=2, channels=3, scale=0.05)
    ds = load_npz_split(paths["site-1"], "train", num_classes=10)
    assert ds[0]["image"].shape == (3, 28, 28) and ds[0]["label"].dtype == torch.int64 and ds[0]["label"].ndim == 0


def _linear_accuracy(features: np.ndarray, labels: np.ndarray) -> float:
    """Held-out accuracy of a ridge-regularised linear one-vs-all classifier on ``features`` (N, F)."""
    x = (features - features.mean(0)) / (features.std(0) + 1e-8)
    x = np.concatenate([x, np.ones((len(x), 1))], 1)
    onehot = np.eye(int(labels.max()) + 1)[labels]
    half = len(labels) // 2
    w = np.linalg.solve(x[:half].T @ x[:half] + 1.0 * np.eye(x.shape[1]), x[:half].T @ onehot[:half])
    return float(((x[half:] @ w).argmax(1) == labels[half:]).mean())


def _nearest_class_mean_accuracy(feature: np.ndarray, labels: np.ndarray) -> float:
    """Held-out accuracy of assigning each sample the class whose mean ``feature`` (N,) is nearest."""
    half = len(labels) // 2
    means = np.array([feature[:half][labels[:half] == c].mean() for c in range(int(labels.max()) + 1)])
    return float((np.abs(feature[half:, None] - means).argmin(1) == labels[half:]).mean())


def test_cls_classes_not_separable_by_pixel_statistics():
    rng = np.random.default_rng(0)
    labels = rng.permutation(np.arange(2000) % 10)
    images = np.stack([render_image(int(c), rng, 28) for c in labels])
    stats = np.stack([images.mean((1, 2)), images.std((1, 2))], 1)
    assert _linear_accuracy(stats, labels) < 0.35
    assert _nearest_class_mean_accuracy(images.mean((1, 2)), labels) < 0.35
    assert _nearest_class_mean_accuracy(images[:, 14, 14], labels) < 0.35  # the centre pixel
    assert _linear_accuracy(images.reshape(len(images), -1), labels) < 0.6  # not even linearly easy


@pytest.mark.parametrize("beta", [0.02, 0.05, 0.1, 1.0])
def test_dirichlet_uses_every_index_once_and_min_size(beta):
    labels = np.repeat(np.arange(10), 300)
    parts = dirichlet_label_skew(labels, 10, beta, seed=1, min_per_site=10)
    joined = np.concatenate(parts)
    assert len(parts) == 10 and len(joined) == len(labels)
    assert np.array_equal(np.sort(joined), np.arange(len(labels)))
    assert min(len(p) for p in parts) >= 10


def _top2_share(parts, labels):
    return np.mean([np.sort(np.bincount(labels[p], minlength=10))[-2:].sum() / len(p) for p in parts])


def test_dirichlet_small_beta_skews_labels_more_than_beta_one():
    labels = np.repeat(np.arange(10), 300)
    skewed = _top2_share(dirichlet_label_skew(labels, 10, 0.05), labels)
    mild = _top2_share(dirichlet_label_skew(labels, 10, 1.0), labels)
    assert skewed > 0.8 and mild < 0.65 and skewed > mild + 0.2
    assert all(np.array_equal(a, b) for a, b in zip(dirichlet_label_skew(labels, 10, 0.1), dirichlet_label_skew(labels, 10, 0.1)))
