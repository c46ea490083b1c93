"""A hospital drops out and comes back, the server restarts: a real 3-site POC federation (issue 17).

One federation of three hospitals serves the module, with the server's heart-beat timeout cut to
HEART_BEAT s (provisioning/pocfed.py) and each job's dead-client settings cut to GRACE / LEAD s, so that a
dead site costs the jobs well under two minutes (the production numbers are in provisioning/README.md §10).
The tests run in order on it:

1. FedAvg and FedSM (3 sites, ``min_clients`` 2; FedSM ``min_responses`` 2) run at the same time; after both
   aggregated round 0 the whole victim site (its client process and its job processes) is SIGKILLed. Both jobs
   finish on the two others (every round aggregated; FLARE 2.9 reports such a job FINISHED:ABNORMAL instead of
   COMPLETED when it ends before the server's heart-beat timeout has dropped the dead site, and says why in the
   server log); the job log names the dead site; every later FedAvg aggregate is the
   NUM_STEPS-weighted mean of the two sites that answered; FedSM keeps the victim's personalised model
   exactly as it was after its last answer (not averaged away) while the others keep training.
2. The victim's client is started again: it connects and takes part in round 0 of the next job (FLARE 2.9
   starts a job's process on a site only when the job is deployed, so a site that comes back joins the next
   job, not one already running).
3. The server is SIGKILLed after round 0 of that job (2 rounds) and started again. FLARE 2.9 does not resume
   it: its job snapshots are gone (``persist_components`` is a no-op, nothing restores a running job), so the
   job stays RUNNING in the job store, the sites end their job processes, and no snapshot is written. What
   survives is the server's last saved global model, identical to the one saved before the kill; a job
   resubmitted with it as the persistor's initial model and ``start_round`` = next round finishes the run.

Measured times (site death -> first round without it and -> job end; server kill -> server up, sites back,
old job's processes gone, resumed job's first round) are printed.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from medflare.common.results import read_checkpoint
from medflare.testing.widgets import fingerprint

from . import poc_federation, poc_job, pocfed

pytestmark = [pytest.mark.slow, pytest.mark.poc, pytest.mark.timeout(1200)]

PRESET = "seg_synthetic_tiny"
HEART_BEAT = 30  # s of silence before the server drops a site (servers[0].heart_beat_timeout; template 120)
GRACE = 10  # s a job waits after the dead-site report before the site counts as gone (dead_client_grace_period; FLARE 60)
# s a task must have been out before it may end on dead sites (dead_client_check_lead_time; FLARE 30): once the dead
# site is dropped, every later round waits this long for it after the two others answered (FedAvg's last six rounds:
# 30 s). 1 s passed four local runs but the one CI run with it ended FedAvg FINISHED:EXECUTION_EXCEPTION (both jobs
# then end within seconds of each other); 5 s, the value CI passed with, until that is understood. A CI run with 5 s
# ended FedAvg so once more (2026-11-27; its job log ended on a result download cut by the job's shutdown), which 26
# tries here did not reproduce (the test alone 5 times and beside the end-to-end runs 11, the whole suite twice, the
# victim killed at random rounds 8 times, 4 of them beside 4 CPU-bound processes); FLARE 2.9 also fails a job whose site's job process exits with an error (process_job_failure, an INFO line),
# so a failure now prints every site's exit code, the server's "Failing job" lines and the logs' ends (_why). The
# cause, caught by a clean-clone suite run here on 2026-11-28: the victim was killed while pushing a result, and the
# server job cell exited on that message's undecodable arrays as the job shut down (see the test; accepted with its
# log lines since)
LEAD = 5
JOB_TIMEOUT = 600  # s per job on a loaded 2-core machine
DROP_BOUND = 240  # s from a site's death to the next aggregated round (HEART_BEAT + 5 + GRACE + a round)
# FedAvg's tiny rounds are several times faster than FedSM's: with as few rounds it once finished every round with
# the victim before FedSM had aggregated its round 0 (the kill's trigger), leaving nothing to test
ROUNDS = {"fedavg": 8, "fedsm": 3}
MODELS = "models.jsonl"


@pytest.fixture(scope="module")
def fed(tmp_path_factory):
    with poc_federation(tmp_path_factory, PRESET, n_sites=3, heart_beat_timeout=HEART_BEAT) as federation:
        federation.victim = federation.sites[-1]
        yield federation


def _job(fed, src: str, name: str, *, workflow_args: dict, min_clients: int, persistor_args: dict | None = None) -> Path:
    """A copy of jobs/<src> (tiny, no app/custom) with our dead-site settings, a ModelRecorder, and ``min_clients``."""
    return poc_job(fed, src, name, PRESET, meta={"min_clients": min_clients}, workflow_args=workflow_args,
                   server_settings={"dead_client_grace_period": GRACE, "dead_client_check_lead_time": LEAD},
                   server_components=[{"id": "model_recorder", "path": "medflare.testing.widgets.ModelRecorder", "args": {}}],
                   persistor_args=persistor_args)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _live_rows(fed, job_id) -> list[dict]:
    """The ModelRecorder rows of a running job, read from the server's run folder."""
    return _rows(fed.kit(fed.server) / job_id / MODELS)


def _wait_rows(fed, job_id, done, what: str, timeout=JOB_TIMEOUT) -> list[dict]:
    deadline = time.time() + timeout
    while not done(rows := _live_rows(fed, job_id)):
        assert time.time() < deadline, f"job {job_id}: {what} not reached in {timeout} s"
        time.sleep(0.5)
    return rows


def _aggregated(rows, rnd) -> bool:
    return any(r["event"] == "aggregate" and r["round"] == rnd for r in rows)


def _why(fed, ws: Path, job_id: str, keep: int = 40) -> str:
    """What the federation wrote about a job that ended otherwise than expected, the last ``keep`` lines of each part:
    the server parent's WARNING/ERROR lines naming it and its "Failing job" lines (INFO: a site's job process that
    ended with an error fails the job, FLARE's process_job_failure); every site's exit code of its job process, and
    the end of its job log where that code is not 0; the job's own WARNING/ERROR lines (``ws``, its downloaded
    workspace) and its last lines whatever their level."""
    bad = (" WARNING ", " ERROR ", "return code", "Traceback", "Exception", "Failing job")
    parent = [line for line in _lines(fed.kit(fed.server) / "log.txt") if job_id in line and any(b in line for b in bad)]
    out = ["server:", *parent[-keep:]]
    for site in fed.sites:
        ends = [line for line in _lines(fed.kit(site) / "log.txt") if job_id in line and "finished with RC" in line]
        out += [f"{site}:", *ends]
        if not ends or not ends[-1].endswith("RC 0"):
            out += [f"{site}'s job log ends:", *_lines(fed.kit(site) / job_id / "log.txt")[-keep:]]
    job_log = _lines(ws / "log.txt")
    own = [line for line in job_log if any(b in line for b in bad)]
    return "\n".join([*out, f"job {job_id}:", *own[-keep:], "its last lines:", *job_log[-keep:]])


def _dead_upload_after_the_end(ws: Path, name: str, victim: str) -> bool:
    """Whether the job's log shows the workflow finished (its result saved) and only then the server job cell exiting
    on a streamed submit_update whose arrays could not be downloaded from ``victim`` (see the test)."""
    log = _lines(ws / "log.txt")
    finished = next((i for i, line in enumerate(log) if f"{name} finished: result" in line), None)
    exits = [i for i, line in enumerate(log) if "failed to decode streamed submit_update in server job cell" in line
             and f"failed to download from {victim}." in line]
    return finished is not None and bool(exits) and all(i > finished for i in exits)


def _lines(path: Path) -> list[str]:
    return path.read_text(errors="replace").splitlines() if path.is_file() else []


def _download(fed, sess, job_id) -> Path:
    path = Path(sess.download_job_result(job_id, str(fed.results / job_id))) / "workspace"
    assert path.is_dir(), f"downloaded result of {job_id} has no workspace"
    return path


# ---- 1. a site drops out ---------------------------------------------------------------------
def test_jobs_go_on_without_a_dead_site(fed, sess):
    victim, survivors = fed.victim, fed.sites[:-1]
    ids = {
        "fedavg": sess.submit_job(str(_job(fed, "fedavg", "drop_fedavg", min_clients=2, workflow_args={"num_rounds": ROUNDS["fedavg"], "num_clients": 3}))),
        "fedsm": sess.submit_job(str(_job(fed, "fedsm", "drop_fedsm", min_clients=2, workflow_args={"num_rounds": ROUNDS["fedsm"], "min_responses": 2}))),
    }
    for job_id in ids.values():
        _wait_rows(fed, job_id, lambda rows: _aggregated(rows, 0), "round 0")
    killed_pids = fed.kill(victim)
    killed = time.time()
    assert killed_pids and not fed.pids(fed.kit(victim))
    ended = {}
    pending = dict(ids)
    deadline = killed + JOB_TIMEOUT
    while pending:
        for name, job_id in list(pending.items()):
            if sess.get_job_status(job_id).startswith("FINISHED"):
                ended[name] = time.time() - killed
                del pending[name]
        assert time.time() < deadline, f"jobs {pending} not finished {JOB_TIMEOUT} s after {victim} died"
        time.sleep(1)
    measured = {}
    for name, job_id in ids.items():
        meta = sess.get_job_meta(job_id)
        ws = _download(fed, sess, job_id)
        if meta["status"] == "FINISHED:ABNORMAL":
            # FLARE 2.9 marks a job whose rounds all finished ABNORMAL when a participant that died has not yet been
            # dropped by the server's heart-beat timeout as the job ends (its terminal outcome is pending): only that
            # cause is accepted, and the checks below prove every round was aggregated
            server_log = "\n".join(_lines(fed.kit(fed.server) / "log.txt"))
            assert f"Failing job {job_id}: terminal outcome unavailable from {victim}: client dead" in server_log, (name, meta["status"])
        elif meta["status"] == "FINISHED:EXECUTION_EXCEPTION" and _dead_upload_after_the_end(ws, name, victim):
            # FLARE 2.9 fails a job whose server job cell cannot decode a streamed submit_update (cellnet/cell.py:
            # os._exit(1)): when the victim is killed while pushing a result, the server holds that message's header
            # and waits on the download of its arrays from the dead site until the job's shutdown stops the download
            # service, after the workflow saved its result; only that cause is accepted, and the checks below prove
            # every round was aggregated (provisioning/README.md section 10)
            pass
        elif meta["status"] != "FINISHED:COMPLETED":
            # pytest.fail prints the whole text (an assert's message is cut to a few hundred characters in the summary)
            pytest.fail(f"{name}: {meta['status']}\n{_why(fed, ws, job_id)}", pytrace=False)
        rows = _rows(ws / MODELS)
        contribs = [r for r in rows if r["event"] == "contribution"]
        aggregates = {r["round"]: r for r in rows if r["event"] == "aggregate"}
        end = ROUNDS[name] if name == "fedsm" else ROUNDS[name] - 1  # FedSM's last round validates the final super model
        assert sorted(aggregates) == list(range(end + 1)), (name, sorted(aggregates))
        assert {r["site"] for r in contribs if r["round"] == 0} == set(fed.sites), name
        last = max(r["round"] for r in contribs if r["site"] == victim)
        assert last < ROUNDS[name] - 1, f"{name}: {victim} answered up to the last round; the kill came too late to test anything"
        log = (ws / "log.txt").read_text()
        assert f"client {victim} is placed on dead client watch list" in log, name
        assert f"Client {victim} is deemed disconnected" in log, name
        for rnd in range(last + 1, end + 1):
            assert {r["site"] for r in contribs if r["round"] == rnd} == set(survivors), (name, rnd)
        # the first round aggregated without the dead site, and the job's end, in s from the kill
        measured[name] = (aggregates[last + 1]["time"] - killed, ended[name])
        assert measured[name][0] < DROP_BOUND, (name, measured[name])
        if name == "fedavg":
            # each aggregate is the NUM_STEPS-weighted mean over exactly the sites that answered that round
            for rnd, agg in aggregates.items():
                got = [r for r in contribs if r["round"] == rnd]
                total = sum(r["n"] for r in got)
                for part, (value, _) in agg["fingerprint"].items():
                    expected = sum(r["n"] * r["fingerprint"][part][0] for r in got) / total
                    assert value == pytest.approx(expected, rel=1e-4, abs=1e-4), (rnd, part, value, expected, got)
        else:
            # FedSM (personalised models numbered in sorted site order): the victim's stays exactly as it was
            # after its last answer, the others train on
            key = lambda site: f"person_{sorted(fed.sites).index(site)}"  # noqa: E731
            kept = aggregates[last]["fingerprint"][key(victim)]
            assert f"going on with {sorted(survivors)}; no result from ['{victim}']" in log, "SiteRounds names the missing site"
            for rnd in range(last + 1, end + 1):
                assert aggregates[rnd]["fingerprint"][key(victim)] == kept, f"round {rnd}: {victim}'s personalised model changed while it was away"
            for site in survivors:
                assert aggregates[end]["fingerprint"][key(site)] != aggregates[last]["fingerprint"][key(site)], site
    print(f"site death: (s to the first round aggregated without {victim}, s to the job's end) from the kill: {measured}; "
          f"load {os.getloadavg()}")


# ---- 2. the site comes back; 3. the server restarts -------------------------------------------
# Opt-in (MEDFLARE_POC_RESTART=1): 97 s on a quiet 2-core machine (load 3.6), 5-6 minutes under heavy load, which
# the CI suite's 20-minute budget cannot hold. The admin's reconnection to the restarted server, which once gave
# up after FLARE's 5 s connect timeout (NoConnection) in a loaded CI run, is retried until its deadline
# (pocfed.PocFederation.session). The numbers it measured are in benchmarks/RESULTS_poc_reliability.md.
@pytest.mark.skipif(os.environ.get("MEDFLARE_POC_RESTART") != "1",
                    reason="opt-in: MEDFLARE_POC_RESTART=1 (1.5-6 min; see the comment above the test)")
def test_returning_site_joins_and_server_restart_keeps_the_last_model(fed):
    victim = fed.victim
    sess = fed.session()
    started = time.time()
    fed.start_participant(victim)
    deadline = time.time() + 180
    while victim not in {c.name for c in sess.get_connected_client_list()}:
        assert time.time() < deadline, f"{victim} did not reconnect"
        time.sleep(1)
    rejoined = time.time() - started

    total, done = 2, 0  # round 0 before the crash, round 1 in the resumed job
    job_id = sess.submit_job(str(_job(fed, "fedavg", "long_fedavg", min_clients=3, workflow_args={"num_rounds": total, "num_clients": 3})))
    rows = _wait_rows(fed, job_id, lambda rows: _aggregated(rows, done), f"round {done}")
    assert {r["site"] for r in rows if r["event"] == "contribution" and r["round"] == 0} == set(fed.sites), "the returning site did not take part"
    saved = fed.kit(fed.server) / job_id / "app_server" / "FL_global_model.pt"
    aggregated = next(r["time"] for r in rows if r["event"] == "aggregate" and r["round"] == done)
    deadline = time.time() + 60
    while not (saved.is_file() and saved.stat().st_mtime >= aggregated):  # FedAvg saves right after aggregating
        assert time.time() < deadline, f"round {done}'s model was not saved"
        time.sleep(0.2)
    before = read_checkpoint(saved)
    snapshots = fed.root / "storage" / "snapshot-storage"

    fed.kill(fed.server)
    t = {"kill": time.time()}
    fed.start_participant(fed.server, wait_for=[], timeout=300)
    t["server up"] = time.time()
    sess.close()
    sess = fed.session()
    try:
        fed.wait_connected(fed.sites, timeout=300)
        t["sites back"] = time.time()
        # FLARE 2.9 does not resume the job: no server job process, the sites end theirs, no snapshot exists,
        # and the job store still says RUNNING (nothing closes the job)
        deadline = time.time() + 180
        while [p for p in fed.pids() if job_id in (pocfed.cmdline(p) or "")]:
            assert time.time() < deadline, "processes of the interrupted job still run 180 s after the restart"
            time.sleep(1)
        t["job processes gone"] = time.time()
        status = sess.get_job_status(job_id)
        assert status == "RUNNING", status
        assert not snapshots.exists() or not any(p.is_file() for p in snapshots.rglob("*")), list(snapshots.rglob("*"))
        # the last saved global model survived the crash, identical to the one saved before the kill
        after = read_checkpoint(saved)
        assert set(after["model"]) == set(before["model"])
        assert all((after["model"][k] == before["model"][k]).all() for k in before["model"])

        # resume by resubmission: the saved model as the persistor's initial model, the next round as start_round
        resumed = sess.submit_job(str(_job(
            fed, "fedavg", "resumed_fedavg", min_clients=3,
            workflow_args={"num_rounds": total - done - 1, "num_clients": 3, "start_round": done + 1},
            persistor_args={"source_ckpt_file_full_name": str(saved)})))
        rows = _wait_rows(fed, resumed, lambda rows: _aggregated(rows, done + 1), f"round {done + 1}")
        t[f"resumed job's round {done + 1} aggregated"] = min(r["time"] for r in rows if r["event"] == "aggregate")
        meta = sess.wait_for_job(resumed, timeout=JOB_TIMEOUT, poll_interval=1)
        assert meta["status"] == "FINISHED:COMPLETED", meta["status"]
        ws = _download(fed, sess, resumed)
        rows = _rows(ws / MODELS)
        initial = next(r for r in rows if r["event"] == "initial")
        expected = fingerprint(before["model"])
        assert set(initial["fingerprint"]) == set(expected)
        for part, values in expected.items():
            assert initial["fingerprint"][part] == pytest.approx(values, rel=1e-9), f"the resumed job did not start from the saved model ({part})"
        assert sorted(r["round"] for r in rows if r["event"] == "aggregate") == list(range(done + 1, total))
    finally:
        sess.close()
    print(f"site restart: reconnected after {rejoined:.1f} s; server restart, s from the kill: "
          f"{ {k: round(v - t['kill'], 1) for k, v in t.items()} }; load {os.getloadavg()}")
