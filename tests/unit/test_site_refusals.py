"""What a site refuses, and how it says so. A job cannot make a site read or write outside its workspace and
cache folder: hostile job configs (paths to /etc, ``..`` escapes, ``~``, symlinks out) are refused at START_RUN
with a ConfigError naming the key, before any file is touched; paths inside are accepted and used exactly as
checked. A data file that disappears or turns corrupt between rounds fails that round's task (FLARE's
EXECUTION_EXCEPTION reply, which the server counts as a missing site) with one log line naming the file."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_constant import FLContextKey, ReservedKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal
from nvflare.apis.workspace import Workspace

from medflare import ConfigError
from medflare.baselines.executor import SupervisedExecutor
from medflare.common.site_errors import CAUSE_HEADER
from medflare.common.site_executor import SiteExecutor
from medflare.data import make_seg_site
from medflare.data.site import confine_job_paths, job_path_roots
from medflare.data.util import DATA_ENV, cache_root
from medflare.presets import get_preset

PRESET = "seg_images_2d"  # a site's own datalist, preprocessed, with a data.cache section; made tiny below
TINY = {"data": {"channels": 1, "num_classes": 3, "labels": "as_is", "image_size": [16, 16]},
        "model": {"args": {"in_channels": 1, "out_channels": 3, "channels": [4, 8], "strides": [2]}}}


def _overrides(cache_dir):
    return {**TINY, "data": {**TINY["data"], "cache": {"mode": "disk", "dir": cache_dir}}}


def _cfg(cache_dir):
    return get_preset(PRESET, _overrides(cache_dir))


@pytest.fixture
def site_ws(tmp_path, monkeypatch):
    """A FLARE site workspace ``ws/site-1`` and the site's own data (a tiny datalist) under ``$MEDFLARE_DATA``."""
    root = tmp_path / "ws" / "site-1"
    for folder in ("local", "startup"):  # what FLARE checks a workspace has
        (root / folder).mkdir(parents=True)
    make_seg_site("site-1", tmp_path / "data", image_size=16, num_classes=3, scale=0.2)
    monkeypatch.setenv(DATA_ENV, str(tmp_path / "data"))
    return root


def _hostile(site_ws: Path) -> list[str]:
    outside = site_ws.parent.parent / "outside"
    outside.mkdir(exist_ok=True)
    os.symlink(outside, site_ws / "escape", target_is_directory=True)
    return ["/etc/medflare_cache", "/etc", "../../../../../../etc", str(site_ws / ".." / "other_site"),
            str(site_ws / "escape" / "cache"), "~/medflare_cache", str(outside), "/"]


def test_hostile_paths_are_refused_naming_the_key(site_ws):
    roots = job_path_roots(site_ws)
    for value in _hostile(site_ws):
        with pytest.raises(ConfigError, match=r"site 'site-1': config key 'data\.cache\.dir' = .*outside this site's") as info:
            confine_job_paths(_cfg(value), roots, "site-1")
        assert "\n" not in str(info.value)
    for value in (3, "", "a\x00b", ["x"]):
        with pytest.raises(ConfigError, match=r"config key 'data\.cache\.dir' must be a path"):
            confine_job_paths(_cfg(value), roots, "site-1")


def test_any_path_named_key_is_confined_not_only_the_known_one(site_ws):
    roots = job_path_roots(site_ws)
    for cfg, key in (({"fedx": {"out_dir": "/etc/x"}}, "fedx.out_dir"), ({"a": [{"file": "/etc/passwd"}]}, "a.0.file"),
                     ({"model": {"args": {"weights_path": "../../../../x.pt"}}}, "model.args.weights_path")):
        with pytest.raises(ConfigError, match=rf"config key '{key}'"):
            confine_job_paths(cfg, roots)


def test_paths_inside_the_workspace_or_cache_are_resolved_and_kept(site_ws):
    roots = job_path_roots(site_ws)
    inside = confine_job_paths(_cfg(str(site_ws / "sub" / ".." / "pp")), roots)["data"]["cache"]["dir"]
    assert inside == str((site_ws / "pp").resolve())
    relative = confine_job_paths(_cfg("preprocessed/mine"), roots)["data"]["cache"]["dir"]
    assert relative == str(cache_root().resolve() / "preprocessed" / "mine")  # relative: inside the cache folder
    assert confine_job_paths(_cfg(None), roots)["data"]["cache"]["dir"] is None
    untouched = get_preset(PRESET)
    assert confine_job_paths(untouched, roots) == untouched


def _start(executor, site_ws: Path):
    """Fire START_RUN as FLARE does for site ``site-1`` with workspace ``site_ws``; returns the panic reasons."""
    ctx = FLContext()
    ctx.set_prop(ReservedKey.IDENTITY_NAME, "site-1", private=False, sticky=False)
    ctx.set_prop(FLContextKey.WORKSPACE_OBJECT, Workspace(str(site_ws), "site-1"), private=True, sticky=False)
    ctx.set_prop(FLContextKey.ARGS, None, private=True, sticky=False)
    panics: list[str] = []
    executor.system_panic = lambda reason, fl_ctx: panics.append(reason)
    executor.handle_event(EventType.START_RUN, ctx)
    return panics


def test_a_hostile_job_config_stops_the_site_before_it_writes(site_ws, tmp_path):
    target = tmp_path / "outside" / "cache"
    ex = SupervisedExecutor(preset=PRESET, device="cpu", overrides=_overrides(str(site_ws / ".." / ".." / "outside" / "cache")))
    errors: list[str] = []
    ex.log_error = lambda fl_ctx, msg, fire_event=False: errors.append(msg)
    assert _start(ex, site_ws) == []  # no panic: the site stays and answers each task with the cause (issue 28: no hangs)
    assert len(errors) == 1 and "config key 'data.cache.dir'" in errors[0] and "site 'site-1'" in errors[0]
    assert ex.data is None and not target.exists()  # refused before loading: nothing written there
    reply = ex.execute("train", Shareable(), FLContext(), Signal())
    assert reply.get_return_code() == ReturnCode.EXECUTION_EXCEPTION
    cause = reply.get_header(CAUSE_HEADER)
    assert cause.startswith("cannot start: site 'site-1': config key 'data.cache.dir'") and "\n" not in cause


def test_a_job_config_inside_the_workspace_starts_and_caches_there(site_ws):
    ex = SupervisedExecutor(preset=PRESET, device="cpu", overrides=_overrides(str(site_ws / "pp")))
    assert _start(ex, site_ws) == []
    assert ex.data is not None and any((site_ws / "pp").iterdir())  # the disk cache was written where checked


class _EpochExecutor(SiteExecutor):
    """A site whose task reads every training item once (what a training epoch does to the files)."""

    def setup(self, fl_ctx):
        self.register_task("epoch", self.epoch)

    def epoch(self, shareable, fl_ctx, abort_signal):
        for _ in self.loader("train", shuffle=True):
            pass
        return Shareable()


@pytest.mark.parametrize("damage,workers", [("delete", 0), ("truncate", 1)])  # read in the site process / a worker
def test_a_file_gone_bad_between_rounds_fails_that_task_naming_the_file(site_ws, workers, damage):
    overrides = {**TINY, "data": {**TINY["data"], "cache": {"mode": "none"}}, "train": {"num_workers": workers}}
    ex = _EpochExecutor(preset=PRESET, overrides=overrides, device="cpu")
    assert _start(ex, site_ws) == []
    ex.compute = dataclasses.replace(ex.compute, workers=workers)  # the share may differ on this machine
    errors: list[str] = []
    ex.log_error = lambda fl_ctx, msg, fire_event=False: errors.append(msg)
    ex.tracker.scalars = lambda *a, **k: None  # no FLARE engine to stream to here
    reply = ex.execute("epoch", Shareable(), FLContext(), Signal())
    assert reply.get_return_code() == ReturnCode.OK and errors == []  # round 1: all files fine
    victim = Path(ex.data.train[0]["name"])
    victim = next(p for p in site_ws.parent.parent.joinpath("data").rglob(victim.name))
    if damage == "delete":
        victim.unlink()
    else:
        victim.write_bytes(victim.read_bytes()[:40])
    reply = ex.execute("epoch", Shareable(), FLContext(), Signal())
    assert reply.get_return_code() == ReturnCode.EXECUTION_EXCEPTION
    assert len(errors) == 1 and "\n" not in errors[0], errors
    assert victim.name in errors[0] and "site 'site-1', task 'epoch'" in errors[0] and "Traceback" not in errors[0]


def test_one_line_unwraps_the_error_a_loader_worker_raised():
    from torch._utils import ExceptionWrapper

    from medflare import DataError
    from medflare.common.training import one_line

    try:
        raise DataError("cannot read image '/data/x.png': image file is truncated")
    except DataError:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 0")  # what torch sends from a worker
    with pytest.raises(DataError) as info:
        wrapped.reraise()
    assert "\n" in str(info.value)  # torch's re-raised message: its traceback
    assert one_line(info.value) == "cannot read image '/data/x.png': image file is truncated"
    assert one_line(ConfigError("a\n b")) == "a b"
