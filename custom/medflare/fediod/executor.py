"""FedIOD site: stage 1 (train or load the teacher, send label counts once) and stage 2 (answer windows).

Tasks (see :mod:`.protocol` for the payloads):

- ``fediod_teacher``: train T_k on the site's data to completion, or load it when the site already has it
  (:mod:`.teacher`; the site may pick its own architecture in ``local/medflare_site.json``), then send the
  per-class label counts and the training-set size (Eq. 2's pi_k, Eq. 8's label factor) and the teacher's
  accuracy/Dice on the site's own validation split.
- ``fediod_outputs``: teacher logits and discriminator factors on the window's generated inputs, or, if
  the window would take the site past its epsilon budget, a "stopped" reply saying so (the site then
  answers no further windows).
- ``fediod_gradients``: the per-input vector-Jacobian product of the window (clipped and noised as the
  site's own privacy settings say), then the discriminator's steps.
- ``fediod_validate``: score the student the server sends on the site's validation split (asked to calibrate: its key
  metric at each of the preset's decision offsets, :mod:`.calibration`).

Nothing else leaves the site: no weights (every reply is a COLLECTION of non-weight kinds, so the
``no_weights`` scope passes it), no image. The site logs its (epsilon, delta) after every window and
sends it to TensorBoard each round.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal
from nvflare.app_common.app_constant import AppConstants

from medflare import DataError, PayloadError
from medflare.common.component import keep_args
from medflare.common.payload import collection, load_numpy_state, unflatten
from medflare.common.site_executor import SiteExecutor, format_metrics
from medflare.fediod import protocol as P
from medflare.fediod.calibration import lower_background, offset_metric, scores_at_offsets, split_logits
from medflare.fediod.networks import data_shape, server_specs
from medflare.fediod.site_distill import label_counts, site_distiller
from medflare.fediod.config import FedIODConfig
from medflare.fediod.privacy import PrivacySettings, noised_counts
from medflare.fediod.teacher import checkpoint_file, load_teacher, save_teacher, teacher_settings, train_teacher, unlearnt_warning
from medflare.nets import build_from_spec
from medflare.nets.batchnorm import prior_layers


def _array(t: torch.Tensor, dtype=np.float32) -> np.ndarray:
    return t.detach().cpu().numpy().astype(dtype, copy=False)


class FedIODExecutor(SiteExecutor):
    """A FedIOD site. Args: those of :class:`medflare.common.site_executor.SiteExecutor` (preset, overrides,
    device, seed, num_overlays, overlay_every); the distillation settings come from the preset's ``fediod``
    section, the teacher choice and all privacy settings from the site's own ``local/medflare_site.json``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        keep_args(self)
        self.fcfg = FedIODConfig.from_preset(self.cfg)
        self.distiller = None
        self.teacher_model = None
        self.stopped = ""
        self.windows = 0
        for name, handler in ((P.TASK_TEACHER, self.teacher), (P.TASK_OUTPUTS, self.outputs), (P.TASK_GRADIENTS, self.gradients),
                              (P.TASK_VALIDATE, self.validate_student)):
            self.register_task(name, handler)

    def setup(self, fl_ctx: FLContext) -> None:
        self.privacy = PrivacySettings.from_site_config(self.site_config, self.site)
        task, channels, size, classes = data_shape(self.cfg, self.fcfg)
        own = self.data.train[0]["image"].shape
        if self.data.task != task or self.data.num_classes != classes or own[0] != channels or own[-1] != size:
            raise DataError(f"site '{self.site}': its data ({self.data.task}, {self.data.num_classes} classes, images {tuple(own)}) do not "
                            f"match the job's preset '{self.preset}' ({task}, {classes} classes, {channels}x{size}x{size})")
        scope = fl_ctx.get_prop(FLContextKey.EFFECTIVE_JOB_SCOPE_NAME) or "(none)"
        self.log_info(fl_ctx, f"site '{self.site}': FedIOD runs under privacy scope '{scope}' of its local/privacy.json")
        p = self.privacy
        if p.enabled:
            self.log_info(fl_ctx, f"site '{self.site}': DP on (from its local/medflare_site.json): noise multiplier {p.noise_multiplier}, "
                                  f"clip {p.clip_norm}, delta {p.delta}, epsilon budget {p.epsilon_budget}, protects {p.scope}")
        else:
            self.log_warning(fl_ctx, f"site '{self.site}': DP off (no 'privacy.fediod_noise_multiplier' in its local/medflare_site.json): "
                                     "input gradients leave unnoised" + (f", clipped to {p.clip_norm}" if p.clip_norm else ""))

    # ---- stage 1 -------------------------------------------------------------------------------
    def teacher(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        spec, train, folder, retrain = teacher_settings(self.site_config, self.cfg, self.site, self.data.num_classes,
                                                        self.data.in_channels, int(self.data.train[0]["image"].shape[-1]))
        path = checkpoint_file(folder, self.site, self.data.source, spec, train, self.seed)
        if path.is_file() and not retrain:
            self.teacher_model = load_teacher(path, spec, self.data.num_classes).to(self.torch_device)
            self.log_info(fl_ctx, f"site '{self.site}': loaded its teacher {spec['name']} from {path} (stage 1 not repeated)")
        else:
            self.log_info(fl_ctx, f"site '{self.site}': training its teacher {spec['name']} for {train['epochs']} epochs")
            self.teacher_model, loss = train_teacher(spec, train, self.data.train, self.data.task, self.torch_device, seed=self.seed,
                                                     should_stop=lambda: abort_signal.triggered)
            if abort_signal.triggered:
                return Shareable()
            save_teacher(path, self.teacher_model, spec, self.preset, self.overrides, self.site, train)
            self.log_info(fl_ctx, f"site '{self.site}': teacher trained (last epoch loss {loss:.4f}), saved at the site in {path}")
        metrics = {f"teacher_{k}": v for k, v in self.validate(self.teacher_model, "val").items()}
        self.log_info(fl_ctx, f"site '{self.site}': teacher on its own validation split: {format_metrics(metrics)}")
        counts = label_counts(self.data.train, self.data.task, self.data.num_classes)  # exact; what is sent is noised below
        if self.data.task == "classification":  # judged on its own training images: it cannot know classes it never saw
            fit = self.validate(self.teacher_model, "train", metrics=["accuracy"])["accuracy"]
            warning = unlearnt_warning(self.site, fit, counts)
            if warning:
                self.log_warning(fl_ctx, warning)
        self.tracker.scalars(fl_ctx, metrics, 0, prefix="stage1/")
        self.distiller = site_distiller(self.cfg, self.fcfg, self.site, self.teacher_model, self.data.train, self.privacy, self.seed, self.torch_device)
        if self.fcfg.lambda_bn and not prior_layers(self.teacher_model):
            self.log_warning(fl_ctx, f"site '{self.site}': 'fediod.lambda_bn' is set but its teacher has no BatchNorm layers with "
                                     "running statistics: its realism prior is 0")
        size = float(len(self.data.train))
        if self.privacy.enabled:  # the counts are a release of the site's data too: the same Gaussian mechanism, accounted
            per_record = float(self.data.train[0]["label"].numel())  # a label map moves its class counts by its pixels
            counts = noised_counts(counts, per_record, self.privacy.noise_multiplier, self.distiller.noise)
            size = float(noised_counts(torch.tensor([size]), 1.0, self.privacy.noise_multiplier, self.distiller.noise)[0])
            self.distiller.accountant.spend(self.privacy.noise_multiplier, steps=2)
            self.log_info(fl_ctx, f"site '{self.site}': label counts noised (noise multiplier {self.privacy.noise_multiplier}), "
                                  f"epsilon {self.distiller.epsilon():.4f}")
        with torch.no_grad():
            probe = self.teacher_model(self.data.train[0]["image"][None].to(self.torch_device))
        parts = {
            P.PART_COUNTS: DXO(DataKind.STATISTICS, {"counts": counts.numpy(), "size": np.array([max(size, 1.0)])}),
            P.PART_TEACHER: DXO(DataKind.METRICS, {**metrics, "num_outputs": int(probe.shape[1])}),
        }
        return collection(parts, {P.STATUS: "ok"}).to_shareable()

    # ---- stage 2 -------------------------------------------------------------------------------
    def _privacy_part(self) -> DXO:
        p = self.privacy
        return DXO(DataKind.METRICS, {"epsilon": self.distiller.epsilon() if p.enabled else float("inf"), "delta": p.delta,
                                      "noise_multiplier": p.noise_multiplier, "clip_norm": p.clip_norm,
                                      "noised_outputs": float(p.noise_outputs), "windows": self.windows})

    def _need_distiller(self) -> None:
        if self.distiller is None:
            raise PayloadError(f"site '{self.site}': a stage-2 task arrived before its teacher task")

    def outputs(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        self._need_distiller()
        dxo = from_shareable(shareable)
        if dxo.data_kind != P.KIND_INPUTS:
            raise PayloadError(f"site '{self.site}': task '{P.TASK_OUTPUTS}' expects a {P.KIND_INPUTS} DXO, got {dxo.data_kind}")
        x = torch.as_tensor(dxo.data["x"])
        y = torch.as_tensor(dxo.data["y"]).long() if "y" in dxo.data else None
        if x.shape[2:] != self.data.train[0]["image"].shape:
            raise PayloadError(f"site '{self.site}': generated inputs of shape {tuple(x.shape[2:])} do not match its images "
                               f"{tuple(self.data.train[0]['image'].shape)}")
        meta = {P.WINDOW: dxo.get_meta_prop(P.WINDOW)}
        if not self.stopped:
            ok, eps = self.distiller.check_budget(int(x.shape[0] * x.shape[1]))
            if not ok:
                self.stopped = (f"epsilon budget {self.privacy.epsilon_budget} reached: spent {self.distiller.epsilon():.3f}, "
                                f"the next window would spend {eps:.3f} (delta {self.privacy.delta})")
                self.log_warning(fl_ctx, f"site '{self.site}' stops answering: {self.stopped}")
        if self.stopped:
            return collection({P.PART_PRIVACY: self._privacy_part()}, {**meta, P.STATUS: "stopped", P.REASON: self.stopped}).to_shareable()
        z, r = self.distiller.outputs(x.to(self.torch_device), y)
        parts = {P.PART_LOGITS: DXO(P.KIND_LOGITS, {"z": _array(z)}), P.PART_SCORES: DXO(P.KIND_SCORES, {"r": _array(r)}),
                 P.PART_PRIVACY: self._privacy_part()}
        return collection(parts, {**meta, P.STATUS: "ok"}).to_shareable()

    def gradients(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        self._need_distiller()
        dxo = from_shareable(shareable)
        if dxo.data_kind != P.KIND_OUTPUT_GRADIENTS:
            raise PayloadError(f"site '{self.site}': task '{P.TASK_GRADIENTS}' expects a {P.KIND_OUTPUT_GRADIENTS} DXO, got {dxo.data_kind}")
        prior_weight = float(np.asarray(dxo.data["prior_weight"]).reshape(-1)[0])
        adv_weight = torch.as_tensor(np.asarray(dxo.data["adv_weight"], dtype=np.float32))  # (1,) or per input (M, B)
        v = self.distiller.input_gradients(torch.as_tensor(dxo.data["g_z"]), torch.as_tensor(dxo.data["g_r"]), adv_weight, prior_weight)
        self.windows += 1
        eps = self.distiller.epsilon() if self.privacy.enabled else float("inf")
        scalars = {"privacy/epsilon": eps, "discriminator_loss": self.distiller.last_d_loss}
        prior = ""
        if prior_weight:
            scalars["teacher_bn_prior"] = self.distiller.last_prior
            prior = f", teacher BN prior {self.distiller.last_prior:.4f}"
        self.log_info(fl_ctx, f"site '{self.site}': window {self.windows}: epsilon {eps:.4f} (delta {self.privacy.delta}), "
                              f"discriminator loss {self.distiller.last_d_loss:.4f}{prior}")
        rnd = shareable.get_header(AppConstants.CURRENT_ROUND) or 0
        self.tracker.scalars(fl_ctx, scalars, self.windows)
        parts = {P.PART_GRADIENTS: DXO(P.KIND_INPUT_GRADIENTS, {"v": _array(v)}), P.PART_PRIVACY: self._privacy_part()}
        return collection(parts, {P.WINDOW: dxo.get_meta_prop(P.WINDOW), P.STATUS: "ok", "round": rnd}).to_shareable()

    def validate_student(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        dxo = from_shareable(shareable)
        student_spec, _ = server_specs(self.cfg, self.fcfg)
        student = build_from_spec(student_spec).to(self.torch_device)
        load_numpy_state(student, unflatten(dxo.data)["student"], who="server (student)")
        rnd = int(shareable.get_header(AppConstants.CURRENT_ROUND) or 0)
        if dxo.get_meta_prop(P.CALIBRATE):
            return self._calibration_scores(student, rnd, fl_ctx)
        metrics = {f"val_{k}": v for k, v in self.validate(student, "val").items()}
        self.tracker.scalars(fl_ctx, {"student/" + k: v for k, v in metrics.items()}, rnd)
        self.log_overlays(fl_ctx, student, "val_student", rnd, shareable.get_header(AppConstants.NUM_ROUNDS))
        self.log_info(fl_ctx, f"round {rnd}: student on '{self.site}': {format_metrics(metrics)}")
        reply = collection({P.PART_METRICS: DXO(DataKind.METRICS, metrics)}, {P.STATUS: "ok"})
        return reply.to_shareable()

    def _calibration_scores(self, student: torch.nn.Module, rnd: int, fl_ctx: FLContext) -> Shareable:
        """The student's key metric on the validation split with its background logit lowered by each decision offset:
        one forward pass, the offsets applied to its logits; whole volumes (predicted and stitched into label maps by
        the volume path) one validation per offset."""
        key, offsets = self.cfg["eval"]["key_metric"], self.fcfg.calibrate_offsets
        student.eval()
        if self.data.whole_volumes is None:
            tic = time.perf_counter()
            by_offset = scores_at_offsets(split_logits(student, self.loader("val"), self.torch_device), offsets, key,
                                          self.data.num_classes)
            self._validate_s += time.perf_counter() - tic
        else:
            by_offset = {d: self.validate(None, "val", predict=lambda x, d=d: lower_background(student(x), d), metrics=[key])[key]
                         for d in offsets}
        scores = {offset_metric(key, d): v for d, v in by_offset.items()}
        self.log_info(fl_ctx, f"round {rnd}: student on '{self.site}' at each decision offset: {format_metrics(scores)}")
        return collection({P.PART_METRICS: DXO(DataKind.METRICS, scores)}, {P.STATUS: "ok"}).to_shareable()
