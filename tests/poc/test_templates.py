"""The deployment files load in FLARE 2.9 as FLARE itself reads them (fast; no federation needed).

app_configs/site/local/privacy.json through FLARE's PrivacyConfiger (every filter class built), the
allow-lists through FLARE's ComponentPathAuthorizer (every component of every job admitted, others not),
authorization.json through FLARE's policy parser, and provisioning/project.yml through `nvflare provision`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from nvflare.apis.filter import ContentBlockedException
import yaml
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_constant import FilterKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.fl_exception import UnsafeComponentError
from nvflare.app_common.widgets.component_path_authorizer import ComponentPathAuthorizer
from nvflare.fuel.sec.authz import parse_policy_config
from nvflare.private.fed.app.fl_conf import PrivacyConfiger

from medflare.jobs.customize import components

REPO = Path(__file__).resolve().parents[2]
SITE = REPO / "app_configs" / "site" / "local"
SERVER = REPO / "app_configs" / "server" / "local"


class _Workspace:
    """The two file look-ups of FLARE's Workspace that PrivacyConfiger and ComponentPathAuthorizer make."""

    def __init__(self, local: Path):
        self.local = local

    def get_site_privacy_file_path(self):
        return str(self.local / "privacy.json")

    def get_resources_file_path(self):
        return str(self.local / "resources.json")


@pytest.fixture(scope="module")
def privacy():
    configer = PrivacyConfiger(_Workspace(SITE), names_only=False)
    configer.configure()
    return configer.privacy_manager


def _result_filters(manager, scope):
    return manager.get_scope(scope).task_result_filters[FilterKey.OUT]


def test_privacy_scopes_load_with_their_filters(privacy):
    assert sorted(privacy.name_to_scopes) == ["condensed", "no_weights", "standard", "strict"]
    assert privacy.get_scope(None).name == "standard"  # a job that names no scope
    assert privacy.get_scope("no-such-scope") is None  # what makes FLARE refuse such a job
    assert _result_filters(privacy, "standard") == []
    assert [type(f).__name__ for f in _result_filters(privacy, "strict")] == ["PercentilePrivacy"]
    assert [type(f).__name__ for f in _result_filters(privacy, "no_weights")] == ["DXOBlocker"]
    assert [type(f).__name__ for f in _result_filters(privacy, "condensed")] == ["DXOBlocker", "CondensedSetFilter"]


def test_strict_scope_filters_weight_diffs(privacy):
    (flt,) = _result_filters(privacy, "strict")
    rng = np.random.default_rng(0)
    diff = {"a": rng.normal(0, 0.01, (40, 40)).astype(np.float32), "b": rng.normal(0, 0.01, 100).astype(np.float32)}
    dxo = DXO(DataKind.WEIGHT_DIFF, data={k: v.copy() for k, v in diff.items()}, meta={"NUM_STEPS_CURRENT_ROUND": 1})
    out = flt.process_dxo(dxo, dxo.to_shareable(), FLContext())
    values = np.concatenate([v.ravel() for v in out.data.values()])
    assert abs((values == 0).mean() - flt.percentile / 100) < 0.01
    assert np.abs(values).max() <= flt.gamma


def test_no_weights_scope_refuses_weights_and_passes_other_payloads(privacy):
    (flt,) = _result_filters(privacy, "no_weights")
    weights = DXO(DataKind.WEIGHT_DIFF, data={"conv.weight": np.ones(3), "fc.bias": np.ones(2)})
    with pytest.raises(ContentBlockedException, match="WEIGHT_DIFF"):
        flt.process(weights.to_shareable(), FLContext())
    condensed = DXO(
        DataKind.COLLECTION,
        data={"prototypes": DXO(DataKind.METRICS, data={"prototypes": np.ones(4)}),
              "images": DXO(DataKind.APP_DEFINED, data={"images": np.zeros((2, 1, 4, 4), np.uint8)})},
    )
    kept = from_shareable(flt.process(condensed.to_shareable(), FLContext())).data
    assert kept["prototypes"].data["prototypes"].shape == (4,) and kept["images"].data["images"].shape == (2, 1, 4, 4)
    mixed = DXO(DataKind.COLLECTION, data={**condensed.data, "model": DXO(DataKind.WEIGHTS, data={"fc.weight": np.ones(2)})})
    with pytest.raises(ContentBlockedException, match="WEIGHTS"):  # weights hidden in a collection are refused too
        flt.process(mixed.to_shareable(), FLContext())


def _job_component_paths():
    for config in sorted(REPO.glob("jobs/*/app/config/config_fed_*.json")):
        data = json.loads(config.read_text())
        # filter entries are {"tasks": [...], "filters": [components]} (FLARE's job config format)
        filters = [f for entry in (*data.get("task_data_filters", []), *data.get("task_result_filters", [])) for f in entry["filters"]]
        comps = [*components(data), *filters]
        for comp in comps:
            yield config, comp


@pytest.mark.parametrize("local", [SITE, SERVER], ids=["site", "server"])
def test_allow_list_admits_every_job_component_and_nothing_else(local):
    authorizer = ComponentPathAuthorizer()
    workspace = _Workspace(local)
    allow, mode, uses_default = authorizer._get_policy_from_file(workspace.get_resources_file_path())
    assert allow == ["nvflare.", "medflare."] and mode.value == "enforce" and not uses_default
    checked = 0
    for config, comp in _job_component_paths():
        authorizer.authorize_component_config(comp, workspace=workspace)
        checked += 1
    assert checked > 0
    for outsider in ("json.decoder.JSONDecoder", "medflarex.Thing", "nvflarefake.Thing"):
        with pytest.raises(UnsafeComponentError, match="not in allow_list"):
            authorizer.authorize_component_config({"path": outsider}, workspace=workspace)


@pytest.mark.parametrize("path", [SITE / "authorization.json", SERVER / "authorization.json"], ids=["site", "server"])
def test_authorization_policy_parses_and_forbids_byoc(path):
    config = json.loads(path.read_text())
    policy, err = parse_policy_config(config, right_categories={})
    assert policy is not None, err
    perms = config["permissions"]
    assert perms["lead"]["submit_job"] == "any" and perms["org_admin"]["submit_job"] == "none"
    assert all(role.get("byoc", "none") == "none" for role in perms.values() if isinstance(role, dict))


def test_project_provisions_a_kit_per_hospital_and_admin(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "nvflare.cli", "provision", "-p", str(REPO / "provisioning" / "project.yml"), "-w", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    project = yaml.safe_load((REPO / "provisioning" / "project.yml").read_text())
    prod = tmp_path / project["name"] / "prod_00"
    parts = project["participants"]
    clients = [p for p in parts if p["type"] == "client"]
    assert len(clients) >= 3 and len({c["org"] for c in clients}) == len(clients)
    roles = {(p["org"], p["role"]) for p in parts if p["type"] == "admin"}
    assert sum(r == "project_admin" for _, r in roles) == 1
    for c in clients:
        assert {(c["org"], "org_admin"), (c["org"], "lead")} <= roles
        assert (prod / c["name"] / "startup" / "start.sh").is_file()
        res = json.loads((prod / c["name"] / "local" / "resources.json.default").read_text())
        gpus = next(x for x in res["components"] if x["id"] == "resource_manager")["args"]["num_of_gpus"]
        assert gpus == c.get("capacity", {}).get("num_of_gpus", 0)
    for p in parts:
        assert (prod / p["name"] / "startup").is_dir(), p["name"]
    _check_production_settings(project, prod)


ROLES = ("project_admin", "org_admin", "lead", "member")  # the roles FLARE's authorization knows


def _keys(tree):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield str(k)
            yield from _keys(v)
    elif isinstance(tree, list):
        for v in tree:
            yield from _keys(v)


def _check_production_settings(project: dict, prod: Path) -> None:
    """What a security reviewer checks in project.yml and the kits it provisions (provisioning/README.md §2, §8)."""
    parts = project["participants"]
    # no secret of any kind in the project file: admins and sites authenticate with their kit's certificate
    secrets = [k for k in _keys(project) if any(w in k.lower() for w in ("password", "passwd", "secret", "token", "api_key"))]
    assert not secrets, f"project.yml holds credentials: {secrets}"
    # mutual TLS everywhere, stated explicitly and rendered into every kit
    server = next(p for p in parts if p["type"] == "server")
    assert server.get("connection_security") == "mtls"
    assert all(p.get("connection_security", "mtls") == "mtls" for p in parts)
    static = next(b for b in project["builders"] if b["path"].endswith("StaticFileBuilder"))
    assert static["args"].get("require_signed_jobs") is True
    assert any(b["path"].endswith("CertBuilder") for b in project["builders"])
    for p in parts:
        kit = prod / p["name"] / "startup"
        config = json.loads(next(kit.glob("fed_*.json")).read_text())
        assert '"connection_security": "mtls"' in json.dumps(config), p["name"]
        assert (kit / "rootCA.pem").is_file() and list(kit.glob("*.key")), f"{p['name']}: no certificate and key"
        if p["type"] != "admin":
            assert config.get("require_signed_jobs") is True, p["name"]
    # one role per admin, the roles FLARE's authorization knows; exactly one project admin
    admins = [p for p in parts if p["type"] == "admin"]
    assert all(p["role"] in ROLES for p in admins), [(p["name"], p["role"]) for p in admins]
    assert {p["role"] for p in admins} == set(ROLES)
    assert sum(p["role"] == "project_admin" for p in admins) == 1
    # the kits' local/ after install-templates (README §5): our policy, every role known, BYOC for no one
    # (the provisioned authorization.json.default is FLARE's, which lets project_admin and lead run BYOC)
    from . import pocfed

    for p in parts:
        if p["type"] == "admin":
            continue
        pocfed.install_templates(prod / p["name"], "server" if p["type"] == "server" else "site")
        perms = json.loads((prod / p["name"] / "local" / "authorization.json").read_text())["permissions"]
        assert set(perms) == set(ROLES), p["name"]
        assert all(r == "none" or (isinstance(r, dict) and r.get("byoc", "none") == "none") for r in perms.values()), p["name"]
    readme = (REPO / "provisioning" / "README.md").read_text()
    assert all(f"| {role} |" in readme for role in ROLES), "provisioning/README.md §8 lacks a role's row"
