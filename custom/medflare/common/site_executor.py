"""Base class of medflare's client-side FLARE Executors: one site, its data, its model, its metrics.

Every algorithm's executor needs the same things once per run: the site's name and ``local/`` folder,
the preset (dataset, model, training settings), the site's data resolved the same way in simulator,
POC and production, a device, validation with the shared metrics, and TensorBoard streaming. They live
here once; subclasses only map task names to handlers that do the algorithm's work.
"""

from __future__ import annotations

import resource
import time
from typing import Any, Callable, Mapping

import torch
from nvflare.apis.event_type import EventType
from nvflare.apis.executor import Executor
from nvflare.apis.fl_constant import FLContextKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal
from nvflare.app_common.app_constant import AppConstants

from medflare import MedflareError
from medflare.common.component import keep_args
from medflare.common.compute import ComputeShare, apply_threads, compute_share
from medflare.common.site_config import read_site_config, setting
from medflare.common.site_errors import error_reply
from medflare.common.tracking import SiteTracker, StreamPolicy
from medflare.common.training import batch_size_for, capped_batch_size, make_loader, one_line, pick_device, short_round
from medflare.data import SiteData, load_site
from medflare.data.site import confine_job_paths, job_path_roots
from medflare.metrics import evaluate, metrics_for_round, overlay_image
from medflare.metrics.site_mean import unseen_classes_warning
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
        num_overlays: validation cases shown as segmentation overlays in TensorBoard (the site's own, unless its operator
            lets pictures stream: :mod:`medflare.common.tracking`). Default 2.
        overlay_every: rounds between overlay images (the first and last rounds always get one). Default 5.

    The machine is the site's to describe: at START_RUN the executor takes its share of the CPU cores
    (torch threads, data-loader workers; :mod:`medflare.common.compute`) and, when the site's
    ``local/medflare_site.json`` says ``"compute": {"device": ...}``, that device instead of the job's
    ``device``. A job's path-valued settings (``data.cache.dir``) must point into the site's workspace or
    cache folder, else the site refuses to start with a ConfigError naming the key
    (:func:`medflare.data.site.confine_job_paths`). A site that cannot start (that error, no data, a config its
    checks refuse) stays in the job and answers every task with an error reply naming the cause, which the server
    counts as a missing site (:mod:`medflare.common.site_errors`); a task that fails on a MedflareError does the
    same for that task only. On a GPU the preset's ``train.gpu_batch_size`` (when > 0)
    replaces ``train.batch_size``.
    Each task's compute time (and the part spent in :meth:`validate`) is logged and sent to TensorBoard as
    ``time/task_s`` and ``time/validate_s``; the process's peak memory is logged at END_RUN.
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
        self.compute: ComputeShare | None = None  # this process's threads and loader workers, set at START_RUN
        self._threads: int | None = None  # torch's thread count after the share was applied
        self._handlers: dict[str, Handler] = {}
        self._validate_s = 0.0  # seconds spent in validate() during the current task
        self._warned_unseen: set[str] = set()  # splits whose never-seen classes were logged (once a run, not every round)
        self._start_error = ""  # why START_RUN failed (sent with every task's error reply), "" when it did not

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
                # the job's paths (data.cache.dir, ...) may only point into this site's workspace and cache folder
                self.cfg = confine_job_paths(self.cfg, job_path_roots(workspace.get_root_dir() if workspace else None), self.site)
                self.site_config = read_site_config(local_dir, self.site)
                self.tracker.policy = StreamPolicy.from_site_config(self.site_config, self.site)  # the site's, not the job's
                self._take_machine_share(fl_ctx)
                self.data = load_site(self.site, self.cfg["data"], local_dir=local_dir)
                batch_note = self._cap_batch()
                torch.manual_seed(self.seed)
                self.setup(fl_ctx)
            except MedflareError as e:  # the message names the site and the file or key
                # No panic: the site stays in the job and answers every task with this cause (execute), so the server
                # counts it as missing at once instead of waiting for it forever (common/site_errors.py).
                self.data, self._start_error = None, f"cannot start: {one_line(e)}"
                self.log_error(fl_ctx, f"{self._start_error}; every task of this job gets an error reply naming it")
                return
            self.log_info(
                fl_ctx,
                f"site '{self.site}': preset '{self.preset}', data {self.data.source} "
                f"(train {len(self.data.train)}, val {len(self.data.val)}, test {len(self.data.test)}), device {self.torch_device}, "
                f"batch size {self.cfg['train']['batch_size']}{batch_note}; {self.compute.describe(self._threads)}",
            )
            self.log_info(fl_ctx, f"site '{self.site}' {self.tracker.policy.describe()}")
        elif event_type == EventType.END_RUN and self.site:
            self.log_info(fl_ctx, f"site '{self.site}': {peak_memory()}")

    def _take_machine_share(self, fl_ctx: FLContext) -> None:
        """Threads, loader workers, device and batch size for this site's machine (see the class docstring)."""
        train = self.cfg["train"]
        self.compute = compute_share(self.site_config, site=self.site, fl_args=fl_ctx.get_prop(FLContextKey.ARGS),
                                     default_workers=train["num_workers"])
        self._threads = apply_threads(self.compute)
        device = setting(self.site_config, "compute", "device", self.device, lambda v: isinstance(v, str) and bool(v), self.site)
        self.torch_device = pick_device(device)
        train["batch_size"] = batch_size_for(train, self.torch_device)  # subclasses read it from the preset

    def _cap_batch(self) -> str:
        """Cap ``train.batch_size`` at ``train.max_batch_fraction`` of this site's training cases (issue 31: a small site
        takes several steps an epoch); returns the note for the start-up line ("" when the cap does not bind)."""
        train, n = self.cfg["train"], len(self.data.train)
        fraction = train.get("max_batch_fraction", 1.0)
        wanted = train["batch_size"]
        train["batch_size"] = capped_batch_size(wanted, n, fraction)
        if train["batch_size"] == wanted:
            return ""
        return f" (preset {wanted}, capped at train.max_batch_fraction {fraction} of its {n} training cases)"

    def log_steps(self, fl_ctx: FLContext, rnd: int, steps: int, detail: str = "") -> None:
        """One round's optimisation steps on the record, the same way at every algorithm's site: the ``train/steps``
        scalar, the line ``round r: N local steps[, detail]`` and, when ``steps`` is below ``train.warn_steps``, one
        warning line naming the site, the steps and the knob to raise (:func:`medflare.common.training.short_round`)."""
        self.tracker.scalars(fl_ctx, {"train/steps": float(steps)}, rnd)
        self.log_info(fl_ctx, f"round {rnd}: {steps} local steps" + (f", {detail}" if detail else ""))
        warning = short_round(self.site, steps, self.cfg["train"])
        if warning:
            self.log_warning(fl_ctx, warning)

    def setup(self, fl_ctx: FLContext) -> None:
        """Build models and optimisers once the site's data is known (called at START_RUN)."""

    def new_model(self) -> torch.nn.Module:
        """A fresh network of the preset's architecture on this executor's device."""
        return build_from_spec(self.cfg["model"]).to(self.torch_device)

    # ---- task dispatch -----------------------------------------------------------------------
    def execute(self, task_name: str, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        handler = self._handlers.get(task_name)
        if handler is None:
            cause = f"site '{self.site}': unknown task '{task_name}' (known: {sorted(self._handlers)})"
            self.log_error(fl_ctx, cause)
            return error_reply(ReturnCode.TASK_UNKNOWN, cause)
        if self.data is None:
            return error_reply(ReturnCode.EXECUTION_EXCEPTION, self._start_error or f"site '{self.site}': not started")
        self._validate_s = 0.0
        tic = time.perf_counter()
        try:
            reply = handler(shareable, fl_ctx, abort_signal)
        except MedflareError as e:  # a bad file (also one that went bad since the last round) fails this task only
            cause = f"site '{self.site}', task '{task_name}': {one_line(e)}"
            self.log_error(fl_ctx, cause)
            return error_reply(ReturnCode.EXECUTION_EXCEPTION, cause)
        task_s, rnd = time.perf_counter() - tic, shareable.get_header(AppConstants.CURRENT_ROUND)
        step = int(rnd) if rnd is not None else 0
        self.tracker.scalars(fl_ctx, {"time/task_s": task_s, "time/validate_s": self._validate_s}, step)
        self.log_info(fl_ctx, f"site '{self.site}' task '{task_name}' round {rnd}: compute {task_s:.3f} s "
                              f"(validate {self._validate_s:.3f} s, train and rest {task_s - self._validate_s:.3f} s)")
        return reply

    # ---- evaluation and tracking -------------------------------------------------------------
    def loader(self, split: str, shuffle: bool = False, round_num: int = 0):
        """DataLoader over this site's ``split`` (shuffle seeded per round) with this process's loader workers.

        Shuffled loaders (training) use ``train.batch_size``; the others (inference: validation, statistics)
        ``eval.batch_size`` when > 0, which changes no result, only how many cases go through at once.
        Whole-volume splits (validation and testing of 3D presets: volumes differ in size) come one volume a batch.
        """
        dataset = getattr(self.data, split)
        batch = self.cfg["train"]["batch_size"] if shuffle else (self.cfg["eval"]["batch_size"] or self.cfg["train"]["batch_size"])
        if split != "train" and self.data.spatial_dims == 3:
            batch = 1
        workers = self.compute.workers if self.compute is not None else self.cfg["train"]["num_workers"]
        return make_loader(dataset, batch, shuffle, seed=self.seed + round_num, num_workers=workers)

    def validate(
        self,
        model: torch.nn.Module | None,
        split: str = "val",
        predict=None,
        *,
        round_num: int | None = None,
        total_rounds: int | None = None,
        metrics: list[str] | None = None,
    ) -> dict[str, float]:
        """Mean metrics of ``model`` (or of ``predict``) on this site's ``split``, on this executor's device.

        ``metrics`` defaults to the preset's ``eval.metrics``. Given ``round_num``, costly metrics (HD95, VI,
        AJI, object Dice) are computed only every ``eval.costly_every`` rounds and in the last one
        (:func:`medflare.metrics.metrics_for_round`); without it, all of them. Volume presets are scored per
        volume (``SiteData.whole_volumes``): slice predictions stacked back into the volume, or sliding windows
        for 3D models; distances in mm. Class means leave out classes in no label of the
        split (:mod:`medflare.metrics.site_mean`), the rule of ``medflare evaluate``; foreground classes that no
        label of the split holds are logged once per split as a warning (the preset may have too many classes).
        """
        names = list(metrics or self.cfg["eval"]["metrics"])
        if round_num is not None:
            names = metrics_for_round(names, round_num, total_rounds, self.cfg["eval"]["costly_every"])
        tic = time.perf_counter()
        whole = self.data.whole_volumes
        if whole is None:
            loader = self.loader(split)
        else:
            loader, predict = whole.loader(split), whole.predictor(predict if predict is not None else model)
        result = evaluate(
            model,
            loader,
            task=self.data.task,
            num_classes=self.data.num_classes,
            metrics=names,
            device=self.torch_device,
            predict=predict,
        )
        self._validate_s += time.perf_counter() - tic
        warning = unseen_classes_warning(self.site, self.data.num_classes, result.get("unseen_classes", []),
                                         result["num_cases"], split)
        if warning and split not in self._warned_unseen:
            self._warned_unseen.add(split)
            self.logger.warning(warning)
        return result["mean"]

    def log_overlays(self, fl_ctx: FLContext, model: torch.nn.Module, tag: str, round_num: int, total_rounds: int | None) -> None:
        """Image | ground truth | prediction for the first validation cases, on the first, every Nth and last round."""
        last = total_rounds is not None and round_num >= total_rounds - 1
        if self.data.task != "segmentation" or not (round_num == 0 or last or round_num % max(1, self.overlay_every) == 0):
            return
        model.eval()
        whole = self.data.whole_volumes
        with torch.no_grad():
            for i in range(min(self.num_overlays, len(self.data.val))):
                item = self.data.val[i]
                if self.data.spatial_dims == 3:  # a whole volume: predicted by sliding windows, shown at its largest label slice
                    pred = whole.predictor(model)(item["image"][None].to(self.torch_device)).argmax(1).cpu()
                    k = int(item["label"].flatten(1, 2).sum((0, 1)).argmax())
                    item, pred = {"image": item["image"][..., k], "label": item["label"][..., k]}, pred[..., k]
                else:
                    pred = model(item["image"][None].to(self.torch_device)).argmax(1).cpu()
                self.tracker.image(fl_ctx, f"{tag}/case{i}", overlay_image(item["image"], item["label"], pred), round_num)


def peak_memory() -> str:
    """This process's peak resident memory (and peak GPU memory allocated by torch, when a GPU was used)."""
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux
    text = f"peak memory {peak_mb:.0f} MB"
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        text += f", peak GPU memory {torch.cuda.max_memory_allocated() / 2**20:.0f} MB"
    return text
