"""One unit for scores wherever a person reads them (issue 30): TensorBoard shows scores in percent, as the tables and
logs do, and code that reads the scalars back gets fractions, as the JSON records hold them."""

from __future__ import annotations

import numpy as np
import pytest
from nvflare.apis.fl_context import FLContext

from medflare.common.report import is_percent_tag
from medflare.common.tracking import SiteTracker
from medflare.jobs.simulate import read_scalars


@pytest.mark.parametrize("tag, percent", [
    ("val_global/dice", True), ("federation/mean_own_or_global_dice", True), ("final/test_accuracy/hospital_b", True),
    ("val_accuracy_pooled", True), ("final/selected_own", True), ("student/val_accuracy", True),
    ("val_global/hd95", False), ("val_global/vi", False), ("train_loss_global", False), ("final/test_cases/site-1", False),
    ("upload_bytes/site-1", False), ("guard/refused/site-1", False), ("time/train_s", False), ("train/steps", False),
])
def test_scores_are_percent_tags_and_counts_losses_distances_are_not(tag, percent):
    assert is_percent_tag(tag) is percent


def test_the_tracker_sends_scores_in_percent_and_read_scalars_gives_fractions_back(monkeypatch, tmp_path):
    import medflare.common.tracking as tracking
    from torch.utils.tensorboard import SummaryWriter

    sent = []
    monkeypatch.setattr(tracking, "send_analytic_dxo", lambda comp, dxo, fl_ctx, event_type: sent.append(dxo))
    SiteTracker(object()).scalars(FLContext(), {"dice": 0.7125, "hd95": 3.5, "steps": 12}, 4, prefix="val_global/")
    shown = {d.data["track_key"]: d.data["track_value"] for d in sent}
    assert shown == pytest.approx({"val_global/dice": 71.25, "val_global/hd95": 3.5, "val_global/steps": 12.0})

    writer = SummaryWriter(str(tmp_path / "site-1"))  # what the server's TBAnalyticsReceiver writes of those events
    for tag, value in shown.items():
        writer.add_scalar(tag, value, 4)
    writer.close()
    back = {tag: series[0][1] for tag, series in read_scalars(tmp_path)["site-1"].items()}
    assert back == pytest.approx({"val_global/dice": 0.7125, "val_global/hd95": 3.5, "val_global/steps": 12.0})
    assert np.isclose(back["val_global/dice"] * 100, shown["val_global/dice"])
