import copy

import pytest
import torch
from torch.utils.data import Dataset

from medflare import ConfigError, MedflareError
from medflare.common.report import markdown_table, site_table
from medflare.common.training import make_loader, make_loss, make_optimizer, recompute_batchnorm, train_epochs
from medflare.presets import PRESETS, get_preset


def test_presets_resolve_and_overrides_merge():
    before = copy.deepcopy(PRESETS["seg_synthetic"])
    cfg = get_preset("seg_synthetic", {"train": {"epochs": 7}})
    assert cfg["train"]["epochs"] == 7 and cfg["train"]["lr"] == before["train"]["lr"]
    assert PRESETS["seg_synthetic"] == before  # the preset itself is untouched


def test_unknown_preset_and_key_are_named():
    with pytest.raises(MedflareError, match="nope"):
        get_preset("nope")
    with pytest.raises(MedflareError, match="train.epochz"):
        get_preset("seg_synthetic", {"train": {"epochz": 1}})


def test_unknown_loss_and_optimizer_are_named():
    with pytest.raises(MedflareError, match="focal"):
        make_loss("focal", "segmentation")
    with pytest.raises(MedflareError, match="rmsprop"):
        make_optimizer("rmsprop", [torch.nn.Parameter(torch.zeros(1))], 0.1)


class _Squares(Dataset):
    """A bright square on dark background: label = the square."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x0, y0 = torch.randint(0, 8, (2,), generator=g).tolist()
        label = torch.zeros(1, 16, 16, dtype=torch.long)
        label[0, y0 : y0 + 8, x0 : x0 + 8] = 1
        image = label.float() + 0.1 * torch.randn(1, 16, 16, generator=g)
        return {"image": image, "label": label}


def test_train_epochs_lowers_the_dice_loss_and_respects_max_steps():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 2, 1))
    opt = make_optimizer("adam", model.parameters(), 1e-2)
    loss_fn = make_loss("dice", "segmentation")
    stats = train_epochs(model, make_loader(_Squares(), 8, True), loss_fn, opt, epochs=6)
    assert stats.steps == 24 and stats.samples == 192
    assert sum(stats.losses[-4:]) / 4 < 0.5 * sum(stats.losses[:4]) / 4
    capped = train_epochs(model, make_loader(_Squares(), 8, True), loss_fn, opt, epochs=6, max_steps=5)
    assert capped.steps == 5


def test_recompute_batchnorm_sets_the_training_sets_statistics():
    """After the pass, a BatchNorm layer's running mean and variance are those of its inputs over the whole data set
    (one batch: exactly), whatever stale averages it held; a network without BatchNorm is left untouched."""
    torch.manual_seed(0)
    conv, bn = torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.BatchNorm2d(4)
    model = torch.nn.Sequential(conv, bn, torch.nn.ReLU())
    bn.running_mean.fill_(5.0), bn.running_var.fill_(9.0)  # stale: what a last small batch could leave
    data = _Squares()
    assert recompute_batchnorm(model, data, len(data))
    with torch.no_grad():
        features = conv(torch.stack([data[i]["image"] for i in range(len(data))]))
    torch.testing.assert_close(bn.running_mean, features.mean(dim=(0, 2, 3)))
    torch.testing.assert_close(bn.running_var, features.var(dim=(0, 2, 3)), rtol=1e-4, atol=1e-6)
    assert bn.momentum == 0.1 and model.training  # its momentum and mode as before
    plain = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 1))
    before = copy.deepcopy(plain.state_dict())
    assert not recompute_batchnorm(plain, data, 8)
    assert all(torch.equal(before[k], v) for k, v in plain.state_dict().items())


def test_nonfinite_loss_is_a_clear_error():
    model = torch.nn.Conv2d(1, 2, 1)
    with pytest.raises(MedflareError, match="lr"):
        train_epochs(model, make_loader(_Squares(), 8, False), lambda out, y: out.sum() * float("nan"),
                     make_optimizer("sgd", model.parameters(), 0.1), epochs=1)


def test_site_table_client_average_vs_global():
    per_site = {
        "a": {"mean": {"dice": 1.0}, "per_case": [{"dice": 1.0}]},
        "b": {"mean": {"dice": 0.5}, "per_case": [{"dice": 0.5}, {"dice": 0.5}, {"dice": 0.5}]},
    }
    t = site_table(per_site)
    assert t["client_average"]["dice"] == pytest.approx(0.75)  # sites weigh equally
    assert t["global"]["dice"] == pytest.approx(0.625)  # cases weigh equally
    md = markdown_table({"fedavg": t})
    assert "| fedavg | 100.00 | 50.00 | 75.00 | 62.50 |" in md


# ---- issue 28: a setting that trains nothing, or fails later inside torch, is refused at start ---------------
@pytest.mark.parametrize("section,key,value", [
    ("train", "lr", 0), ("train", "lr", -0.01), ("train", "lr", float("nan")), ("train", "batch_size", 0),
    ("train", "epochs", 0), ("train", "max_steps", -1), ("train", "num_workers", -2), ("eval", "batch_size", -1),
])
def test_a_setting_out_of_range_is_a_config_error_naming_the_key(section, key, value):
    """``lr`` 0 trained nothing and ended rc 0; ``lr`` -0.01 and ``batch_size`` 0 reached torch's raw ValueError."""
    with pytest.raises(ConfigError, match=rf"preset 'seg_synthetic_tiny': '{section}\.{key}' must be"):
        get_preset("seg_synthetic_tiny", {section: {key: value}})


def test_every_shipped_preset_passes_its_own_checks():
    for name in PRESETS:
        get_preset(name)


@pytest.mark.parametrize("workflow", ["ResilientFedAvg", "ResilientScaffold"])
def test_zero_rounds_is_a_config_error_of_the_baseline_workflows(workflow):
    """``num_rounds`` 0 ended rc 0 with "Finished FedAvg" and no model file (medflare's own workflows already refused it)."""
    from medflare.baselines import controller

    with pytest.raises(ConfigError, match=rf"{workflow}: 'num_rounds' must be a positive int, got 0"):
        getattr(controller, workflow)(num_rounds=0)


def test_overrides_from_assignments_builds_nested_json_values():
    from medflare.presets import overrides_from_assignments

    got = overrides_from_assignments(["train.lr=0.01", "fediod.ensemble=mean", "model.args.channels=[8,16]", "train.lr=0.02",
                                      "data.augment.flip=false"])
    assert got == {"train": {"lr": 0.02}, "fediod": {"ensemble": "mean"}, "model": {"args": {"channels": [8, 16]}},
                   "data": {"augment": {"flip": False}}}
    for bad in ("train.lr", "=3", "train..lr=1"):
        with pytest.raises(ConfigError, match="key=value"):
            overrides_from_assignments([bad])
