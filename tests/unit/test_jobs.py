"""The shipped job folders are their recipes' export and consistent, and customize_job rewrites only what it is asked to."""

import json
from pathlib import Path

import pytest

from medflare import MedflareError
from medflare.presets import PRESETS
from medflare.recipes import RECIPES
from medflare.jobs.export import differences, export, files_of
from medflare.jobs.customize import components, customize_job

JOBS = sorted(p.parent.name for p in (Path(__file__).resolve().parents[2] / "jobs").glob("*/meta.json"))


def _configs(job_dir):
    return {p.name: json.loads(p.read_text()) for p in job_dir.glob("app/config/*.json")}


def _medflare_args(config):
    return [c["args"] for c in components(config) if c["path"].startswith("medflare.") and "preset" in c.get("args", {})]


def test_every_job_folder_has_a_recipe():
    assert JOBS == sorted(RECIPES), "a job folder without a recipe, or a recipe without a folder"


@pytest.mark.parametrize("job", JOBS)
def test_job_folder_is_its_recipes_export(repo, job):
    assert differences(job, repo / "jobs") == []


def test_a_changed_knob_shows_as_a_difference(repo, tmp_path):
    """The check above can fail: a folder edited by hand no longer matches its recipe."""
    export("fedavg", tmp_path)
    server = tmp_path / "fedavg" / "app" / "config" / "config_fed_server.json"
    config = json.loads(server.read_text())
    config["workflows"][0]["args"]["num_rounds"] = 11
    server.write_text(json.dumps(config))
    assert differences("fedavg", tmp_path) == ["fedavg/app/config/config_fed_server.json: differs"]
    assert "app/custom/README.md" in files_of(tmp_path / "fedavg")


@pytest.mark.parametrize("job", JOBS)
def test_server_and_clients_name_the_same_preset(repo, job):
    configs = _configs(repo / "jobs" / job)
    args = _medflare_args(configs["config_fed_server.json"]) + _medflare_args(configs["config_fed_client.json"])
    assert len(args) >= 2
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
