"""A real FLARE federation on loopback: POC server + 2 hospital sites, our site templates, jobs via the Session API.

One POC federation serves the whole module (provisioning/pocfed.py: isolated HOME and workspace, free
ports, stopped and its processes killed by pid on teardown, also after a failure). The sites get
app_configs/ installed in local/ (allow-list, privacy scopes, authorization, medflare_data.json pointing at
data written by `medflare data`). All jobs are submitted up front and run concurrently (server max_jobs 4);
each test waits for its own. Jobs are submitted without app/custom, so every medflare component passes
through the sites' class_allow_list.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from medflare.common.results import load_result, read_checkpoint
from medflare.common.persistence import model_from_preset
from medflare.fedsm.persistor import BEST_SUPER_MODEL_FILE, SUPER_MODEL_FILE
from medflare.jobs.simulate import read_scalars

from . import poc_federation, poc_job, pocfed

pytestmark = [pytest.mark.slow, pytest.mark.poc, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
PRESET = "seg_synthetic_tiny"
ROUNDS = 2
JOB_TIMEOUT = 420  # s per job; they share 2 cores with each other and with whatever else runs
DEAD_BOUND = 90  # s from killing a site's job process to the job's terminal state
#: saves a site's task results before any filter runs (the privacy scope's included)
UNFILTERED = {"id": "unfiltered", "path": "medflare.testing.widgets.UnfilteredResultRecorder", "args": {}}




# ---- the federation and its jobs -------------------------------------------------------------
@pytest.fixture(scope="module")
def fed(tmp_path_factory):
    with poc_federation(tmp_path_factory, PRESET, n_sites=2) as federation:
        yield federation


def _job(fed, src: str, name: str, *, rounds=ROUNDS, sites=None, scope=None, byoc=False, client_component=None,
         preset=PRESET):
    """A copy of jobs/<src>, tiny, optionally on some sites, with a privacy scope; without app/custom unless byoc."""
    sites = sites or fed.sites
    workflow_args = {"num_rounds": rounds}
    if src != "fedsm":
        workflow_args["num_clients"] = len(sites)
    meta = {} if scope is None else {"scope": scope}
    if sites != fed.sites:
        deploy_map = json.loads((REPO / "jobs" / src / "meta.json").read_text())["deploy_map"]
        meta.update(deploy_map={app: ["server", *sites] for app in deploy_map}, min_clients=len(sites))
    job = poc_job(fed, src, name, preset, keep_custom=byoc, meta=meta, workflow_args=workflow_args)
    if client_component:
        path = job / "app" / "config" / "config_fed_client.json"
        config = json.loads(path.read_text())
        config["components"].append(client_component)
        path.write_text(json.dumps(config, indent=2))
    return job


@pytest.fixture(scope="module")
def jobs(fed):
    """Submit every job of the module now; {name: job_id}. The refused ones first (they end at once)."""
    site = fed.sites[0]
    specs = {
        "unknown_scope": dict(src="fedavg", scope="no-such-scope"),
        "byoc": dict(src="fedavg", byoc=True),
        "not_allowed": dict(src="fedavg", rounds=1, sites=[site],
                            client_component={"id": "outsider", "path": "json.decoder.JSONDecoder", "args": {}}),
        "dead_site": dict(src="fedavg", rounds=50),
        "no_data": dict(src="fedavg", preset="cls_medmnist"),  # the sites hold no .npz: every site fails at start
        "fedavg": dict(src="fedavg"),
        "strict_1site": dict(src="fedavg", rounds=1, sites=[site], scope="strict", client_component=UNFILTERED),
        "fedsm": dict(src="fedsm"),  # a checkout without jobs/fedsm or medflare.fedsm fails here, it does not skip
    }
    sess = fed.session()
    ids = {}
    try:
        for name, spec in specs.items():
            ids[name] = sess.submit_job(str(_job(fed, name=name, **spec)))
    finally:
        sess.close()
    return ids


def _wait(sess, job_id, timeout=JOB_TIMEOUT) -> dict:
    return sess.wait_for_job(job_id, timeout=timeout, poll_interval=1)


def _download(fed, sess, job_id) -> Path:
    path = Path(sess.download_job_result(job_id, str(fed.results / job_id)))
    assert (path / "workspace").is_dir(), f"downloaded result of {job_id} has no workspace: {list(path.iterdir())}"
    return path / "workspace"


def _site_job_log(fed, site, job_id) -> str:
    log = fed.kit(site) / job_id / "log.txt"
    return log.read_text() if log.is_file() else ""


def _evaluate(fed, model, out) -> dict:
    """`medflare evaluate` of ``model`` on the second site's test split, as an operator runs it (a subprocess
    of the installed command): one score per test case, and the numbers equal the metric layer's on the same
    model and data, computed here in-process."""
    from medflare.data import load_seg_split
    from medflare.metrics import evaluate
    from medflare.common.training import make_loader

    datalist = fed.data / f"{fed.sites[1]}.json"
    cmd = [str(Path(sys.executable).parent / "medflare"), "evaluate", "--model", str(model), "--datalist", str(datalist), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(Path(out).read_text())["evaluations"][0]["sites"][str(datalist)]
    assert result["num_cases"] == len(json.loads(datalist.read_text())["testing"]), result
    loaded = load_result(model)
    (_, predictor), = loaded.predictors({})
    data = loaded.description["data"]
    direct = evaluate(None, make_loader(load_seg_split(datalist, "testing", num_classes=data["num_classes"]), 8, False),
                      task="segmentation", num_classes=data["num_classes"], metrics=["dice"], predict=predictor)
    assert result["mean"]["dice"] == pytest.approx(direct["mean"]["dice"]), (result["mean"], direct["mean"])
    assert [c["dice"] for c in result["per_case"]] == pytest.approx([c["dice"] for c in direct["per_case"]])
    return result


# ---- tests, in the order that overlaps the jobs best -----------------------------------------
def test_dead_site_ends_the_job_with_a_clear_error_in_bounded_time(fed, jobs, sess):
    """Kill one site's job process mid-job (50 rounds): the job must end, not hang, and say which site failed."""
    job_id, victim = jobs["dead_site"], fed.sites[0]
    deadline = time.time() + JOB_TIMEOUT
    while not ("round 0:" in (log := _site_job_log(fed, victim, job_id)) and "local steps" in log):
        assert time.time() < deadline, "the dead_site job never trained a round"
        assert not sess.get_job_status(job_id).startswith("FINISHED"), sess.get_job_meta(job_id)
        time.sleep(1)
    workers = [p for p in fed.pids(fed.kit(victim)) if job_id in (pocfed.cmdline(p) or "")]
    assert workers, f"no job process of {job_id} found at {victim}"
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    killed = time.time()
    meta = _wait(sess, job_id, timeout=DEAD_BOUND)
    elapsed = time.time() - killed
    assert meta["status"] in ("FINISHED:EXECUTION_EXCEPTION", "FINISHED:ABORTED", "FINISHED:ABNORMAL"), meta["status"]
    server_log = (fed.kit(fed.server) / "log.txt").read_text()
    assert f"Failing job {job_id} due to reported failure from {victim}" in server_log
    # nothing of the job keeps running anywhere (the surviving site's job process ended too)
    deadline = time.time() + 60
    while [p for p in fed.pids() if job_id in (pocfed.cmdline(p) or "")]:
        assert time.time() < deadline, "processes of the failed job are still running 60 s after it ended"
        time.sleep(1)
    # the hospital's site itself is still connected and usable by the next job
    assert victim in {c.name for c in sess.get_connected_client_list()}
    print(f"dead site: job ended {meta['status']} {elapsed:.1f} s after its job process at {victim} was killed")


def test_unknown_privacy_scope_is_refused_with_a_clear_message(jobs, sess):
    meta = _wait(sess, jobs["unknown_scope"])
    assert meta["status"] == "FINISHED:FAILED_TO_RUN", meta
    details = meta["job_deploy_detail"]
    refusals = [d for d in details if "privacy scope 'no-such-scope' is not allowed" in d]
    assert len(refusals) == 2, details  # both sites refuse; the server has no privacy policy of its own


def test_byoc_job_is_refused_by_the_authorization_template(jobs, sess):
    meta = _wait(sess, jobs["byoc"])
    assert meta["status"] == "FINISHED:FAILED_TO_RUN", meta
    assert any("BYOC not permitted" in d for d in meta["job_deploy_detail"]), meta["job_deploy_detail"]


def test_class_outside_the_allow_list_is_refused(fed, jobs, sess):
    job_id = jobs["not_allowed"]
    meta = _wait(sess, job_id)
    assert meta["status"] != "FINISHED:COMPLETED", meta
    logs = "".join(_site_job_log(fed, s, job_id) for s in fed.sites)
    assert "'json.decoder.JSONDecoder'" in logs and "not in allow_list" in logs, logs[-3000:]


def test_fedavg_through_the_admin_api(fed, jobs, sess, tmp_path):
    """Allow-list job (no app/custom): completes, sites read their data from local/medflare_data.json,
    the server saved models and TensorBoard scalars, the model learned (the sites' validation Dice rose from round 0),
    and the downloaded model scores with `medflare evaluate`."""
    job_id = jobs["fedavg"]
    meta = _wait(sess, job_id)
    assert meta["status"] == "FINISHED:COMPLETED", meta
    assert all(d.endswith(": OK") for d in meta["job_deploy_detail"]), meta["job_deploy_detail"]
    for site in fed.sites:
        assert str((fed.data / f"{site}.json").resolve()) in _site_job_log(fed, site, job_id), f"{site} did not use local/medflare_data.json"

    ws = _download(fed, sess, job_id)
    for name in ("FL_global_model.pt", "best_FL_global_model.pt"):
        result = load_result(ws / "app_server" / name)
        assert result.kind == "model" and result.description["preset"] == PRESET
    scalars = read_scalars(ws / "tb_events")
    # one folder per site, and the server's own (its update guard's scalars) under the project's name
    assert set(scalars) - {fed.project["name"]} == set(fed.sites), scalars.keys()
    for site, tags in ((s, scalars[s]) for s in fed.sites):
        assert [s for s, _ in tags["val_global/dice"]] == list(range(ROUNDS + 1)), (site, tags.keys())  # + the final model's
        assert len(tags["train_loss"]) == ROUNDS
    # the federation learned: the sites' mean validation Dice of the global model they received in the last round is
    # above round 0's (the initial model) by a margin (the same job in the simulator with these sites: 0.051 -> 0.224)
    dice = {s: dict(scalars[s]["val_global/dice"]) for s in fed.sites}
    first, last = (float(np.mean([dice[s][r] for s in fed.sites])) for r in (0, ROUNDS - 1))
    assert last > first + 0.1, dice
    # the federation trained: the saved global model is not the initial one every site started from
    init = model_from_preset(PRESET).state_dict()
    final = read_checkpoint(ws / "app_server" / "FL_global_model.pt")["model"]
    assert set(final) == set(init) and any(not np.allclose(final[k].numpy(), init[k].numpy()) for k in init), "the global model never changed"
    _evaluate(fed, ws / "app_server" / "FL_global_model.pt", tmp_path / "eval.json")


def _strict_scope() -> dict:
    privacy = json.loads((REPO / "app_configs" / "site" / "local" / "privacy.json").read_text())
    scope = next(s for s in privacy["scopes"] if s["name"] == "strict")
    (flt,) = scope["task_result_filters"]
    assert flt["path"].endswith("PercentilePrivacy")
    return flt["args"]


def test_strict_scope_filters_what_the_server_aggregates(fed, jobs, sess):
    """A one-site, one-round job under the "strict" scope: the server's update must be exactly PercentilePrivacy(
    percentile, gamma) applied to the update the site's executor computed in the same run (saved at the site before any
    filter ran, medflare.testing.widgets.UnfilteredResultRecorder)."""
    job_id, site = jobs["strict_1site"], fed.sites[0]
    meta = _wait(sess, job_id)
    assert meta["status"] == "FINISHED:COMPLETED", meta
    ckpt = read_checkpoint(_download(fed, sess, job_id) / "app_server" / "FL_global_model.pt")
    init = {k: v.numpy().astype(np.float64) for k, v in model_from_preset(PRESET).state_dict().items()}
    with np.load(fed.kit(site) / job_id / "unfiltered_train_0.npz") as saved:
        raw = {k: saved[k].astype(np.float64) for k in init}
    got = {k: ckpt["model"][k].numpy().astype(np.float64) - init[k] for k in init}

    # PercentilePrivacy as FLARE defines it: per-case diff (divided by NUM_STEPS_CURRENT_ROUND, which our
    # executor sets to the site's training cases), zero |d| below the percentile, clip to gamma, scale back.
    args = _strict_scope()
    n = len(json.loads((fed.data / f"{fed.sites[0]}.json").read_text())["training"])
    cutoff = np.percentile(np.concatenate([np.abs(d.ravel() / n) for d in raw.values()]), args["percentile"])
    expected = {}
    for k, d in raw.items():
        w = d / n
        w = np.where(np.abs(w) < cutoff, 0.0, w)
        expected[k] = np.clip(w, -args["gamma"], args["gamma"]) * n
    flat = lambda t: np.concatenate([v.ravel() for v in t.values()])  # noqa: E731
    raw_f, got_f, exp_f = flat(raw), flat(got), flat(expected)

    assert (raw_f == 0).mean() < 0.01, "the unfiltered update should change (almost) every weight"
    zero = (got_f == 0).mean()
    assert abs(zero - args["percentile"] / 100) < 0.02, f"{zero:.3f} of the strict update is zero"
    assert np.abs(got_f).max() <= args["gamma"] * n * (1 + 1e-5)
    close = np.isclose(got_f, exp_f, rtol=1e-4, atol=1e-6).mean()
    assert close > 0.999, f"only {close:.4f} of the strict update matches PercentilePrivacy of the unfiltered one"
    assert not np.allclose(got_f, raw_f, atol=1e-6), "the strict update equals the unfiltered one: no filter ran"
    print(f"strict scope: {zero:.3f} zeroed, {(np.abs(exp_f) >= args['gamma'] * n * (1 - 1e-6)).mean():.3f} clipped, "
          f"{close:.4f} match PercentilePrivacy exactly")


def test_fedsm_through_the_admin_api(fed, jobs, sess, tmp_path):
    job_id = jobs["fedsm"]
    meta = _wait(sess, job_id)
    assert meta["status"] == "FINISHED:COMPLETED", meta
    ws = _download(fed, sess, job_id)
    saved = sorted(p.name for p in (ws / "app_server").glob("*.pt"))
    assert saved, f"FedSM saved no model in {ws / 'app_server'}"
    scalars = read_scalars(ws / "tb_events")
    assert set(scalars) >= set(fed.sites), scalars.keys()
    assert SUPER_MODEL_FILE in saved and BEST_SUPER_MODEL_FILE in saved, saved
    _evaluate(fed, ws / "app_server" / SUPER_MODEL_FILE, tmp_path / "eval.json")


def test_sites_that_cannot_start_end_the_job_in_bounded_time_naming_them(fed, jobs, sess):
    """Issue 28 in a real federation: a job whose preset needs data no site holds (a MedMNIST .npz) must not leave the
    server waiting: each site answers its task with an error naming its cause, and the server ends the job with one
    line naming every missing site and why."""
    job_id = jobs["no_data"]
    start = time.time()
    meta = _wait(sess, job_id)
    assert meta["status"] != "FINISHED:COMPLETED", meta
    ws = _download(fed, sess, job_id)
    server_log = "\n".join(p.read_text() for p in ws.rglob("log*.txt"))
    line = next((x for x in server_log.splitlines() if "0 of 2 sites answered" in x), "")
    assert line and all(site in line for site in fed.sites), (meta["status"], server_log[-3000:])
    assert line.count(".npz") >= len(fed.sites), line  # each site's cause: no MedMNIST file in its data folder
    print(f"no data: job ended {meta['status']} within {time.time() - start:.1f} s of the test's wait; server: {line[:300]}")
