"""Metrics and images from a classic FLARE Executor to the server's TensorBoard.

The client fires FLARE analytics events (``analytix_log_stats``); the job's client config converts them
to federated events (``ConvertToFedEvent``) and the server's ``TBAnalyticsReceiver`` writes them under
``<run>/tb_events/<site>/``. This is the same path FLARE's own ``SummaryWriter`` uses, available to
classic Executors that hold an ``fl_ctx``. A server workflow fires the already-federated event type
(``event_type="fed.analytix_log_stats"``): the receiver then writes under ``<run>/tb_events/server/``.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
from nvflare.apis.analytix import ANALYTIC_EVENT_TYPE, AnalyticsDataType, LogWriterName
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_context import FLContext
from nvflare.apis.utils.analytix_utils import create_analytic_dxo, send_analytic_dxo

#: the event a server component fires so that the job's TBAnalyticsReceiver (which listens to federated events) records it
SERVER_EVENT_TYPE = f"fed.{ANALYTIC_EVENT_TYPE}"


class SiteTracker:
    """Sends scalars and images of one site (or of the server); a no-op for values that are not finite numbers.

    ``event_type``: the analytics event fired. A site fires ``analytix_log_stats`` (converted to a federated
    event by the job's ``ConvertToFedEvent``); a server component passes :data:`SERVER_EVENT_TYPE`
    (``fed.analytix_log_stats``), which the job's ``TBAnalyticsReceiver`` writes under ``tb_events/server/``.
    """

    def __init__(self, component: FLComponent, event_type: str = ANALYTIC_EVENT_TYPE):
        self.component = component
        self.event_type = event_type

    def scalars(self, fl_ctx: FLContext, values: Mapping[str, float], step: int, prefix: str = "") -> None:
        """Send each ``prefix + name`` -> value at ``step`` (the FL round)."""
        for name, value in values.items():
            if isinstance(value, (int, float)) and np.isfinite(value):
                self._send(fl_ctx, prefix + name, float(value), AnalyticsDataType.SCALAR, step)

    def image(self, fl_ctx: FLContext, tag: str, image: np.ndarray, step: int) -> None:
        """Send an image (uint8, shape (3,H,W), channels first as TensorBoard's add_image expects)."""
        self._send(fl_ctx, tag, np.asarray(image), AnalyticsDataType.IMAGE, step)

    def _send(self, fl_ctx: FLContext, tag: str, value, data_type: AnalyticsDataType, step: int) -> None:
        dxo = create_analytic_dxo(tag=tag, value=value, data_type=data_type, writer=LogWriterName.TORCH_TB, global_step=step)
        send_analytic_dxo(self.component, dxo=dxo, fl_ctx=fl_ctx, event_type=self.event_type)
