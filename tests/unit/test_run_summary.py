"""Readable output (issue 30): one line per round with the mean over sites of the key metric and the time, the
federation-level curve in the server's TensorBoard, FLARE's transport lines below INFO in the shipped logging config,
and FedAvg on fewer sites than its num_clients without an ERROR every round."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from nvflare.apis.analytix import AnalyticsData
from nvflare.apis.dxo import from_shareable
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_constant import FLContextKey, FLMetaKey
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.aggregators.weighted_aggregation_helper import WeightedAggregationHelper

from medflare.baselines.controller import ResilientFedAvg
from medflare.common.summary import (CURVE_TAG, ROUND_LINE, ROUNDS_LOGGER, RoundSummary, evaluate_command, result_line,
                                     round_line)
from medflare.common.tracking import SERVER_EVENT_TYPE
from medflare.jobs.logs import QUIET, run_log_config, site_log_config

REPO = Path(__file__).resolve().parents[2]


class _Recorder(FLComponent):
    """An FLComponent whose analytics events are kept instead of sent: ``(event type, tag, value, step)``."""

    def __init__(self):
        super().__init__()
        self.sent: list[tuple[str, str, float, int]] = []

    def fire_event(self, event_type: str, fl_ctx: FLContext):
        data = AnalyticsData.from_dxo(from_shareable(fl_ctx.get_prop(FLContextKey.EVENT_DATA)))
        self.sent.append((event_type, data.tag, data.value, data.step))


def test_the_round_line_says_round_mean_over_sites_in_percent_and_seconds_and_parses_back():
    line = round_line(2, 10, "dice", 0.712345, 4, 4.25, also={"global_dice": 0.65})
    assert line == "round 3/10: mean dice over 4 sites 71.23 % (global_dice 65.00 %), 4.2 s"
    parsed = ROUND_LINE.search(line).groupdict()
    assert parsed == {"round": "3", "total": "10", "key": "dice", "sites": "4", "value": "71.23 %",
                      "also": "global_dice 65.00 %", "seconds": "4.2"}
    assert ROUND_LINE.search(round_line(0, 3, "dice", float("nan"), 0, 1.0))  # a round nobody scored still has its line
    assert result_line("fedavg", "/w/FL_global_model.pt", ["site-1", "site-2"]).endswith(
        "score it with: medflare evaluate --model /w/FL_global_model.pt -n 2")
    assert evaluate_command("m.pt", ["a", "b"]) == "medflare evaluate --model m.pt --sites a,b"


def test_round_summary_logs_the_mean_over_sites_and_draws_the_federation_curve(caplog):
    comp = _Recorder()
    per_site = {"site-1": {"dice": 0.5, "hd95": 3.0}, "site-2": {"dice": 0.7}, "site-3": {"dice": float("nan")}}
    with caplog.at_level(logging.INFO, logger=ROUNDS_LOGGER):
        mean = RoundSummary(comp).report(FLContext(), 4, 5, "dice", per_site, also=("hd95",))
    assert mean == pytest.approx(0.6)  # each site once; a NaN score is no score
    [record] = [r for r in caplog.records if r.name == ROUNDS_LOGGER]
    assert ROUND_LINE.search(record.getMessage())["value"] == "60.00 %"
    assert "over 2 sites" in record.getMessage() and "(hd95 3.000)" in record.getMessage()
    assert comp.sent == [(SERVER_EVENT_TYPE, CURVE_TAG.format(key="dice"), pytest.approx(60.0), 4)]  # in percent, as every score in TB


class _Client:
    def __init__(self, name):
        self.name = name


class _Engine:
    def get_clients(self):
        return [_Client("site-1"), _Client("site-2")]


def _result(site, dice, steps=10):
    return FLModel(params_type=ParamsType.DIFF, params={"w": np.full(2, 1.0, dtype=np.float32)}, metrics={"dice": dice},
                   meta={"client_name": site, FLMetaKey.NUM_STEPS_CURRENT_ROUND: steps}, current_round=1)


def test_fedavg_on_fewer_sites_than_num_clients_asks_all_without_an_error_and_reports_each_round(caplog):
    """``nvflare simulator jobs/fedavg -n 2`` printed ``ERROR - num_clients (4) is greater than the number of available
    clients`` every round and no mean over sites."""
    wf = ResilientFedAvg(num_clients=4, num_rounds=3, key_metric="dice")
    wf.engine, wf.fl_ctx = _Engine(), FLContext()
    said = {"info": [], "error": []}
    wf.info, wf.error = said["info"].append, said["error"].append
    sent = []
    wf.fire_event = lambda event_type, fl_ctx: sent.append(event_type)
    wf.event = wf.fire_event_with_data = lambda *a, **k: None  # no FLARE engine here
    for rnd in range(2):  # two rounds as FLARE's FedAvg.run drives them: sample, the results' callbacks, aggregate, update
        wf.current_round = rnd
        assert sorted(wf.sample_clients(wf.num_clients)) == ["site-1", "site-2"]
        wf._aggr_helper, wf._aggr_metrics_helper = WeightedAggregationHelper(), WeightedAggregationHelper()
        wf._all_metrics, wf._site_metric_weights, wf._received_count, wf._expected_count = True, {}, 0, 2
        for r in (_result("site-1", 0.2 + rnd), _result("site-2", 0.4 + rnd)):
            wf._aggregate_one_result(r)
        with caplog.at_level(logging.INFO, logger=ROUNDS_LOGGER):
            wf.update_model(FLModel(params_type=ParamsType.FULL, params={"w": np.zeros(2, dtype=np.float32)}),
                            wf._get_aggregated_result())
    assert said["error"] == [] and [m for m in said["info"] if "num_clients" in m] == [
        "num_clients 4 but 2 sites in this run: every round asks all 2"]  # said once, not every round
    lines = [r.getMessage() for r in caplog.records if r.name == ROUNDS_LOGGER]
    assert [ROUND_LINE.search(line)["round"] for line in lines] == ["1", "2"]
    assert ROUND_LINE.search(lines[0])["value"] == "30.00 %" and "over 2 sites" in lines[0]
    assert sent == [SERVER_EVENT_TYPE, SERVER_EVENT_TYPE]  # one point of the federation curve per round


def test_the_shipped_log_config_is_flares_concise_one_with_its_transport_lines_below_info():
    config = site_log_config()
    for role in ("site", "server"):
        assert json.loads((REPO / "app_configs" / role / "local" / "log_config.json").read_text()) == config, role
    assert {name: config["loggers"][name]["level"] for name in QUIET} == {name: "WARNING" for name in QUIET}


_EMIT = """
import json, logging, sys
from nvflare.fuel.utils.log_utils import apply_log_config
apply_log_config(json.loads(sys.argv[1]), sys.argv[2])
logging.getLogger("nvflare.app_opt.pt.tensor_downloader.TensorDownloadable").info("set transaction info: tx_id='T1'")
logging.getLogger("nvflare.app_common.np.np_downloader.ArrayDownloadable").info("object has been downloaded to all 1 receivers - clear cache")
logging.getLogger("__main__.ClientTaskWorker").info("Finished one task run for client: site-1 interval: 0.02")
logging.getLogger("custom.SupervisedExecutor").info("a site's own line")
logging.getLogger("medflare.summary.rounds").info("round 1/2: mean dice over 2 sites 12.34 %, 1.0 s")
logging.getLogger("medflare.summary.result").info("fedavg finished: result /w/FL_global_model.pt")
logging.getLogger("nvflare.private.anything").warning("a warning")
"""


@pytest.mark.parametrize("which", ["site", "run"])
def test_transport_lines_reach_no_console_and_no_log_file(tmp_path, which):
    config = site_log_config() if which == "site" else run_log_config()
    proc = subprocess.run([sys.executable, "-c", _EMIT, json.dumps(config), str(tmp_path)], capture_output=True, text=True,
                          check=True)
    console, log = proc.stdout, (tmp_path / "log.txt").read_text()
    for text in (console, log):
        assert "set transaction info" not in text and "has been downloaded" not in text and "Finished one task" not in text
        assert "round 1/2: mean dice" in text and "a warning" in text
    assert "a site's own line" in log and "fedavg finished" in log
    if which == "run":  # medflare run's console: the round lines (message only) and warnings, nothing else
        assert console.splitlines()[0] == "round 1/2: mean dice over 2 sites 12.34 %, 1.0 s"
        assert len(console.splitlines()) == 2 and "a site's own line" not in console and "fedavg finished" not in console
    else:
        assert "a site's own line" in console
