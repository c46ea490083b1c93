"""`medflare report` end to end on two cheap rows: a FedAvg job in the FLARE simulator and local training.

The traffic the report counts must be the model itself (each site receives the global weights and returns a
weight difference of the same size, every round), the every-channel count must hold those task results plus the
analytics events (scalars only: pictures stay at the sites by default), the scores must be the saved model's on each
site's test split, and a second invocation must reuse the finished rows instead of running them again."""

from __future__ import annotations

import json

import pytest

from medflare.cli import main as medflare_main
from medflare.common.results import load_result

pytestmark = pytest.mark.slow

SITES = ["site-1", "site-3"]


def test_report_counts_what_fedavg_sends_and_scores_it_like_evaluate(tmp_path, capsys):
    out = tmp_path / "report"
    args = ["report", "--quick", "--tasks", "seg", "--methods", "fedavg,local", "--sites", ",".join(SITES),
            "--rounds", "2", "--out", str(out)]
    assert medflare_main(args) == 0
    progress = capsys.readouterr().out
    assert "seg/fedavg_seed0: round 1 of 2" in progress and "seg/fedavg_seed0: round 2 of 2" in progress, progress
    fedavg = json.loads((out / "records" / "seg" / "fedavg_seed0.json").read_text())
    local = json.loads((out / "records" / "seg" / "local_seed0.json").read_text())

    model = load_result(fedavg["workspace"] + "/server/simulate_job/app_server/FL_global_model.pt").model
    model_bytes = sum(p.numel() * p.element_size() for p in model.state_dict().values() if p.is_floating_point())
    traffic = fedavg["traffic"]
    for site in SITES:
        assert set(traffic["per_site"][site]) == {"0", "1", "2"}, traffic["per_site"][site]
        for rnd in ("0", "1"):
            assert traffic["per_site"][site][rnd] == {"down": model_bytes, "up": model_bytes}
        assert traffic["per_site"][site]["2"] == {"down": model_bytes, "up": 0}  # the final model goes out to be scored
    assert traffic["kinds"] == {"down": ["WEIGHTS"], "up": ["METRICS", "WEIGHT_DIFF"]}  # the scores are a METRICS part
    egress = traffic["egress"]  # every channel, from the egress recorder at each site
    for site in SITES:
        assert egress["per_site"][site]["server_command/submit_update"] == 2 * model_bytes, egress["per_site"][site]
    assert egress["messages"]["aux_communication/fed.event"] > 0 and egress["events"] == ["scalar"], egress
    assert "WEIGHT_DIFF" in egress["kinds"] and egress["total"] >= 2 * len(SITES) * model_bytes
    assert 0 < fedavg["compute_s"] < fedavg["seconds"] and fedavg["overhead_s"] > 0
    assert set(fedavg["peak_mb"]) >= set(SITES) and all(fedavg["peak_mb"][s] > 100 for s in SITES)
    assert len(fedavg["curve"]) == 3 and fedavg["curve"][2] > fedavg["curve"][0]  # it learned (the last: the final model)
    dice = {s: fedavg["scores"]["sites"][s]["dice"] for s in SITES}
    assert fedavg["scores"]["client_average"]["dice"] == pytest.approx(sum(dice.values()) / 2)
    assert local["traffic"] is None and local["scores"]["client_average"]["dice"] > 0.2

    report = (out / "REPORT.md").read_text()
    assert f"| FedAvg | 0 | {100 * dice['site-1']:.2f} | {100 * dice['site-3']:.2f} |" in report
    every = egress["per_site_round"]
    up = 2 * model_bytes / 3  # per round of the job: 2 training rounds, then 1 that sends the final model's scores only
    assert f"| {up / 1e3:.1f} kB | {every / 1e3:.1f} kB | {model_bytes / 1e3:.1f} kB |" in report, report
    assert "WEIGHT_DIFF" in report and "analytics: scalar" in report
    assert (out / "seg.png").is_file() and "fedavg" in (out / "report.csv").read_text()

    assert medflare_main(args) == 0  # resumes: both rows come from their records
    assert capsys.readouterr().out.count("reused") == 2
