"""Each site process of a simulator run takes its share of the cores (a site's own setting wins), logs what each
task cost and its peak memory, and computes costly metrics only at their cadence. Timings are benchmarks
(benchmarks/speed_benchmark.py), not tests: nothing here depends on how fast the machine is."""

import re

import pytest

from medflare.common.compute import available_cores
from medflare.jobs.customize import customize_job
from medflare.jobs.simulate import run_simulator

from . import simulation

pytestmark = pytest.mark.slow

ROUNDS = 3


def _shares(repo, tmp_path):
    overrides = {"eval": {"metrics": ["dice", "hd95"], "costly_every": 2}, "train": {"epochs": 1}}
    job = customize_job(repo / "jobs" / "fedavg", tmp_path / "job", preset="seg_synthetic_tiny", overrides=overrides,
                        workflow_args={"num_rounds": ROUNDS, "num_clients": 2}, executor_args={"overlay_every": 10})
    site_config = {"per_site": {"site-2": {"compute": {"threads": 3}}}}
    return run_simulator(job, tmp_path / "ws", 2, timeout=600, local_files={"medflare_site.json": site_config},
                         env={"OMP_NUM_THREADS": None, "MEDFLARE_PROCESSES": None, "MEDFLARE_CORES": None})  # the sites apply the rule


RUNS = {"shares_run": _shares}  # started in the background (tests/e2e/__init__.py)
shares_run = simulation("shares_run")


def test_sites_take_their_share_and_costly_metrics_follow_their_cadence(shares_run):
    run = shares_run
    assert run.returncode == 0 and (run.app_server / "FL_global_model.pt").is_file(), run.log[-4000:]

    share = max(1, available_cores() // 2)
    threads = dict(re.findall(r"site '(site-\d)': preset .*?; (\d+) torch threads", run.log))
    assert threads == {"site-1": str(share), "site-2": "3"}, threads  # the rule, and the site's own setting
    assert "FLARE simulator running 2 sites at once" in run.log and "site setting compute.threads" in run.log
    for site in ("site-1", "site-2"):
        rounds = re.findall(rf"site '{site}' task 'train' round (\d+): compute [\d.]+ s \(validate [\d.]+ s", run.log)
        assert rounds == [str(r) for r in range(ROUNDS)], rounds
        assert re.search(rf"site '{site}': peak memory \d+ MB", run.log)

    for site in ("site-1", "site-2"):
        # HD95 is costly: in rounds that are multiples of costly_every (0) and in the last round (2), not in round 1;
        # round 3 trains nothing and scores the final model, with every metric
        lines = dict(re.findall(rf"round (\d+): global model on '{site}' validation: (.*)", run.log))
        assert sorted(lines) == ["0", "1", "2", "3"], lines
        assert [r for r in sorted(lines) if "hd95=" in lines[r]] == ["0", "2", "3"], lines
        assert all("dice=" in line for line in lines.values())
        assert [step for step, _ in run.scalars()[site]["time/task_s"]] == [0, 1, 2, 3]
