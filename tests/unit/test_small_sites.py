"""Issue 31, small hospitals: the step floor (train.min_steps), the batch cap (train.max_batch_fraction) and the
warning line of a round below train.warn_steps."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from nvflare.apis.fl_context import FLContext

from medflare import ConfigError
from medflare.common.site_executor import SiteExecutor
from medflare.common.training import capped_batch_size, local_work, make_loader, train_epochs
from medflare.presets import PRESETS, get_preset


def _round_steps(num_train: int, train: dict) -> int:
    """The optimiser steps of one round on a site of ``num_train`` cases under preset ``train`` settings."""
    data = [{"image": torch.full((1,), float(i % 2)), "label": torch.tensor(i % 2)} for i in range(num_train)]
    model = torch.nn.Linear(1, 2)
    batch = capped_batch_size(train["batch_size"], num_train, train["max_batch_fraction"])
    loader = make_loader(data, batch, True)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    return train_epochs(model, loader, torch.nn.functional.cross_entropy, opt, **local_work(train)).steps


def test_floor_and_cap_give_the_stated_steps_on_a_50_image_site_and_leave_a_5000_image_site_unchanged():
    train = get_preset("cls_synthetic")["train"]  # batch 64, 1 epoch a round
    assert train["min_steps"] > 0 and 0 < train["max_batch_fraction"] < 1
    small_batch = capped_batch_size(64, 50, train["max_batch_fraction"])
    assert small_batch == max(1, int(train["max_batch_fraction"] * 50)) < 50
    # before issue 31: one step (the whole site in one batch of 50); now the floor, at the capped batch
    assert _round_steps(50, {**train, "min_steps": 0, "max_batch_fraction": 1.0}) == 1
    assert _round_steps(50, train) == max(train["min_steps"], math.ceil(50 / small_batch))
    assert (small_batch, _round_steps(50, train)) == (5, 25)  # the defaults: batch 64 -> 5 (0.1 x 50), 25 steps
    # a 5000-image site: 79 steps of 64 either way (neither the floor nor the cap binds)
    assert capped_batch_size(64, 5000, train["max_batch_fraction"]) == 64
    assert _round_steps(5000, train) == _round_steps(5000, {**train, "min_steps": 0, "max_batch_fraction": 1.0}) == 79
    # max_steps still caps the floor; more epochs than the floor needs: the epochs count
    assert _round_steps(50, {**train, "max_steps": 3}) == 3
    assert _round_steps(50, {**train, "epochs": 3}) == 3 * math.ceil(50 / small_batch) == 30


def test_every_preset_has_the_small_site_keys_and_they_are_checked():
    for name in PRESETS:
        train = get_preset(name)["train"]
        assert {"min_steps", "max_batch_fraction", "warn_steps"} <= set(train), name
    for bad in ({"min_steps": -1}, {"min_steps": 2.5}, {"max_batch_fraction": 0}, {"max_batch_fraction": 1.5},
                {"max_batch_fraction": True}, {"warn_steps": -3}):
        with pytest.raises(ConfigError, match=f"train.{next(iter(bad))}"):
            get_preset("cls_synthetic", {"train": bad})


def _site(overrides: dict) -> tuple[SiteExecutor, list]:
    ex = SiteExecutor(preset="cls_synthetic", overrides=overrides, device="cpu")
    ex.site, sent = "site-3", []
    ex.tracker.scalars = lambda fl_ctx, values, step, prefix="": sent.append((dict(values), step))
    return ex, sent


def test_a_round_below_warn_steps_logs_one_warning_naming_site_steps_and_knob(caplog):
    ex, sent = _site({"train": {"max_steps": 2, "warn_steps": 10}})
    with caplog.at_level("INFO"):
        ex.log_steps(FLContext(), 4, 2, "mean loss 0.5")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, caplog.text
    assert "site 'site-3'" in warnings[0] and "2 optimisation steps" in warnings[0] and "train.min_steps" in warnings[0]
    assert "round 4: 2 local steps, mean loss 0.5" in caplog.text
    assert sent == [({"train/steps": 2.0}, 4)]
    caplog.clear()
    with caplog.at_level("INFO"):
        ex.log_steps(FLContext(), 5, 10)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_start_run_caps_the_batch_at_the_sites_share_and_says_so():
    ex, _ = _site({"train": {"batch_size": 64, "max_batch_fraction": 0.25}})
    ex.data = SimpleNamespace(train=list(range(50)))
    note = ex._cap_batch()
    assert ex.cfg["train"]["batch_size"] == 12 and "max_batch_fraction 0.25" in note and "50 training cases" in note
    big, _ = _site({"train": {"batch_size": 64, "max_batch_fraction": 0.25}})
    big.data = SimpleNamespace(train=list(range(5000)))
    assert big._cap_batch() == "" and big.cfg["train"]["batch_size"] == 64
