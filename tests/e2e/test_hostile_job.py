"""A hostile job config in the FLARE simulator: a job whose overrides point a site's disk cache outside the site's
workspace and cache folder is refused by every site at start-up, with one log line naming the key, and nothing
is written there (issue 17, Security)."""

import pytest

from medflare.data import make_seg_site
from medflare.data.util import DATA_ENV
from medflare.jobs.customize import customize_job
from medflare.jobs.simulate import run_simulator

from . import simulation

pytestmark = pytest.mark.slow

CLIENTS = ["site-1", "site-3"]
TINY = {"channels": 1, "num_classes": 3, "labels": "as_is", "image_size": [16, 16]}


def _hostile(repo, tmp_path):
    """(the folder the job points the cache at, the run)"""
    for site in CLIENTS:  # the sites' own data, so that only the job's path can stop them
        make_seg_site(site, tmp_path / "data", image_size=16, num_classes=3, scale=0.2)
    target = tmp_path / "stolen"
    overrides = {"data": {**TINY, "cache": {"mode": "disk", "dir": f"../../../../../../..{target}"}},
                 "model": {"args": {"in_channels": 1, "out_channels": 3, "channels": [4, 8], "strides": [2]}}}
    folder = customize_job(repo / "jobs" / "fedavg", tmp_path / "job", preset="seg_images_2d", overrides=overrides,
                           workflow_args={"num_rounds": 2, "num_clients": len(CLIENTS)})
    return target, run_simulator(folder, tmp_path / "ws", len(CLIENTS), clients=CLIENTS, timeout=300,
                                 env={DATA_ENV: str(tmp_path / "data")})


RUNS = {"hostile_run": _hostile}  # started in the background (tests/e2e/__init__.py)
hostile_run = simulation("hostile_run")


def test_a_job_pointing_a_site_cache_outside_its_places_is_refused(hostile_run):
    target, run = hostile_run
    refusals = [line for line in run.log.splitlines() if "config key 'data.cache.dir'" in line and "outside this site's" in line]
    assert refusals and any("site 'site-1'" in line for line in refusals), run.log[-4000:]
    assert str(target) in refusals[0]
    assert not target.exists()  # refused before the disk cache was created
    assert run.seconds < 240  # the job ends, it does not wait for the refusing sites
    assert not (run.app_server / "best_FL_global_model.pt").exists()
