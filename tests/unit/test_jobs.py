"""The shipped job folders are consistent, and customize_job rewrites only what it is asked to."""

import json

import pytest

from medflare import MedflareError
from medflare.testing.jobconfig import components, customize_job
from medflare.presets import PRESETS


def _configs(job_dir):
    return {p.name: json.loads(p.read_text()) for p in job_dir.glob("app/config/*.json")}


def _medflare_args(config):
    return [c["args"] for c in components(config) if c["path"].startswith("medflare.") and "preset" in c.get("args", {})]


@pytest.mark.parametrize("job", ["fedavg", "fedprox", "scaffold"])
def test_server_and_clients_name_the_same_preset(repo, job):
    configs = _configs(repo / "jobs" / job)
    args = _medflare_args(configs["config_fed_server.json"]) + _medflare_args(configs["config_fed_client.json"])
    assert len(args) == 2
    assert all(a["preset"] == args[0]["preset"] and a.get("overrides", {}) == args[0].get("overrides", {}) for a in args)
    assert args[0]["preset"] in PRESETS
    meta = json.loads((repo / "jobs" / job / "meta.json").read_text())
    assert meta["deploy_map"] == {"app": ["@ALL"]}
    assert (repo / "jobs" / job / "app" / "custom" / "README.md").is_file()
    assert not list((repo / "jobs" / job / "app" / "custom").glob("*.py"))  # no copy of the package in a job


def test_customize_job_sets_preset_rounds_and_filters(repo, tmp_path):
    out = customize_job(
        repo / "jobs" / "fedavg", tmp_path / "j", preset="seg_synthetic_tiny", overrides={"train": {"epochs": 1}},
        workflow_args={"num_rounds": 2}, task_result_filters=[{"tasks": ["train"], "filters": []}],
        server_settings={"server": {"task_request_interval": 0.5}},
    )
    configs = _configs(out)
    server, client = configs["config_fed_server.json"], configs["config_fed_client.json"]
    assert server["workflows"][0]["args"]["num_rounds"] == 2
    assert server["server"]["task_request_interval"] == 0.5
    for args in _medflare_args(server) + _medflare_args(client):
        assert args["preset"] == "seg_synthetic_tiny" and args["overrides"] == {"train": {"epochs": 1}}
    assert client["task_result_filters"] == [{"tasks": ["train"], "filters": []}]
    # the source job is untouched
    assert _configs(repo / "jobs" / "fedavg")["config_fed_server.json"]["workflows"][0]["args"]["num_rounds"] == 10


def test_customize_job_refuses_a_non_job(tmp_path):
    with pytest.raises(MedflareError, match="meta.json"):
        customize_job(tmp_path, tmp_path / "out")
