"""Compute on the record (issue 31): the report's steps and seconds columns read the tags each job streams, from a fake
run folder written as the simulator writes one; ``--match-compute`` plans the baselines at another row's budget and
runs them at exactly that many steps per site and round."""

from __future__ import annotations

import json

import pytest

from medflare import MedflareError
from medflare.jobs.simulate import SIMULATOR_SERVER, SimRun
from medflare.presets import get_preset
from medflare.report import runner
from medflare.report.build import plan, write
from medflare.report.compute import budget, steps_per_site
from medflare.report.methods import METHODS

SITES = ("site-1", "site-2")
#: {folder: {tag: [(round, value)]}}: the steps tags with their values, and decoys (other tags with steps-like names
#: or values) that a column reading the wrong tag would pick up
SCALARS = {
    "site-1": {"train/steps": [(0, 25), (1, 25)], "condense/steps": [(0, 7), (1, 7)], "train_loss": [(0, 0.5), (1, 0.4)],
               "time/train_s": [(0, 3.0), (1, 3.0)], "time/task_s": [(0, 2.0), (1, 2.0), (1, 1.0)],
               "time/validate_s": [(0, 9.0), (1, 9.0)]},
    "site-2": {"train/steps": [(0, 30), (1, 40)], "condense/steps": [(0, 7), (1, 7)], "train_loss": [(0, 0.5), (1, 0.4)],
               "time/task_s": [(0, 3.0), (1, 2.0)]},
    SIMULATOR_SERVER: {"train/steps": [(0, 100), (1, 100)], "train/steps_generator": [(0, 50), (1, 50)],
                       "train/steps_student": [(0, 300), (1, 300)], "time/update_s": [(0, 4.0), (1, 4.0)],
                       "update/images": [(0, 1000), (1, 1000)], "guard/steps": [(0, 999), (1, 999)]},
}
#: method -> (steps / round cell, compute s cell) the table must show for SCALARS
EXPECTED = {
    "cls_fedavg": ("60 + 0", "10 + 0"),  # sites' train/steps: (25 + 30 + 25 + 40) / 2 rounds; no server training
    "fedvck": ("14 + 100", "10 + 8"),  # sites condense 7 + 7 a round; the server trains 100 on the condensed sets
    "fediod": ("- + 350", "10 + -"),  # generator 50 + student 300 a round; sites' teachers stream no steps
}


def _workspace(tmp_path):
    """A simulator workspace whose server TensorBoard folder holds SCALARS (as the sites stream them to the server)."""
    from torch.utils.tensorboard import SummaryWriter

    ws = tmp_path / "ws"
    for folder, tags in SCALARS.items():
        writer = SummaryWriter(str(ws / "server" / "simulate_job" / "tb_events" / folder))
        for tag, series in tags.items():
            for step, value in series:
                writer.add_scalar(tag, value, step)
        writer.close()
    return ws


def _fake_jobs(monkeypatch, ws, seen):
    """run_job, scoring and epsilon replaced: every job 'ran' in ``ws``; ``seen`` collects the overrides each got."""
    def run_job(name, work, sites, *, preset, overrides=None, **kw):
        seen.append((name, overrides))
        return {"run": SimRun(0, 1.0, ws, ""), "traffic": None, "peak_mb": {}}

    scored = {"evaluations": [{"sites": {s: {"mean": {"accuracy": 0.5}} for s in SITES}, "client_average": {"accuracy": 0.5},
                               "global": {"accuracy": 0.5}}]}
    monkeypatch.setattr(runner, "run_job", run_job)
    monkeypatch.setattr("medflare.evaluation.evaluate_result", lambda *a, **k: scored)
    monkeypatch.setattr(runner, "_epsilon", lambda result: None)


def test_the_steps_and_seconds_columns_read_each_methods_own_tags(tmp_path, monkeypatch):
    ws, seen = _workspace(tmp_path), []
    _fake_jobs(monkeypatch, ws, seen)
    records = [runner.run_row(runner.Row(METHODS[name], SITES, 2, skew=0.5), tmp_path / "out") for name in EXPECTED]
    fedavg, fedvck, fediod = (r["compute"] for r in records)
    assert fedavg["site_steps_per_round"] == 60 and fedavg["site_steps"] == 120 and fedavg["server_steps_per_round"] == 0
    assert fedvck["site_steps_per_round"] == 14 and fedvck["server_steps_per_round"] == 100 and fedvck["server_s"] == 8
    assert fediod["site_steps_per_round"] is None and fediod["server_steps_per_round"] == 350
    assert all(r["compute"]["site_s"] == 10 for r in records)  # every task's time/task_s, not time/train_s
    write(tmp_path / "out", records)
    table = (tmp_path / "out" / "REPORT.md").read_text()
    assert "steps / round (sites + server) | compute s (sites + server) |" in table
    for r, (steps, seconds) in zip(records, EXPECTED.values()):
        line = next(x for x in table.splitlines() if x.startswith(f"| {r['label']} |"))
        assert line.endswith(f"| {steps} | {seconds} |"), line
    assert "not compute-matched" in table
    assert budget(records[1]) == 114 and budget(records[2]) == 350 and budget(records[0]) == 60


def test_match_compute_runs_the_baselines_at_the_reference_rows_steps(tmp_path, monkeypatch):
    rows = plan(["cls"], "quick", methods=["fedavg", "fedprox"], sites=list(SITES), skews=[0.5], match=["fedvck"])
    assert [(r.method.name, r.match) for r in rows] == [("cls_fedavg", None), ("cls_fedprox", None), ("fedvck", None),
                                                       ("cls_fedavg", "fedvck"), ("cls_fedprox", "fedvck")]
    assert rows[3].key == "cls_beta0.5/cls_fedavg_match_fedvck_seed0" and rows[3].label == "FedAvg (steps of FedVCK)"
    with pytest.raises(Exception, match="fedxyz"):
        plan(["cls"], "quick", match=["fedxyz"])
    with pytest.raises(Exception, match="no such method"):
        plan(["seg"], "quick", match=["fedvck"])
    ws, seen = _workspace(tmp_path), []
    _fake_jobs(monkeypatch, ws, seen)
    out = tmp_path / "out"
    with pytest.raises(MedflareError, match="no record yet"):  # the reference has not run
        runner.run_row(rows[3], out)
    records = [runner.run_row(r, out) for r in rows]
    # FedVCK's 14 + 100 steps a round over 2 sites: 57 each, at least and at most
    name, overrides = seen[-1]
    assert name == "fedprox" and overrides["train"] == {"min_steps": 57, "max_steps": 57}
    assert overrides["data"] == seen[0][1]["data"]  # the same sites and images as the default rows
    assert get_preset(rows[3].preset, overrides)["train"]["max_steps"] == 57
    assert records[3]["method"] == "cls_fedavg_match_fedvck" and records[3]["steps_per_site"] == 57
    write(out, records)
    table = (out / "REPORT.md").read_text()
    assert "FedAvg (steps of FedVCK) ran exactly 57 steps per site and round" in table
    assert "| FedAvg (steps of FedVCK) | 0 |" in table and "| FedAvg | 0 |" in table
    assert json.loads((out / "records" / "cls_beta0.5" / "cls_fedavg_match_fedvck_seed0.json").read_text())["match"] == "fedvck"


def test_steps_split_over_sites_and_a_record_without_steps_is_refused():
    assert steps_per_site(114, 2) == 57 and steps_per_site(115, 2) == 58 and steps_per_site(3, 6) == 1
    with pytest.raises(ValueError, match="no steps"):
        budget({"method": "old", "seed": 0, "compute": None})
