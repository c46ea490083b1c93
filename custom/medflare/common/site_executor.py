"""Base class of medflare's client-side FLARE Executors: one site, its data, its model, its metrics.

Every algorithm's executor needs the same things once per run: the site's name and ``local/`` folder,
the preset (dataset, model, training settings), the site's data resolved the same way in simulator,
POC and production, a device, validation with the shared metrics, and TensorBoard streaming. They live
here once; subclasses only map task names to handlers that do the algorithm's work.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

import torch
from nvflare.apis.event_type import EventType
from nvflare.apis.executor import Executor
from nvflare.apis.fl_constant import FLContextKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable, make_reply
from nvflare.apis.signal import Signal

from medflare import MedflareError
from medflare.common.component import keep_args
from medflare.common.site_config import read_site_config, setting
from medflare.common.tracking import SiteTracker
from medflare.common.training import make_loader, pick_device
from medflare.data import SiteData, load_site
from medflare.metrics import evaluate, overlay_image
from medflare.nets import build_from_spec
from medflare.presets import get_preset

Handler = Callable[[Shareable, FLContext, Signal], Shareable]


def format_metrics(metrics: Mapping[str, float]) -> str:
    """``name=value`` pairs for a log line, 4 decimals."""
    return ", ".join(f"{k}={v:.4f}" for k, v in metrics.items())


class SiteExecutor(Executor):
    """Shared set-up and task dispatch for medflare client executors.

    Args:
        preset: name of a preset in :mod:`medflare.presets` (dataset, model, training). Default "seg_synthetic".
        overrides: nested dict merged into the preset, e.g. ``{"train": {"epochs": 2}}``. Default none.
        device: "auto" (GPU when present), "cpu" or "cuda:N". Default "auto".
        seed: seed for model initialisation and batch order. Default 0.
        num_overlays: validation cases shown as segmentation overlays in TensorBoard. Default 2.
        overlay_every: rounds between overlay images (the first and last rounds always get one). Default 5.
    """

    def __init__(
        self,
        preset: str = "seg_synthetic",
        overrides: Mapping[str, Any] | None = None,
        device: str = "auto",
        seed: int = 0,
        num_overlays: int = 2,
        overlay_every: int = 5,
    ):
        super().__init__()
        keep_args(self, preset=preset, overrides=overrides or {}, device=device, seed=seed, num_overlays=num_overlays,
                  overlay_every=overlay_every)
        self.cfg = get_preset(preset, overrides)
        self.torch_device = pick_device(device)
        self.site: str = ""
        self.site_config: dict = {}  # the site's own medflare_site.json (privacy, compute), read at START_RUN
        self.data: SiteData | None = None
        self.tracker = SiteTracker(self)
        self._handlers: dict[str, Handler] = {}

    # ---- set-up ------------------------------------------------------------------------------
    def register_task(self, task_name: str, handler: Handler) -> None:
        """Route FLARE task ``task_name`` to ``handler(shareable, fl_ctx, abort_signal) -> Shareable``."""
        self._handlers[task_name] = handler

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type == EventType.START_RUN:
            self.site = fl_ctx.get_identity_name()
            workspace = fl_ctx.get_prop(FLContextKey.WORKSPACE_OBJECT)
            local_dir = workspace.get_site_config_dir() if workspace is not None else None
            try:
                self.site_config = read_site_config(local_dir, self.site)
                self._set_threads(fl_ctx)
                self.data = load_site(self.site, self.cfg["data"], local_dir=local_dir)
                torch.manual_seed(self.seed)
                self.setup(fl_ctx)
            except MedflareError as e:  # the message names the site and the file or key
                self.log_error(fl_ctx, str(e))
                self.system_panic(f"cannot start: {e}", fl_ctx)
                return
            self.log_info(
                fl_ctx,
                f"site '{self.site}': preset '{self.preset}', data {self.data.source} "
                f"(train {len(self.data.train)}, val {len(self.data.val)}, test {len(self.data.test)}), device {self.torch_device}",
            )

    def _set_threads(self, fl_ctx: FLContext) -> None:
        """torch's CPU threads: the site's ``compute.threads``; in FLARE's simulator (many sites, one machine) without
        that setting or OMP_NUM_THREADS, 1, since N site processes each spinning one thread per core slow every site
        down (FedSM, 4 sites on 2 cores: 184 s vs 48 s with one thread each); otherwise torch's default (every core)."""
        threads = setting(self.site_config, "compute", "threads", None,
                          check=lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1), site=self.site)
        if threads is None and fl_ctx.get_prop(FLContextKey.SIMULATE_MODE, False) and "OMP_NUM_THREADS" not in os.environ:
            threads = 1
        if threads is not None:
            torch.set_num_threads(threads)
            self.log_info(fl_ctx, f"site '{self.site}': {threads} CPU thread(s) for torch")

    def setup(self, fl_ctx: FLContext) -> None:
        """Build models and optimisers once the site's data is known (called at START_RUN)."""

    def new_model(self) -> torch.nn.Module:
        """A fresh network of the preset's architecture on this executor's device."""
        return build_from_spec(self.cfg["model"]).to(self.torch_device)

    # ---- task dispatch -----------------------------------------------------------------------
    def execute(self, task_name: str, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        handler = self._handlers.get(task_name)
        if handler is None:
            self.log_error(fl_ctx, f"site '{self.site}': unknown task '{task_name}' (known: {sorted(self._handlers)})")
            return make_reply(ReturnCode.TASK_UNKNOWN)
        if self.data is None:
            return make_reply(ReturnCode.EXECUTION_EXCEPTION)
        try:
            return handler(shareable, fl_ctx, abort_signal)
        except MedflareError as e:
            self.log_error(fl_ctx, f"site '{self.site}', task '{task_name}': {e}")
            return make_reply(ReturnCode.EXECUTION_EXCEPTION)

    # ---- evaluation and tracking -------------------------------------------------------------
    def loader(self, split: str, shuffle: bool = False, round_num: int = 0):
        """DataLoader over this site's ``split`` with the preset's batch size (shuffle seeded per round)."""
        dataset = getattr(self.data, split)
        return make_loader(dataset, self.cfg["train"]["batch_size"], shuffle, seed=self.seed + round_num)

    def validate(self, model: torch.nn.Module, split: str = "val", predict=None) -> dict[str, float]:
        """Mean metrics of ``model`` (or of ``predict``) on this site's ``split`` with the preset's metrics."""
        result = evaluate(
            model,
            self.loader(split),
            task=self.data.task,
            num_classes=self.data.num_classes,
            metrics=self.cfg["eval"]["metrics"],
            device=self.torch_device,
            predict=predict,
        )
        return result["mean"]

    def log_overlays(self, fl_ctx: FLContext, model: torch.nn.Module, tag: str, round_num: int, total_rounds: int | None) -> None:
        """Image | ground truth | prediction for the first validation cases, on the first, every Nth and last round."""
        last = total_rounds is not None and round_num >= total_rounds - 1
        if self.data.task != "segmentation" or not (round_num == 0 or last or round_num % max(1, self.overlay_every) == 0):
            return
        model.eval()
        with torch.no_grad():
            for i in range(min(self.num_overlays, len(self.data.val))):
                item = self.data.val[i]
                pred = model(item["image"][None].to(self.torch_device)).argmax(1).cpu()
                self.tracker.image(fl_ctx, f"{tag}/case{i}", overlay_image(item["image"], item["label"], pred), round_num)
