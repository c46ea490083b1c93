"""``medflare run`` and ``medflare submit`` (issue 30): a misspelt job names the nearest, settings reach the recipe,
and a submitted job is an exported copy, so FLARE's signature and the submitter's certificate never land in jobs/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from medflare import ConfigError
from medflare.cli import main
from medflare.jobs.run import build_recipe, check_job
from medflare.jobs.customize import components
from medflare.jobs.submit import export_copy, submit_job

REPO = Path(__file__).resolve().parents[2]


def test_a_misspelt_job_names_the_nearest_and_every_job(capsys):
    assert main(["run", "fedsn", "-n", "2"]) == 2
    err = capsys.readouterr().err
    assert "unknown job 'fedsn'; did you mean 'fedsm'" in err and "fedst_join" in err and "\n" == err[-1] and err.count("\n") == 1
    with pytest.raises(ConfigError, match="did you mean 'fediod_seg'"):
        check_job("fediod-seg")
    assert check_job("scaffold") == "scaffold"


def test_settings_reach_the_recipe_and_an_unknown_key_names_itself(tmp_path):
    recipe = build_recipe("fedavg", 2, preset="seg_synthetic_tiny", overrides={"train": {"epochs": 1}}, rounds=2)
    recipe.export(str(tmp_path))
    server = json.loads((tmp_path / "fedavg" / "app" / "config" / "config_fed_server.json").read_text())
    client = json.loads((tmp_path / "fedavg" / "app" / "config" / "config_fed_client.json").read_text())
    workflow = server["workflows"][0]["args"]
    assert (workflow["num_rounds"], workflow["num_clients"]) == (2, 2)  # every site each round: threads = sites = N
    assert client["executors"][0]["executor"]["args"]["overrides"] == {"train": {"epochs": 1}}
    assert recipe.result_file == "FL_global_model.pt"
    with pytest.raises(ConfigError, match="epoch"):
        build_recipe("fedavg", 2, overrides={"train": {"epoch": 1}})


@pytest.mark.parametrize("job", ["fedavg", "fediod"])
def test_a_seed_reaches_every_seeded_component(job, tmp_path):
    build_recipe(job, 2, seed=3).export(str(tmp_path))
    config = tmp_path / job / "app" / "config"
    docs = [json.loads((config / name).read_text()) for name in ("config_fed_server.json", "config_fed_client.json")]
    seeds = [c["args"]["seed"] for doc in docs for c in components(doc) if "seed" in c.get("args", {})]
    assert len(seeds) >= 2 and set(seeds) == {3}  # the persistor, the executor (FedIOD: the workflow too); none left at 0


class _Session:
    """FLARE's Session as far as submit uses it; like FLARE, it signs the folder it submits in place."""

    submitted: list[Path] = []

    def __init__(self, username, kit):
        self.username, self.kit = username, kit

    def submit_job(self, folder):
        folder = Path(folder)
        for sub in [folder, *[p for p in folder.rglob("*") if p.is_dir()]]:
            (sub / ".__nvfl_sig.json").write_text("{}")
        type(self).submitted.append((folder, self.username, sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))))
        return "job-1"

    def close(self):
        pass


def test_submit_sends_an_exported_copy_without_app_custom_and_leaves_jobs_clean(tmp_path, capsys):
    kit = tmp_path / "admin@example.org"
    (kit / "startup").mkdir(parents=True)
    before = sorted(str(p) for p in (REPO / "jobs").rglob("*"))
    out = submit_job("fedsm", kit, assignments=["train.epochs=1"], rounds=2, session_factory=_Session)
    folder, user, files = _Session.submitted[-1]
    assert out["job_id"] == "job-1" and user == "admin@example.org"  # the kit folder's name, as FLARE provisions it
    assert REPO not in folder.parents and not folder.exists()  # a temporary copy, gone after the submission
    assert "meta.json" in files and not any("custom" in f for f in files)  # the sites' templates refuse BYOC
    assert sorted(str(p) for p in (REPO / "jobs").rglob("*")) == before  # no signature, no certificate in jobs/
    assert "jobs/fedsm is untouched" in capsys.readouterr().out
    byoc = export_copy("fedavg", tmp_path / "byoc", byoc=True)
    assert (byoc / "app" / "custom" / "README.md").is_file()
    with pytest.raises(ConfigError, match="not an admin startup kit"):
        submit_job("fedavg", tmp_path, session_factory=_Session)


def test_show_prints_metrics_rounded_in_percent_and_settings_as_numbers():
    """``medflare show`` printed the metrics as a raw dict with 16 digits."""
    from medflare.cli import _shown

    assert _shown("metrics", {"own_or_global_dice": 0.8029123456789012, "val_cases": 30.0, "hd95": 3.14159}) == (
        "own_or_global_dice 80.29 %, val_cases 30, hd95 3.142")
    assert _shown("fedvck", {"contrastive_weight": 0.5, "server_lr": 0.01}) == "contrastive_weight 0.5, server_lr 0.01"
    assert _shown("gamma", 0.05) == "0.05"
