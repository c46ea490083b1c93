"""A hostile job config in the FLARE simulator: a job whose overrides point a site's disk cache outside the site's
workspace and cache folder is refused by every site at start-up, with one log line naming the key, and nothing
is written there (issue 17, Security)."""

import pytest

from . import IMAGE_FILES, TINY_UNET, fedavg_on_image_files, image_file_sites, simulation

pytestmark = pytest.mark.slow

CLIENTS = ["site-1", "site-3"]


def _hostile(repo, tmp_path):
    """(the folder the job points the cache at, the run)"""
    image_file_sites(tmp_path, CLIENTS)  # the sites' own data, so that only the job's path can stop them
    target = tmp_path / "stolen"
    overrides = {"data": {**IMAGE_FILES, "cache": {"mode": "disk", "dir": f"../../../../../../..{target}"}},
                 "model": {"args": TINY_UNET}}
    return target, fedavg_on_image_files(repo, tmp_path, CLIENTS, overrides, 2)


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
