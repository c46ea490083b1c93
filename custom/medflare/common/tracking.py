"""Metrics and images from a classic FLARE Executor to TensorBoard: scalars to the server's, pictures to the site's own.

The client fires FLARE analytics events; the job's client config converts ``analytix_log_stats`` events to
federated events (``ConvertToFedEvent``) and the server's ``TBAnalyticsReceiver`` writes them under
``<run>/tb_events/<site>/``. That channel is not a task result: no privacy scope and no task result filter sees
it. So what a site streams is the site's decision, read from its own ``local/medflare_site.json``
(:class:`StreamPolicy`), never the job's:

- ``privacy.stream_scalars`` (default true): losses, metrics and timings stream to the server;
- ``privacy.stream_images`` (default false): pictures of the site's data (segmentation overlays, real-vs-synthetic
  panels) stream to the server only when the operator opts in.

What does not stream is fired as :data:`LOCAL_EVENT_TYPE`, which ``ConvertToFedEvent`` ignores and the site's own
``TBAnalyticsReceiver`` (every medflare job has one on the client side) writes under the site's run folder,
``<site workspace>/<run>/tb_events/<site>/``. A server workflow fires the already-federated event type
(``event_type="fed.analytix_log_stats"``, :data:`SERVER_EVENT_TYPE`): pictures the server makes itself
(generated samples, condensed sets it received) go to the server's TensorBoard under ``tb_events/server/``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
from nvflare.apis.analytix import ANALYTIC_EVENT_TYPE, AnalyticsDataType, LogWriterName
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_context import FLContext
from nvflare.apis.utils.analytix_utils import create_analytic_dxo, send_analytic_dxo

from medflare.common.report import is_percent_tag
from medflare.common.site_config import setting

#: the event a server component fires so that the job's TBAnalyticsReceiver (which listens to federated events) records it
SERVER_EVENT_TYPE = f"fed.{ANALYTIC_EVENT_TYPE}"
#: the event a site fires for what stays at the site: never converted to a federated event, written by the site's receiver
LOCAL_EVENT_TYPE = f"medflare_local.{ANALYTIC_EVENT_TYPE}"


def _is_bool(value) -> bool:
    return isinstance(value, bool)


@dataclass(frozen=True)
class StreamPolicy:
    """What a site lets stream to the server's TensorBoard; the rest stays in its own (see the module docstring)."""

    scalars: bool = True
    images: bool = False

    @classmethod
    def from_site_config(cls, config: Mapping[str, Mapping], site: str) -> "StreamPolicy":
        """The policy in a site's ``medflare_site.json`` sections (``privacy.stream_scalars``, ``privacy.stream_images``)."""
        return cls(scalars=setting(config, "privacy", "stream_scalars", cls.scalars, _is_bool, site),
                   images=setting(config, "privacy", "stream_images", cls.images, _is_bool, site))

    def describe(self) -> str:
        """One phrase for the site's start-up log line."""
        channels = (("scalars", self.scalars), ("pictures of its data", self.images))
        streams = [what for what, on in channels if on]
        stays = [what for what, on in channels if not on]
        return (f"streams {' and '.join(streams) or 'nothing'} to the server's TensorBoard"
                + (f"; {' and '.join(stays)} stay in its own (tb_events/ of its run folder)" if stays else "")
                + " (privacy.stream_scalars / stream_images of its medflare_site.json)")


#: a server component's policy: it streams what it makes itself, scalars and pictures
SERVER_POLICY = StreamPolicy(scalars=True, images=True)


class SiteTracker:
    """Sends scalars and images of one site (or of the server); a no-op for values that are not finite numbers.

    ``event_type``: the analytics event fired for what may stream. A site fires ``analytix_log_stats`` (converted to a
    federated event by the job's ``ConvertToFedEvent``); a server component passes :data:`SERVER_EVENT_TYPE`.
    ``policy``: what may stream (:class:`StreamPolicy`); the rest is fired as :data:`LOCAL_EVENT_TYPE`. Default: a
    site's default (scalars stream, pictures stay); server components pass :data:`SERVER_POLICY`. A site executor
    replaces it with the site's own at START_RUN.
    """

    def __init__(self, component: FLComponent, event_type: str = ANALYTIC_EVENT_TYPE, policy: StreamPolicy | None = None):
        self.component = component
        self.event_type = event_type
        self.policy = policy or (SERVER_POLICY if event_type == SERVER_EVENT_TYPE else StreamPolicy())

    def scalars(self, fl_ctx: FLContext, values: Mapping[str, float], step: int, prefix: str = "") -> None:
        """Send each ``prefix + name`` -> value at ``step`` (the FL round); scores (fractions, as the code holds them)
        go in percent, the unit of every score a person reads (:func:`medflare.common.report.is_percent_tag`)."""
        event = self.event_type if self.policy.scalars else LOCAL_EVENT_TYPE
        for name, value in values.items():
            if isinstance(value, (int, float)) and np.isfinite(value):
                tag = prefix + name
                shown = 100.0 * float(value) if is_percent_tag(tag) else float(value)
                self._send(fl_ctx, tag, shown, AnalyticsDataType.SCALAR, step, event)

    def image(self, fl_ctx: FLContext, tag: str, image: np.ndarray, step: int) -> None:
        """Send an image (uint8, shape (3,H,W), channels first as TensorBoard's add_image expects): to the server when
        the policy lets pictures stream, else to the site's own TensorBoard."""
        event = self.event_type if self.policy.images else LOCAL_EVENT_TYPE
        self._send(fl_ctx, tag, np.asarray(image), AnalyticsDataType.IMAGE, step, event)

    def _send(self, fl_ctx: FLContext, tag: str, value, data_type: AnalyticsDataType, step: int, event_type: str) -> None:
        dxo = create_analytic_dxo(tag=tag, value=value, data_type=data_type, writer=LogWriterName.TORCH_TB, global_step=step)
        send_analytic_dxo(self.component, dxo=dxo, fl_ctx=fl_ctx, event_type=event_type)
