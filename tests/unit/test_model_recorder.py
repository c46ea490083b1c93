"""medflare.testing.widgets.fingerprint / ModelRecorder: what the POC reliability tests judge aggregation and kept models by."""

import json

import numpy as np
import torch
from nvflare.apis.dxo import DXO, DataKind
from nvflare.apis.fl_constant import FLContextKey, FLMetaKey
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType

from medflare.testing.widgets import ModelRecorder, fingerprint


def test_fingerprint_groups_by_prefix_and_is_linear():
    a = {"global.w": np.array([1.0, 2.0], np.float32), "person_0.w": np.array([3.0]), "global.n": np.array(7)}
    b = {"global.w": np.array([5.0, -2.0], np.float32), "person_0.w": torch.tensor([1.0]), "global.n": np.array(9)}
    fa, fb = fingerprint(a), fingerprint(b)
    assert fa == {"global": [3.0, 5.0], "person_0": [3.0, 9.0]}  # integer entries (BatchNorm counters) are left out
    mean = fingerprint({k: (np.asarray(a[k]) * 1 + np.asarray(b[k]) * 3) / 4 for k in ("global.w", "person_0.w")})
    assert mean["global"][0] == (1 * fa["global"][0] + 3 * fb["global"][0]) / 4  # sums of a weighted mean
    assert fingerprint({"global.w": np.array([1.0, 2.0 + 1e-6])}) != fingerprint({"global.w": np.array([1.0, 2.0])})


class _Workspace:
    def __init__(self, path):
        self.path = path

    def get_run_dir(self, job_id):
        return str(self.path)


class _Engine:
    def __init__(self, path):
        self.workspace = _Workspace(path)

    def get_workspace(self):
        return self.workspace


def test_model_recorder_rows(tmp_path, monkeypatch):
    recorder = ModelRecorder()
    ctx = FLContext()
    monkeypatch.setattr(ctx, "get_engine", lambda: _Engine(tmp_path))
    monkeypatch.setattr(ctx, "get_job_id", lambda: "job")
    ctx.set_prop(AppConstants.CURRENT_ROUND, 2, private=True, sticky=False)
    reply = DXO(DataKind.WEIGHT_DIFF, data={"m.w": np.array([1.0, 1.0])}, meta={FLMetaKey.NUM_STEPS_CURRENT_ROUND: 12})
    peer = FLContext()
    peer.set_prop(FLContextKey.SHAREABLE, reply.to_shareable(), private=True, sticky=False)
    peer.set_prop(FLContextKey.CLIENT_NAME, "site-a", private=False, sticky=False)
    monkeypatch.setattr(ctx, "get_peer_context", lambda: peer)
    monkeypatch.setattr(peer, "get_identity_name", lambda default="": "site-a")
    recorder.handle_event(AppEventType.BEFORE_CONTRIBUTION_ACCEPT, ctx)
    ctx.set_prop(AppConstants.AGGREGATION_RESULT, FLModel(params_type=ParamsType.DIFF, params={"m.w": np.array([0.5, 0.5])}), private=True, sticky=False)
    recorder.handle_event(AppEventType.AFTER_AGGREGATION, ctx)
    recorder.handle_event(AppEventType.ROUND_STARTED, ctx)  # not recorded
    rows = [json.loads(line) for line in (tmp_path / "models.jsonl").read_text().splitlines()]
    assert [(r["event"], r["round"]) for r in rows] == [("contribution", 2), ("aggregate", 2)]
    assert rows[0]["site"] == "site-a" and rows[0]["n"] == 12 and rows[0]["fingerprint"] == {"m": [2.0, 2.0]}
    assert rows[1]["fingerprint"] == {"m": [1.0, 0.5]}
