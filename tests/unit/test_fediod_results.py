"""FedIOD's saved student + generator reloads through the result registry (evaluate / sample / show), the site's
teacher settings and checkpoints: its own architecture, reuse on a rerun, clear errors for a teacher that does not load."""


import pytest
import torch

from medflare import ConfigError, ResultFileError
from medflare.cli import main as medflare_main
from medflare.common.results import load_result
from medflare.common.training import make_loader
from medflare.fediod.config import FedIODConfig
from medflare.fediod.networks import server_networks
from medflare.fediod.persistor import describe_student
from medflare.fediod.teacher import checkpoint_file, load_teacher, save_teacher, teacher_settings, train_teacher, unlearnt_warning
from medflare.nets import build_from_spec
from medflare.presets import get_preset


def _save_student(path, preset):
    cfg = get_preset(preset)
    nets = server_networks(cfg, FedIODConfig.from_preset(cfg), seed=1)
    meta = {"fediod_round": 2, "fediod_sites": ["a", "b"], "fediod_privacy": {"a": {"epsilon": 3.5, "delta": 1e-5}},
            "fediod_stopped": {"a": "epsilon budget 3.5 reached"}}
    torch.save({"model": nets.state_dict(), "train_conf": {"medflare": describe_student(preset, None)}, "meta_props": meta}, path)
    return nets


@pytest.mark.parametrize("preset", ["fediod_cls_tiny", "fediod_seg_tiny"])
def test_saved_student_and_generator_reload(tmp_path, preset):
    nets = _save_student(tmp_path / "s.pt", preset)
    result = load_result(tmp_path / "s.pt")
    assert result.kind == "fediod_student"
    assert result.info["privacy"]["a"]["epsilon"] == 3.5 and "budget" in result.info["stopped"]["a"]
    (label, student), = result.predictors({})
    x = torch.rand(2, 1, 28, 28) if preset.startswith("fediod_cls") else torch.rand(2, 1, 32, 32)
    nets.student.eval()
    assert torch.allclose(student(x), nets.student(x), atol=1e-6)
    if preset.startswith("fediod_cls"):
        images = result.sample([], {"num": 3, "seed": 0})
        assert len(images) == 3 and images[0].shape == (1, 28, 28)
    else:
        images = result.sample([torch.zeros(1, 32, 32, dtype=torch.long), torch.ones(1, 32, 32, dtype=torch.long)], {"seed": 0})
        assert [tuple(i.shape) for i in images] == [(1, 32, 32)] * 2
        with pytest.raises(ConfigError, match="--labels"):
            result.sample([], {})


def test_show_lists_privacy(tmp_path, capsys):
    _save_student(tmp_path / "s.pt", "fediod_cls_tiny")
    assert medflare_main(["show", "--model", str(tmp_path / "s.pt")]) == 0
    out = capsys.readouterr().out
    assert "fediod_student" in out and "epsilon" in out and "budget" in out


def test_site_chooses_its_teacher_and_data_fix_its_shape(tmp_path):
    cfg = get_preset("fediod_cls_tiny")
    own = {"fediod": {"teacher": {"name": "resnet8", "args": {"widths": [4, 8, 8], "num_classes": 3}},
                      "teacher_train": {"epochs": 1}, "checkpoint_dir": str(tmp_path)}}
    spec, train, folder, retrain = teacher_settings(own, cfg, "site-1", 10, 1, 28)
    assert spec == {"name": "resnet8", "args": {"widths": [4, 8, 8], "num_classes": 10, "in_channels": 1}}
    assert train["epochs"] == 1 and train["optimizer"] == cfg["train"]["optimizer"] and folder == tmp_path and not retrain
    spec2, *_ = teacher_settings({}, cfg, "site-1", 10, 1, 28)  # nothing set: the preset's network
    assert spec2["name"] == "convnet" and spec2["args"]["image_size"] == 28
    with pytest.raises(ConfigError, match="teacher_epochs"):
        teacher_settings({"fediod": {"teacher_epochs": 3}}, cfg, "site-1", 10, 1, 28)
    # the checkpoint name follows data, spec and training, so changed settings never reuse a stale teacher
    a = checkpoint_file(tmp_path, "site-1", tmp_path / "data.npz", spec, train, 0)
    assert a == checkpoint_file(tmp_path, "site-1", tmp_path / "data.npz", spec, train, 0)
    assert a != checkpoint_file(tmp_path, "site-1", tmp_path / "data.npz", spec, {**train, "epochs": 2}, 0)
    assert a.name.startswith("site-1_")


def test_a_trained_teacher_fits_its_own_data_in_eval_mode():
    """The failure this guards against: at ``fediod_cls`` Dir(0.1), site-3 (classes 1 / 4 / 7), seed 3 the teacher ends
    its training with a train-mode loss of 0.05 but, on its running BatchNorm statistics, 0.36 accuracy on its own
    training images (one class), and the student learnt that site's classes from it (25 % on site-3 through FLARE).
    train_teacher recomputes the statistics over the training set, so the teacher used in eval mode is the one trained."""
    from medflare.data import load_site
    from medflare.metrics import evaluate

    cfg = get_preset("fediod_cls", {"data": {"beta": 0.1, "num_sites": 4}, "fediod": {"teacher_outliers": 0}})
    data = load_site("site-3", cfg["data"])
    spec, train, _, _ = teacher_settings({}, cfg, "site-3", data.num_classes, data.in_channels, 28)
    teacher, _ = train_teacher(spec, train, data.train, data.task, torch.device("cpu"), seed=3)
    assert not teacher.training
    scores = evaluate(teacher, make_loader(data.train, 64, False), task=data.task, num_classes=data.num_classes,
                      metrics=["accuracy"], device="cpu")["mean"]
    assert scores["accuracy"] > 0.9, scores


def test_a_teacher_barely_above_its_majority_class_is_reported():
    counts = torch.tensor([1.0, 211.0, 0.0, 0.0, 202.0, 0.0, 0.0, 200.0, 0.0, 0.0])  # site-3's training labels: 211 / 614
    warning = unlearnt_warning("site-3", 0.358, counts)  # the teacher before its BatchNorm statistics were recomputed
    assert warning and "site-3" in warning and "0.3436" in warning and "fediod.retrain" in warning
    assert unlearnt_warning("site-3", 0.98, counts) is None  # the same teacher after
    assert unlearnt_warning("site-3", 0.50, counts) is not None and unlearnt_warning("site-3", 0.52, counts) is None  # 1/4 of the gap
    assert unlearnt_warning("site-1", 1.0, torch.tensor([0.0, 12.0])) is None  # one class only: nothing to tell apart


def test_teacher_round_trip_and_load_errors(tmp_path):
    spec = {"name": "convnet", "args": {"in_channels": 1, "num_classes": 10, "image_size": 28, "width": 8}}
    model = build_from_spec(spec).eval()
    path = tmp_path / "t.pt"
    save_teacher(path, model, spec, "fediod_cls_tiny", None, "site-1", {"epochs": 1})
    loaded = load_teacher(path, spec, 10)
    x = torch.rand(2, 1, 28, 28)
    assert torch.allclose(loaded(x), model(x))
    assert load_result(path).kind == "model"  # `medflare evaluate --model` scores a teacher
    with pytest.raises(ResultFileError, match="t.pt.*holds"):  # the site changed its architecture
        load_teacher(path, {**spec, "args": {**spec["args"], "width": 16}}, 10)
    with pytest.raises(ResultFileError, match="predicts 10 classes"):
        load_teacher(path, spec, 5)
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ResultFileError, match="bad.pt"):
        load_teacher(bad, spec, 10)
