"""Site-data resolution (MEDFLARE_DATA, local/medflare_data.json, embedded default) and load_site."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

from medflare import MedflareError
from medflare.data import SiteData, load_site, make_cls_sites, make_seg_site, resolve_site_source
from medflare.presets import get_preset

SEG_TINY = {"kind": "synthetic_seg", "image_size": 16, "num_classes": 3, "seed": 0, "scale": 0.05}
CLS_TINY = {"kind": "synthetic_cls", "num_sites": 3, "beta": 0.5, "scale": 0.05, "num_classes": 10, "channels": 1}


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("MEDFLARE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MEDFLARE_DATA", raising=False)


def test_embedded_seg_default_is_generated_once_and_cached(tmp_path):
    first = resolve_site_source("site-2", SEG_TINY)
    assert first.is_file() and str(first).startswith(str(tmp_path / "cache"))
    mtime = first.stat().st_mtime_ns
    assert resolve_site_source("site-2", SEG_TINY) == first and first.stat().st_mtime_ns == mtime
    other = resolve_site_source("site-2", dict(SEG_TINY, image_size=24))
    assert other.parent.parent != first.parent.parent  # different params, different folder


def test_embedded_default_is_race_safe(tmp_path):
    results, errors = [], []

    def work():
        try:
            results.append(resolve_site_source("site-5", SEG_TINY))
        except Exception as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert not [p for p in results[0].parent.parent.iterdir() if p.name.startswith(".tmp")]


def test_load_site_segmentation_default(tmp_path):
    sd = load_site("site-1", SEG_TINY)
    assert isinstance(sd, SiteData) and sd.task == "segmentation" and sd.num_classes == 3 and sd.in_channels == 1
    assert len(sd.train) >= 4 and len(sd.val) >= 2 and len(sd.test) >= 2 and sd.source.suffix == ".json"
    batch = next(iter(torch.utils.data.DataLoader(sd.train, batch_size=3)))
    assert batch["image"].shape == (3, 1, 16, 16) and batch["label"].shape == (3, 1, 16, 16)
    # site-1 has max(8, round(240 * 0.05)) = 12 cases, split 50/25/25; each split is the datalist's own
    datalist = json.loads(sd.source.read_text())
    for ds, key, n in ((sd.train, "training", 6), (sd.val, "validation", 3), (sd.test, "testing", 3)):
        assert len(ds) == n == len(datalist[key])
        assert [ds[i]["name"] for i in range(n)] == [e["image"].split("/")[-1] for e in datalist[key]]


def test_load_site_classification_default():
    sd = load_site("site-3", CLS_TINY)
    assert sd.task == "classification" and sd.num_classes == 10 and sd.in_channels == 1 and sd.source.name == "site-3.npz"
    assert len(sd.train) > len(sd.val) > 0 and len(sd.test) > 0
    assert (sd.train[0]["name"], sd.val[0]["name"], sd.test[0]["name"]) == ("train_0", "val_0", "test_0")
    with pytest.raises(MedflareError, match=r"site-4.*site-1..site-3"):
        load_site("site-4", CLS_TINY)


def test_presets_resolve(tmp_path):
    data = dict(get_preset("seg_synthetic_tiny")["data"], scale=0.05)
    assert load_site("site-6", data).train[0]["image"].shape == (1, 32, 32)


def test_medflare_data_env_takes_precedence(tmp_path, monkeypatch):
    make_cls_sites(tmp_path / "hospital", num_sites=2, scale=0.05)
    monkeypatch.setenv("MEDFLARE_DATA", str(tmp_path / "hospital"))
    assert resolve_site_source("site-2", CLS_TINY) == tmp_path / "hospital" / "site-2.npz"
    sd = load_site("site-2", get_preset("cls_medmnist")["data"])
    assert sd.source == tmp_path / "hospital" / "site-2.npz" and sd.num_classes == 10


def test_error_medflare_data_without_site_file(tmp_path, monkeypatch):
    (tmp_path / "hospital").mkdir()
    monkeypatch.setenv("MEDFLARE_DATA", str(tmp_path / "hospital"))
    for cfg in (SEG_TINY, {"kind": "datalist", "num_classes": 3}):  # never silently falls back to synthetic
        with pytest.raises(MedflareError, match=r"site 'site-1'.*hospital.*site-1.json"):
            resolve_site_source("site-1", cfg)


def test_error_medflare_data_has_other_task(tmp_path, monkeypatch):
    make_cls_sites(tmp_path / "h", num_sites=1, scale=0.05)
    monkeypatch.setenv("MEDFLARE_DATA", str(tmp_path / "h"))
    with pytest.raises(MedflareError, match=r"site-1.npz, which is not segmentation"):
        resolve_site_source("site-1", {"kind": "datalist", "num_classes": 3})


@pytest.mark.parametrize("key", ["datalist", "data_dir"])
def test_local_config_resolution(tmp_path, key):
    data_dir = tmp_path / "data"
    json_path = make_seg_site("hospital-a", data_dir, image_size=16, scale=0.05)
    local = tmp_path / "local"
    local.mkdir()
    value = "../data/hospital-a.json" if key == "datalist" else str(data_dir)
    (local / "medflare_data.json").write_text(json.dumps({key: value}))
    assert resolve_site_source("hospital-a", {"kind": "datalist"}, local).resolve() == json_path.resolve()
    sd = load_site("hospital-a", {"kind": "datalist", "num_classes": 3}, local_dir=local, cache=False)
    assert sd.source.resolve() == json_path.resolve() and len(sd.train) >= 4


def test_local_config_npz(tmp_path):
    paths = make_cls_sites(tmp_path, num_sites=1, scale=0.05)
    (tmp_path / "medflare_data.json").write_text(json.dumps({"npz": str(paths["site-1"])}))
    assert load_site("any-name", {"kind": "npz", "num_classes": 10}, local_dir=tmp_path).source == paths["site-1"]


def test_error_local_config_bad(tmp_path):
    (tmp_path / "medflare_data.json").write_text(json.dumps({"datalist": "missing.json"}))
    with pytest.raises(MedflareError, match=r"medflare_data.json.*missing.json"):
        resolve_site_source("site-1", {"kind": "datalist"}, tmp_path)
    (tmp_path / "medflare_data.json").write_text(json.dumps({"path": "x"}))
    with pytest.raises(MedflareError, match=r"medflare_data.json.*'datalist', 'npz', 'data_dir'"):
        resolve_site_source("site-1", {"kind": "datalist"}, tmp_path)


def test_error_nothing_configured_for_hospital_kind():
    with pytest.raises(MedflareError, match=r"site 'site-1'.*MEDFLARE_DATA.*medflare_data.json"):
        resolve_site_source("site-1", {"kind": "npz"})
    with pytest.raises(MedflareError, match=r'e.g. \{"npz": "/path/to/site-1.npz"\}'):
        resolve_site_source("site-1", {"kind": "npz"})
    with pytest.raises(MedflareError, match=r'e.g. \{"datalist": "/path/to/site-1.json"\}'):
        resolve_site_source("site-1", {"kind": "datalist"})


def test_error_unknown_data_kind():
    with pytest.raises(MedflareError, match=r"'nifti3d'.*'data.kind'"):
        load_site("site-1", {"kind": "nifti3d"})


def test_error_channel_mismatch_and_site_named(tmp_path, monkeypatch):
    make_cls_sites(tmp_path, num_sites=1, channels=3, scale=0.05)
    monkeypatch.setenv("MEDFLARE_DATA", str(tmp_path))
    with pytest.raises(MedflareError, match=r"site 'site-1'.*3-channel.*'data.channels'"):
        load_site("site-1", {"kind": "npz", "num_classes": 10, "channels": 1})


def test_error_bad_hospital_file_names_site(tmp_path, monkeypatch):
    np.savez(tmp_path / "site-1.npz", train_images=np.zeros((2, 8, 8), np.uint8))
    monkeypatch.setenv("MEDFLARE_DATA", str(tmp_path))
    with pytest.raises(MedflareError, match=r"site 'site-1'.*site-1.npz.*'train_labels'"):
        load_site("site-1", {"kind": "npz", "num_classes": 10})
