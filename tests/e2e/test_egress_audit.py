"""Nothing leaves a site that its policy did not pass, audited on every message a site process sends.

Every simulator run of the test session goes through :func:`medflare.jobs.simulate.run_simulator`, which runs the job
with the egress recorder at every site (:mod:`medflare.jobs.egress`: FLARE's cell-level sends: task results, aux
messages, analytics events, meta and headers). ``test_every_job_sends_only_what_it_declares`` judges all of them at
the end of the session and runs, at its tiny preset, each job of ``medflare.recipes.RECIPES`` that no other test ran.
On the code before the egress rule the audit fails (SCAFFOLD's controls and the scores in meta, segmentation
overlays as analytics events): tests/unit/test_egress.py::test_the_egress_audit_catches_what_the_old_code_sent
replays that wire, and the closing note of issue 27 gives the run on the old code.
"""

import pytest

from medflare.recipes import RECIPES
from medflare.jobs.customize import customize_job
from medflare.jobs.simulate import AUDITED, run_simulator

from . import simulation

pytestmark = pytest.mark.slow

#: the tiny preset of each job, for a job no other test of the session ran
TINY = {"fedavg": "seg_synthetic_tiny", "fedprox": "seg_synthetic_tiny", "scaffold": "seg_synthetic_tiny",
        "fedsm": "seg_synthetic_tiny", "fedvck": "fedvck_synthetic_tiny", "fediod": "fediod_cls_tiny",
        "fediod_seg": "fediod_seg_tiny", "fedst_separate": "fedst_tiny", "fedst_join": "fedst_tiny"}
CLIENTS = ["site-1", "site-2"]


def _pictures(repo, tmp_path):
    folder = customize_job(repo / "jobs" / "fedavg", tmp_path / "fedavg", preset="seg_synthetic_tiny",
                           workflow_args={"num_rounds": 1, "num_clients": 2}, executor_args={"overlay_every": 1})
    site_config = {"per_site": {"site-2": {"privacy": {"stream_images": True}}}}
    return run_simulator(folder, tmp_path / "ws", 2, clients=CLIENTS, timeout=300, local_files={"medflare_site.json": site_config})


RUNS = {"pictures_run": _pictures}  # started in the background (tests/e2e/__init__.py)
pictures_run = simulation("pictures_run")


def test_a_picture_reaches_the_server_only_from_the_site_that_opted_in(pictures_run):
    """site-1 keeps the default (pictures stay home), site-2's operator lets them stream in its own local settings."""
    run = pictures_run
    assert run.returncode == 0, run.log[-3000:]
    server, kept = run.images(), run.site_images()
    assert server.get("site-2", 0) >= 1 and not server.get("site-1"), server  # the opted-in site's overlays only
    assert kept.get("site-1", 0) >= 1 and not kept.get("site-2"), kept  # site-1's stayed in its own TensorBoard
    assert "site 'site-1' streams scalars to the server's TensorBoard; pictures of its data stay" in run.log
    assert "site 'site-2' streams scalars and pictures of its data" in run.log
    assert run.egress_violations() == []  # site-2's pictures are its operator's choice, not a leak


@pytest.mark.last
def test_every_job_sends_only_what_it_declares(repo, tmp_path):
    ran = {run.job_name for run in AUDITED}
    for job in sorted(set(RECIPES) - ran):  # run alone, this test audits every job itself (1 round, 2 sites)
        folder = customize_job(repo / "jobs" / job, tmp_path / job, preset=TINY[job], workflow_args={"num_rounds": 1})
        run = run_simulator(folder, tmp_path / f"ws_{job}", 2, clients=CLIENTS, timeout=600)
        assert run.returncode == 0, run.log[-3000:]
    assert set(RECIPES) <= {run.job_name for run in AUDITED}
    found = {f"{run.job_name} ({run.workspace.name})": run.egress_violations() for run in AUDITED}
    assert all(run.egress() for run in AUDITED if run.returncode == 0), "a run recorded nothing: the recorder did not start"
    assert {k: v[:5] for k, v in found.items() if v} == {}
