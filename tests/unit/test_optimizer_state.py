"""``train.optimizer_state``: a site's optimiser carries its state from one round to the next ("kept", the default)
or each round starts a fresh one from the received model ("fresh"). Driven through the FedAvg site executor for two
rounds in this process: Adam's per-parameter step count after round 2 is the sum of both rounds' steps when kept and
round 2's alone when fresh, so a site that ignored the key fails one of the two cases. FedSM's site (two optimisers, the
global and the personalised model's) and FedST's segmentation site are driven the same way through their own tasks."""

from __future__ import annotations

import pytest
import torch
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_constant import FLContextKey, ReservedKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.signal import Signal
from nvflare.apis.workspace import Workspace
from nvflare.app_common.abstract.fl_model import FLModel
from nvflare.app_common.utils.fl_model_utils import FLModelUtils

from medflare import ConfigError
from medflare.baselines.executor import SupervisedExecutor
from medflare.common.payload import flatten, state_to_numpy
from medflare.common.site_executor import SiteExecutor
from medflare.common.training import round_optimizer
from medflare.data import make_seg_site
from medflare.data.util import DATA_ENV
from medflare.fedsm import protocol as P
from medflare.fedsm.executor import FedSMExecutor
from medflare.fedsm.selector import build_selector, selector_spec
from medflare.fedst import protocol as FST
from medflare.fedst.executor import SegmentationExecutor
from medflare.presets import get_preset

PRESET = "seg_images_2d"
TINY = {"data": {"channels": 1, "num_classes": 3, "labels": "as_is", "image_size": [16, 16], "cache": {"mode": "none"}},
        "model": {"args": {"in_channels": 1, "out_channels": 3, "channels": [4, 8], "strides": [2]}},
        "train": {"min_steps": 3, "max_steps": 3, "batch_size": 2}}


def _site(tmp_path, monkeypatch, state: str, cls: type[SiteExecutor] = SupervisedExecutor, **extra: dict) -> SiteExecutor:
    """A started site ``site-1`` (FedAvg's unless ``cls``) on a tiny datalist of its own, ``train.optimizer_state`` = ``state``
    (``extra``: more preset sections)."""
    root = tmp_path / "ws" / "site-1"
    for folder in ("local", "startup"):
        (root / folder).mkdir(parents=True)
    make_seg_site("site-1", tmp_path / "data", image_size=16, num_classes=3, scale=0.2)
    monkeypatch.setenv(DATA_ENV, str(tmp_path / "data"))
    ex = cls(preset=PRESET, device="cpu", overrides={**TINY, "train": {**TINY["train"], "optimizer_state": state}, **extra})
    ctx = FLContext()
    ctx.set_prop(ReservedKey.IDENTITY_NAME, "site-1", private=False, sticky=False)
    ctx.set_prop(FLContextKey.WORKSPACE_OBJECT, Workspace(str(root), "site-1"), private=True, sticky=False)
    ctx.set_prop(FLContextKey.ARGS, None, private=True, sticky=False)
    ex.system_panic = lambda reason, fl_ctx: pytest.fail(reason)
    ex.handle_event(EventType.START_RUN, ctx)
    ex.tracker.scalars = lambda *a, **k: None  # no FLARE engine to stream to here
    ex.tracker.images = lambda *a, **k: None
    return ex


#: (optimizer_state, Adam's step count after two rounds of 3 steps): both rounds' steps when kept, round 2's when fresh
KEPT_OR_FRESH = [("kept", {6}), ("fresh", {3})]


def _round(ex: SiteExecutor, params: dict, rnd: int, task_name: str = "train", meta: dict | None = None) -> None:
    """One train task with ``params`` (the same received model every round) for the executor's lone site."""
    task = FLModelUtils.to_shareable(FLModel(params=params, current_round=rnd, total_rounds=3, meta=meta or {}))
    reply = ex.execute(task_name, task, FLContext(), Signal())
    assert reply.get_return_code() == ReturnCode.OK


def _adam_steps(optimizer: torch.optim.Optimizer) -> set[int]:
    return {int(s["step"]) for s in optimizer.state.values()}


@pytest.mark.parametrize("state,steps_after_round_2", KEPT_OR_FRESH)
def test_a_sites_optimiser_state_is_kept_or_fresh_each_round(tmp_path, monkeypatch, state, steps_after_round_2):
    ex = _site(tmp_path, monkeypatch, state)
    start = state_to_numpy(ex.model)
    _round(ex, start, 0)
    first = ex.optimizer
    assert _adam_steps(first) == {3}
    _round(ex, start, 1)  # the same received model again: only the optimiser's state differs between the two settings
    assert _adam_steps(ex.optimizer) == steps_after_round_2
    assert (ex.optimizer is first) == (state == "kept")


@pytest.mark.parametrize("state,steps_after_round_2", KEPT_OR_FRESH)
def test_fedsm_sites_two_optimisers_follow_the_key(tmp_path, monkeypatch, state, steps_after_round_2):
    ex = _site(tmp_path, monkeypatch, state, FedSMExecutor)
    spec = selector_spec(ex.cfg["model"], ["site-1"], global_class=False)
    net = ex.new_model()  # one main-round payload, received twice: global, this site's personalised model, selector
    params = flatten({P.GLOBAL: state_to_numpy(net), P.PERSON: state_to_numpy(net), P.SELECT: state_to_numpy(build_selector(spec))})
    for rnd in (0, 1):
        _round(ex, params, rnd, P.TASK_TRAIN, {P.SITES: ["site-1"], P.SELECTOR: spec, P.PHASE: P.MAIN})
    assert _adam_steps(ex.opt_global) == steps_after_round_2
    assert _adam_steps(ex.opt_person) == steps_after_round_2


def test_round_optimizer_refuses_an_unknown_state_and_the_preset_names_the_choices():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(ConfigError, match="optimizer_state 'sometimes'"):
        round_optimizer(opt, model, {"optimizer": "adam", "lr": 1e-3, "optimizer_state": "sometimes"})
    with pytest.raises(ConfigError, match="optimizer_state"):
        get_preset("seg_synthetic", {"train": {"optimizer_state": "sometimes"}})
    assert get_preset("seg_synthetic")["train"]["optimizer_state"] == "kept"
    assert get_preset("fedsm_synthetic")["train"]["optimizer_state"] == "fresh"  # session 69's rule, RESULTS_fedsm.md


@pytest.mark.parametrize("state,steps_after_round_2", KEPT_OR_FRESH)
def test_fedst_segmentation_site_follows_the_key(tmp_path, monkeypatch, state, steps_after_round_2):
    ex = _site(tmp_path, monkeypatch, state, SegmentationExecutor, diffusion=get_preset("fedst_tiny")["diffusion"])
    start = flatten({FST.SEG: state_to_numpy(ex.new_model())})
    for rnd in (0, 1):  # lambda 0 (no synthetic images): the rounds before FedST's style exchange
        _round(ex, start, rnd, FST.TRAIN, {FST.SITES: ["site-1"], FST.VARIANT: "separate"})
    assert _adam_steps(ex.optimizer) == steps_after_round_2
