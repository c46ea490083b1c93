"""medflare report without running jobs: the traffic meter and its summary, the filter chains it joins, the
every-channel byte count from the egress records, the tables (per-seed spread and ties), the bytes axis of the
figures, resume from records, the plan of rows."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from nvflare.apis.dxo import DXO, DataKind
from nvflare.apis.fl_constant import FLContextKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.app_constant import AppConstants

from medflare import ConfigError
from medflare.common.payload import collection
from medflare.presets import assignments_from_overrides, get_preset, overrides_from_assignments
from medflare.report import runner
from medflare.report.build import describe_environments, plan, write
from medflare.report.figures import bytes_axis
from medflare.report.methods import METHODS, methods_for
from medflare.report.tables import describe_setting, mark_ties, markdown, summary_row
from medflare.report.traffic import LEDGER, TrafficMeter, meter_filters, read_ledger, summarize, summarize_egress
from medflare.jobs.egress import describe_payload, egress_bytes, message_bytes


def _row(t, d, site, rnd, b, kinds=("WEIGHTS",)):
    return {"t": t, "dir": d, "site": site, "task": "train", "round": rnd, "bytes": b, "kinds": list(kinds)}


def test_summary_counts_bytes_per_site_and_round_and_the_busiest_site_is_the_compute():
    rows = [_row(0.0, "down", "a", 0, 100), _row(0.0, "down", "b", 0, 100), _row(2.0, "up", "a", 0, 10, ["WEIGHT_DIFF"]),
            _row(5.0, "up", "b", 0, 30, ["WEIGHT_DIFF"]), _row(6.0, "down", "a", 1, 100), _row(6.5, "down", "b", 1, 100),
            _row(9.0, "up", "a", 1, 20, ["WEIGHT_DIFF"]), _row(7.5, "up", "b", 1, 40, ["WEIGHT_DIFF"])]
    s = summarize(rows)
    assert s["per_site"]["a"]["0"] == {"down": 100, "up": 10} and s["per_site"]["b"]["1"] == {"down": 100, "up": 40}
    assert s["total"] == {"down": 400, "up": 100}
    assert s["per_site_round"] == {"down": 100.0, "up": 25.0}
    assert s["busy_s"] == pytest.approx({"a": 2.0 + 3.0, "b": 5.0 + 1.0})
    assert s["compute_s"] == pytest.approx(5.0 + 3.0)  # the slowest site of each round: b in round 0, a in round 1
    assert s["kinds"] == {"down": ["WEIGHTS"], "up": ["WEIGHT_DIFF"]}


def test_meter_records_a_collection_with_each_parts_kind(tmp_path):
    meter = TrafficMeter("up")
    parts = collection({"w": DXO(DataKind.WEIGHT_DIFF, data={"x": np.zeros(10, np.float32)}),
                        "s": DXO(DataKind.STATISTICS, data={"m": np.zeros(3, np.float64)})})
    shareable = parts.to_shareable()
    shareable.set_header(AppConstants.CURRENT_ROUND, 4)
    ctx = FLContext()
    ctx.set_prop(FLContextKey.APP_ROOT, str(tmp_path), private=True, sticky=False)
    ctx.set_prop(FLContextKey.TASK_NAME, "train", private=True, sticky=False)
    assert meter.process(shareable, ctx) is shareable
    (row,) = read_ledger(tmp_path / LEDGER)
    assert row["bytes"] == 10 * 4 + 3 * 8 and row["round"] == 4 and row["kinds"] == ["STATISTICS", "WEIGHT_DIFF"]
    refused = parts.to_shareable()
    refused.set_return_code(ReturnCode.EXECUTION_EXCEPTION)
    meter.process(refused, ctx)
    assert len(read_ledger(tmp_path / LEDGER)) == 1  # an error reply carries no payload
    with pytest.raises(ConfigError, match="direction"):
        TrafficMeter("sideways")


def test_meters_join_the_existing_chains_once_per_task():
    guard = {"path": "medflare.common.result_guard.UpdateGuard", "args": {}}
    config = {"task_result_filters": [{"tasks": ["train", "validate"], "filters": [guard]}],
              "task_data_filters": [{"tasks": ["train"], "filters": [{"path": "x.Y", "args": {}}]}]}
    meter_filters(config)
    (results,) = config["task_result_filters"]
    assert results["filters"][0]["args"] == {"direction": "up"} and results["filters"][1] is guard  # before the guard
    train, validate = config["task_data_filters"]
    assert train["filters"][-1]["args"] == {"direction": "down"} and train["filters"][0]["path"] == "x.Y"  # after the others
    assert validate == {"tasks": ["validate"], "filters": [{"path": "medflare.report.traffic.TrafficMeter", "args": {"direction": "down"}}]}


def test_a_report_job_carries_its_seed_and_the_meters(tmp_path):
    from medflare.jobs.customize import components
    from medflare.report.runner import export_job

    job = export_job("fediod", tmp_path / "job", preset="fediod_cls_tiny", overrides=None, workflow_args={}, seed=5)
    configs = {p.name: json.loads(p.read_text()) for p in job.glob("app*/config/config_fed_*.json")}
    seeds = [c["args"]["seed"] for cfg in configs.values() for c in components(cfg) if "seed" in c.get("args", {})]
    assert len(seeds) >= 3 and set(seeds) == {5}  # persistor, workflow, executor: none left at the recipe's 0
    paths = [f["path"] for chain in configs["config_fed_server.json"]["task_result_filters"] for f in chain["filters"]]
    assert "medflare.report.traffic.TrafficMeter" in paths


def _event(value):
    from nvflare.apis.analytix import AnalyticsDataType, LogWriterName
    from nvflare.apis.utils.analytix_utils import create_analytic_dxo

    kind = AnalyticsDataType.IMAGE if isinstance(value, np.ndarray) else AnalyticsDataType.SCALAR
    return create_analytic_dxo(tag="t", value=value, data_type=kind, writer=LogWriterName.TORCH_TB, global_step=0).to_shareable()


def _sent(site, channel, topic, payload, method="send_request"):
    """One egress recorder row (:class:`medflare.jobs.egress.EgressRecorder`) of ``site`` sending ``payload``."""
    return {"site": site, "method": method, "channel": channel, "topic": topic, **describe_payload(payload)}


def test_every_channel_counts_events_and_aux_beside_task_results_and_download_chunks_once():
    from nvflare.apis.shareable import Shareable

    reply = collection({"update": DXO(DataKind.WEIGHT_DIFF, data={"w": np.zeros(200, np.float32)}),  # 800 B
                        "scores": DXO(DataKind.METRICS, data={"dice": 0.5})}).to_shareable()
    reply.set_header("__task_name__", "train")
    # a DXO that is not a COLLECTION is recorded as its own single part: its meta array counts once, not twice
    plain = DXO(DataKind.WEIGHT_DIFF, data={"w": np.zeros(5, np.float32)}, meta={"c": np.zeros(5, np.float32)}).to_shareable()
    aux = Shareable()
    aux["probe"] = np.zeros(10, np.float64)  # 80 B outside any DXO on an aux channel
    records = [{"site": "site-1", "start": True, "stream_images": True},
               _sent("site-1", "server_command", "submit_update", reply),
               _sent("site-1", "aux_communication", "fed.event", _event(np.zeros((3, 32, 32), np.uint8)), "fire_and_forget"),
               _sent("site-1", "aux_communication", "fed.event", _event(0.5), "fire_and_forget"),
               _sent("site-1", "aux_communication", "medflare.task_ready", aux, "broadcast_request"),
               # the server pulling a large result: chunks of the reply above, already counted whole
               _sent("site-1", "download_service__", "download_service__download", b"\0" * 4096, "reply"),
               _sent("site-2", "server_command", "submit_update", plain),
               {"site": "site-2", "method": "send_request", "recorder_error": "boom"}]
    assert message_bytes(records[1]) == 800 and message_bytes(records[6]) == 40
    assert egress_bytes(records) == {"server_command/submit_update": 840, "aux_communication/fed.event": 3 * 32 * 32,
                                     "aux_communication/medflare.task_ready": 80, "download_service__/download_service__download": 0}
    assert egress_bytes(records, "site-2") == {"server_command/submit_update": 40}
    s = summarize_egress(records, {"site-1": 2, "site-2": 2})
    assert s["total"] == 840 + 3072 + 80 and s["per_site_round"] == pytest.approx(s["total"] / 4)
    assert s["per_site"]["site-1"]["aux_communication/fed.event"] == 3072 and s["chunks"] == 1
    assert s["messages"]["aux_communication/fed.event"] == 2
    assert s["kinds"] == ["METRICS", "WEIGHT_DIFF"] and s["events"] == ["image", "scalar"]
    assert s["other"] == ["aux_communication/medflare.task_ready"]
    assert summarize_egress([records[0]]) is None  # a run not audited: nothing to count


def _record(method, seed, avg, sites=("s1", "s2"), task="cls", traffic=True, egress=True):
    per = {s: {"accuracy": avg + (0.01 if i else -0.01)} for i, s in enumerate(sites)}
    t = {"per_site_round": {"up": 1000.0, "down": 2000.0}, "total": {"up": 4000, "down": 8000},
         "kinds": {"up": ["WEIGHT_DIFF"], "down": ["WEIGHTS"]},
         "per_site": {s: {"0": {"up": 500, "down": 1000}, "1": {"up": 500, "down": 1000}} for s in sites},
         # every channel: the task results plus 500 B of analytics events per site and round
         "egress": {"per_site_round": 1500.0, "total": 6000, "kinds": ["METRICS", "WEIGHT_DIFF"], "events": ["scalar"],
                    "other": []} if egress else None}
    return {"method": method, "label": method.upper(), "task": task, "skew": 0.5, "seed": seed, "sites": list(sites), "rounds": 2,
            "mode": "quick", "preset": "p", "local_epochs": 1, "scores": {"sites": per, "client_average": {"accuracy": avg},
            "global": {"accuracy": avg}}, "curve": [avg / 2, avg], "traffic": t if traffic else None, "seconds": 10.0,
            "overhead_s": 4.0, "peak_mb": {"server": 900.0, "s1": 400.0, "s2": 450.0}, "epsilon": {"s1": 2.0} if method == "dp" else None,
            "load": [1.0, 2.0]}


def test_the_setting_line_names_the_rows_that_ran_other_rounds():
    runs = {"FedAvg": [_record("fedavg", 0, 0.8)], "FedSM": [{**_record("fedsm", 0, 0.8), "rounds": 4}],
            "local": [_record("local", 0, 0.7)]}
    line = describe_setting(runs)
    assert line.startswith("Sites s1, s2; 2 rounds (FEDSM 4: the job's own schedule)"), line  # the record's label
    two_rows = describe_setting({"FedSM": runs["FedSM"] * 2, "local": runs["local"]})  # most rows at 4: still named
    assert two_rows.startswith("Sites s1, s2; 2 rounds (FEDSM 4: the job's own schedule)"), two_rows
    assert "own schedule" not in describe_setting({"FedAvg": runs["FedAvg"], "local": runs["local"]})


def test_tables_mean_and_spread_over_seeds_and_mark_what_the_spread_cannot_separate():
    rows = [summary_row([_record("a", 0, 0.80), _record("a", 1, 0.90)]),
            summary_row([_record("b", 0, 0.82), _record("b", 1, 0.84)]),
            summary_row([_record("c", 0, 0.40), _record("c", 1, 0.42)])]
    assert rows[0]["client_average"] == pytest.approx(0.85) and rows[0]["client_average_sd"] == pytest.approx(0.0707, abs=1e-4)
    mark_ties(rows)
    assert [r.get("tie") for r in rows] == [False, True, False]  # b within a's spread, c far below
    # a centralised (or local) row scoring higher is a reference, not the best method the others are compared with
    central = summary_row([_record("central", 0, 0.99, traffic=False), _record("central", 1, 0.97, traffic=False)])
    mark_ties(rows + [central])
    assert [r.get("tie") for r in rows + [central]] == [False, True, False, False]
    md = markdown(rows, "cls", ["s1", "s2"])
    assert "| A | 0, 1 | 84.00 | 86.00 | 85.00 +- 7.07 |" in md and "| B ~ | 0, 1 |" in md
    assert "every channel" in md.splitlines()[0]
    assert "1.0 kB | 1.5 kB | 2.0 kB | 0.01 MB | METRICS, WEIGHT_DIFF; analytics: scalar | 10 | 4 | 450 | - |" in md
    # a record from before the egress recorder: task results only, the every-channel cells say it was not counted
    old = summary_row([{**_record("o", 0, 0.5), "traffic": {**_record("o", 0, 0.5)["traffic"], "egress": None}}])
    assert "| 1.0 kB | - | 2.0 kB | - | WEIGHT_DIFF | 10 |" in markdown([old], "cls", ["s1", "s2"])
    assert summary_row([_record("dp", 0, 0.5)])["epsilon"] == 2.0
    on_gpu = summary_row([{**_record("g", 0, 0.5), "device": "GPU NVIDIA H100"}])
    assert "| 10 (GPU) | 4 (GPU) |" in markdown([on_gpu], "cls", ["s1", "s2"])  # GPU timings marked


def test_bytes_axis_counts_what_was_sent_before_each_point():
    r = {**_record("a", 0, 0.8), "curve": [0.1, 0.4, 0.8], "curve_x": [0, 1, 2]}  # sites score what they receive
    assert bytes_axis(r) == pytest.approx([0.0, 0.003, 0.006])  # 2 sites x (500 + 1000) B per round
    assert bytes_axis({**r, "curve": [0.4, 0.8], "curve_x": [1, 2]}) == pytest.approx([0.003, 0.006])
    assert bytes_axis(_record("l", 0, 0.8, traffic=False)) == [0.0, 0.0]


def test_a_finished_row_is_reused_unless_rerun(tmp_path, monkeypatch):
    row = runner.Row(METHODS["cls_fedavg"], ("site-1", "site-2"), 2, skew=0.5)
    calls = []

    def fake(row, work, log):
        calls.append(row.key)
        return {"scores": {}, "curve": [], "traffic": {"compute_s": 1.5}, "peak_mb": {}, "epsilon": None}

    monkeypatch.setattr(runner, "_federated", fake)
    monkeypatch.setattr(runner, "available_cores", lambda: 7)  # a container's quota: what the environment must name
    first = runner.run_row(row, tmp_path)
    again = runner.run_row(row, tmp_path)
    assert calls == ["cls_beta0.5/cls_fedavg_seed0"] and again == json.loads(json.dumps(first, default=float))
    assert first["overhead_s"] == pytest.approx(first["seconds"] - 1.5)
    env = first["environment"]  # what its numbers reproduce in: CPU, versions, threads
    assert env["torch"] == torch.__version__ and env["torch_threads"] == torch.get_num_threads() and env["cpu"]
    assert env["cores"] == 7  # the cores the thread shares are cut from (affinity, quota), not the host's count
    runner.run_row(row, tmp_path, rerun=True)
    assert len(calls) == 2


def test_report_settings_reach_every_row_are_recorded_and_a_folder_run_with_others_is_refused(tmp_path, monkeypatch):
    """``medflare report --set data.scale=0.25``: every row's preset reads it, the record keeps it, REPORT.md says it,
    and a record run with other settings is not reused in silence (its path names no settings)."""
    from medflare import MedflareError

    scarce = {"data": {"scale": 0.25}}
    rows = plan(["seg"], "full", seeds=[0], settings=scarce)
    assert {get_preset(r.preset, r.overrides)["data"]["scale"] for r in rows} == {0.25}
    assert {get_preset(r.preset, r.overrides)["data"]["scale"] for r in plan(["seg"], "full", seeds=[0])} == {1.0}
    with pytest.raises(ConfigError, match="sclae"):  # a misspelt key stops the report before anything runs
        plan(["seg"], "full", seeds=[0], settings={"data": {"sclae": 0.25}})
    runs = []
    monkeypatch.setattr(runner, "_federated", lambda row, work, log: runs.append(row.key) or {
        "scores": {}, "curve": [], "traffic": {"compute_s": 1.0}, "peak_mb": {}, "epsilon": None})
    row = runner.Row(METHODS["cls_fedavg"], ("site-1", "site-2"), 2, skew=0.5, settings=scarce)
    assert runner.run_row(row, tmp_path)["settings"] == scarce
    assert runner.run_row(row, tmp_path)["settings"] == scarce and len(runs) == 1  # reused: same settings, not rerun
    tupled = runner.Row(METHODS["cls_fedavg"], ("site-1", "site-2"), 2, skew=0.5, settings={"model": {"args": {"channels": (8, 16)}}})
    saved = {"settings": {"model": {"args": {"channels": [8, 16]}}}}  # a tuple as the record's JSON holds it
    assert runner.reusable(saved, tupled, tmp_path / "r.json") is saved
    with pytest.raises(MedflareError, match="was run with settings .*scale.*--rerun"):
        runner.run_row(runner.Row(METHODS["cls_fedavg"], ("site-1", "site-2"), 2, skew=0.5), tmp_path)
    assert describe_setting({"a": [{**_record("a", 0, 0.8), "settings": scarce}]}).endswith(
        "presets p, with --set data.scale=0.25 in every row.")
    assert "--set" not in describe_setting({"a": [_record("a", 0, 0.8)]})  # records from before: no settings
    nested = {"data": {"scale": 0.25}, "train": {"lr": 0.01, "loss": "dice"}}
    assert assignments_from_overrides(nested) == ["data.scale=0.25", "train.lr=0.01", 'train.loss="dice"']
    assert overrides_from_assignments(assignments_from_overrides(nested)) == nested  # what the note says, --set reads


def test_the_cpu_model_comes_from_cpuinfo_and_a_report_says_when_its_rows_ran_in_different_environments(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Test CPU\n")
    assert runner.cpu_model(info) == "Intel(R) Xeon(R) Test CPU"
    assert runner.cpu_model(tmp_path / "absent")  # not Linux: platform's answer, never empty
    env = {"cpu": "X", "cores": 2, "python": "3.11.9", "torch": "2.13.0", "monai": "1.5", "nvflare": "2.9",
           "torch_threads": 2, "omp_num_threads": None}
    one = [{**_record("a", s, 0.8), "environment": env} for s in (0, 1)]
    assert describe_environments(one) == ("X, Python 3.11.9, torch 2.13.0, MONAI 1.5, NVFlare 2.9, 2 torch threads in "
                                          "the standalone rows (OMP_NUM_THREADS unset)")
    mixed = one + [{**_record("a", 2, 0.8), "environment": {**env, "torch_threads": 1, "omp_num_threads": "1"}}]
    assert describe_environments(mixed).startswith("the rows ran in 2 environments")
    assert describe_environments([_record("a", 0, 0.8)]) == "environment not recorded"  # records from before
    write(tmp_path / "r", mixed)
    assert "the rows ran in 2 environments" in (tmp_path / "r" / "REPORT.md").read_text()


def test_plan_and_method_selection():
    rows = plan(["seg", "cls"], "quick")
    assert len(rows) == 10 + 2 * 7 and {r.rounds for r in rows} == {2}
    assert [m.name for m in methods_for("cls", ["fedavg", "fedvck"])] == ["cls_fedavg", "fedvck"]
    full = plan(["cls"], "full", seeds=[0, 1, 2], skews=[0.1])
    assert full[0].overrides["data"]["beta"] == 0.1 and full[0].overrides["data"]["num_sites"] == 10
    seg_full = {r.method.name: r for r in plan(["seg"], "full", seeds=[0])}  # the jobs' own schedules where they differ
    assert {n: r.rounds for n, r in seg_full.items() if r.rounds != 10} == {"fedsm": 20, "fedsm_extra": 20, "fediod_seg": 30}
    local_epochs = {n: r.rounds * get_preset(r.preset, r.overrides)["train"]["epochs"] for n, r in seg_full.items()}
    assert local_epochs["fedsm"] == local_epochs["fedavg"] == 20  # FedSM's one-epoch rounds: the baselines' local epochs
    # (not their steps on small sites: train.min_steps makes each FedSM round at least 25 steps, jobs/fedsm/README.md)
    for mode in ("quick", "full"):  # every row of a task reads the same sites and images, whatever its own preset
        for task in ("seg", "cls"):
            datas = {json.dumps(get_preset(r.preset, r.overrides)["data"], sort_keys=True) for r in plan([task], mode)}
            assert len(datas) == (1 if task == "seg" else 2), (mode, task, datas)  # cls: one per skew
    with pytest.raises(ConfigError, match="unknown method"):
        methods_for("seg", ["fedxyz"])
    with pytest.raises(ConfigError, match="unknown task"):
        plan(["det"], "quick")


def test_write_makes_report_csv_json_and_a_figure(tmp_path):
    records = [_record("a", 0, 0.8), _record("b", 0, 0.6, traffic=False)]
    write(tmp_path, records)
    text = (tmp_path / "REPORT.md").read_text()
    assert "Classification, Dirichlet(0.5)" in text and "seeds 0" in text and "![" in text
    assert (tmp_path / "cls_beta0.5.png").stat().st_size > 1000
    assert (tmp_path / "report.csv").read_text().splitlines()[0].startswith("method,label,seeds")
    assert len(json.loads((tmp_path / "report.json").read_text())["rows"]) == 2


def test_payload_size_counts_arrays_in_meta_too():
    """FLARE's SCAFFOLD sends its control variates in the DXO's meta: they cross the wire and count."""
    from medflare.report.traffic import payload_size

    dxo = DXO(DataKind.WEIGHT_DIFF, data={"w": np.zeros(5, np.float32)}, meta={"c": {"w": np.zeros(5, np.float32)}, "n": 3})
    assert payload_size(dxo) == 40
    assert payload_size(collection({"a": dxo, "b": DXO(DataKind.METRICS, data={"acc": 0.5})})) == 40


def test_a_failed_row_is_listed_and_the_others_go_on(tmp_path, monkeypatch):
    from medflare import MedflareError
    from medflare.report.build import report

    def fake(row, work, log):
        if row.method.name == "cls_fedprox":
            raise MedflareError("job 'fedprox' failed in the simulator\nlong log")
        return {"scores": {"sites": {s: {"accuracy": 0.5} for s in row.sites}, "client_average": {"accuracy": 0.5},
                           "global": {"accuracy": 0.5}}, "curve": [0.2, 0.5], "curve_x": [0, 1], "traffic": None,
                "peak_mb": {}, "epsilon": {"site-1": float("inf")}}

    monkeypatch.setattr(runner, "_federated", fake)
    rows = plan(["cls"], "quick", methods=["fedavg", "fedprox", "fediod"], sites=["site-1", "site-2"], skews=[0.5])
    logs = []
    path, failed = report(tmp_path, rows, log=logs.append)
    assert failed == ["cls_beta0.5/cls_fedprox_seed0: MedflareError: job 'fedprox' failed in the simulator"]
    text = path.read_text()
    assert "**Rows that failed**" in text and "| FedAvg |" in text and "| FedIOD |" in text and "| FedProx |" not in text
    assert "inf (no noise)" in text
    assert any("FAILED" in line for line in logs)

    # a long run in parts: --write-only runs nothing and lists what has no record (FedProx, which failed, and a
    # seed not run yet), with the finished rows in the tables
    monkeypatch.setattr(runner, "_federated", lambda *a: pytest.fail("write_only ran a row"))
    more = plan(["cls"], "quick", methods=["fedavg", "fedprox"], sites=["site-1", "site-2"], skews=[0.5], seeds=[0, 1])
    path, failed = report(tmp_path, more, write_only=True, log=logs.append)
    text = path.read_text()
    assert not failed and "**Rows not run yet**" in text and "| FedAvg | 0 |" in text
    assert "cls_beta0.5/cls_fedprox_seed0, cls_beta0.5/cls_fedavg_seed1, cls_beta0.5/cls_fedprox_seed1" in text


def test_round_progress_reports_each_new_round_once_and_waits_for_whole_lines(tmp_path):
    ledger = tmp_path / LEDGER
    seen = []
    watch = runner.RoundProgress(ledger, seen.append)
    watch.poll()  # no ledger yet (the simulator is starting)
    down = lambda rnd, site: json.dumps({"dir": "down", "round": rnd, "site": site})  # noqa: E731
    ledger.write_text(down(0, "a") + "\n" + down(0, "b") + "\n" + json.dumps({"dir": "up", "round": 1}) + "\n")
    watch.poll()
    assert seen == [0]  # one call for round 0 however many sites receive it; a result is not a new round
    with open(ledger, "a") as f:
        f.write(down(1, "a")[:10])  # half a line: the meter is still writing it
    watch.poll()
    assert seen == [0]
    with open(ledger, "a") as f:
        f.write(down(1, "a")[10:] + "\n" + down(1, "b") + "\n" + down(2, "a") + "\n")
    watch.poll()
    assert seen == [0, 1, 2]
