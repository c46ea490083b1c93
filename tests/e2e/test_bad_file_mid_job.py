"""A site's data file goes bad in the middle of a job (issue 17, "No bad file crashes a job without naming itself").

Three sites read their own datalists through ``MEDFLARE_DATA`` with no cache (every epoch reads the files, as a
hospital's data too large for memory would). Before round 1 one training image of site-3 is cut short
by a test filter (:class:`medflare.testing.sabotage.DamageFileFilter`). Site-3 then fails every later task with one
log line naming the file; FedAvg averages the two other sites in rounds 1 and 2 and the job finishes with a finite
model. The site-level detail (one line, no traceback, also through a loader worker) is
tests/unit/test_site_refusals.py::test_a_file_gone_bad_between_rounds_fails_that_task_naming_the_file.
"""

import json
import re

import pytest

from medflare.common.results import read_checkpoint
from medflare.common.update_guard import nonfinite_paths
from . import IMAGE_FILES, TINY_UNET, fedavg_on_image_files, image_file_sites, simulation

pytestmark = pytest.mark.slow

CLIENTS = ["site-1", "site-2", "site-3"]
BAD = "site-3"
ROUNDS = 3
TINY = {"data": {**IMAGE_FILES, "cache": {"mode": "none"}}, "model": {"args": TINY_UNET}}


def aggregated_per_round(log: str) -> dict[int, int]:
    """How many results FLARE's FedAvg averaged in each round, from its 'Round r started.' / 'Aggregated k/n' lines."""
    counts, rnd = {}, None
    for line in log.splitlines():
        if m := re.search(r"Round (\d+) started\.", line):
            rnd = int(m.group(1))
        elif (m := re.search(r"Aggregated (\d+)/(\d+) results", line)) and rnd is not None:
            counts[rnd] = max(counts.get(rnd, 0), int(m.group(1)))
    return counts


def _sabotaged(repo, tmp_path):
    """(the damaged file, the run)"""
    data = image_file_sites(tmp_path, CLIENTS)
    victim = data / json.loads((data / f"{BAD}.json").read_text())["training"][0]["image"]
    sabotage = [{"tasks": ["train"], "filters": [{"path": "medflare.testing.sabotage.DamageFileFilter",
                                                  "args": {"site": BAD, "path": str(victim), "at_round": 1, "damage": "truncate"}}]}]
    return victim, fedavg_on_image_files(repo, tmp_path, CLIENTS, TINY, ROUNDS, executor_args={"overlay_every": 100},
                                         task_data_filters=sabotage)


RUNS = {"sabotaged_run": _sabotaged}  # started in the background (tests/e2e/__init__.py)
sabotaged_run = simulation("sabotaged_run")


def test_a_site_whose_file_goes_bad_fails_naming_it_and_the_job_goes_on(sabotaged_run):
    """The file is cut short (a deleted file is the unit test's second case: one simulator run keeps the suite short)."""
    victim, run = sabotaged_run

    assert run.returncode == 0 and "Finished FedAvg" in run.log, run.log[-4000:]  # the job ran to its end
    assert "EXECUTION_EXCEPTION" not in run.log.split("Finished FedAvg")[-1], run.log[-4000:]
    named = [line for line in run.log.splitlines() if f"site '{BAD}', task 'train'" in line and victim.name in line]
    assert len(named) == ROUNDS - 1, run.log[-4000:]  # rounds 1 and 2, one line each, the file named
    assert "Traceback" not in "\n".join(named)
    assert aggregated_per_round(run.log) == {0: 3, 1: 2, 2: 2}, run.log[-4000:]  # the others went on without it
    model = read_checkpoint(run.app_server / "FL_global_model.pt")
    assert not nonfinite_paths(model)
