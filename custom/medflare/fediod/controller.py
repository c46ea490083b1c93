"""FedIOD server workflow: stage 1 (each site trains its teacher, sends label counts once), then stage 2 rounds of
windows in which G and S learn from the sites' teachers through the messages of :mod:`.protocol`.

The federated protocol (derivation in :mod:`.distill`): per window of M steps

1. ``fediod_outputs``: the server generates the window's M x B inputs with G and sends them (and, for
   segmentation, the label maps that conditioned them) to every active site; each site returns its teacher
   logits and discriminator factors on them (or says it stopped, when its epsilon budget would be exceeded).
2. The server combines them (Eq. 2-10), takes the student's M steps, and computes, for each site, the
   gradient of the generator loss with respect to that site's outputs.
3. ``fediod_gradients``: each site returns the per-input vector-Jacobian product through its teacher and
   discriminator (clipped and noised as the site's own privacy settings say) and trains its discriminator.
4. The server adds them to its own term and takes G's M steps.

Why windows: a FLARE task round trip costs about 0.5 s here (benchmarks/RESULTS.md), and a step needs two
of them, while a step's compute is a fraction of that on small networks. Tasks (not aux messages) carry
every message so that a site's privacy scope filters all of it; grouping M steps per pair of tasks
divides the messaging cost per step by M, at the price of G's gradients being up to M-1 steps stale
(``fediod.steps_per_window``; M = 1 is Algorithm 1 exactly). benchmarks/fediod_benchmark.py measures the
(federated step) / (same step in one process) ratio.

Every round: the student and generator are saved through the persistor (``FedIOD_student.pt``, kind
``fediod_student``, with every site's (epsilon, delta) and stop reason), the sites score the student on
their validation split every ``validate_every`` rounds (the best mean is saved as ``best_FedIOD_student.pt``
through FLARE's GLOBAL_BEST_MODEL_AVAILABLE event, as IntimeModelSelector does; segmentation with
``calibrate_offsets``: the sites first score the student at each decision offset, and the student saved and validated
carries the best one, :mod:`.calibration`), generated samples go to
TensorBoard (``tb_events/server``). The distillation ends early, cleanly and saved, when fewer than
``min_responses`` sites (0 = all) still answer.
"""

from __future__ import annotations

import os
import time
from typing import Any, Mapping

import numpy as np
import torch
from nvflare.apis.dxo import DXO, DataKind
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.apis.fl_constant import FLContextKey

from medflare import PayloadError
from medflare.common.component import keep_args
from medflare.common.payload import check_finite, flatten, load_numpy_state, state_to_numpy
from medflare.common.tracking import SERVER_EVENT_TYPE, SiteTracker
from medflare.common.training import pick_device
from medflare.checks import check_int
from medflare.common.workflow import SiteRounds
from medflare.fediod import protocol as P
from medflare.fediod.calibration import best_offset, check_offsets, fold_offset, offset_means, output_bias
from medflare.fediod.networks import data_shape, server_networks
from medflare.fediod.config import FedIODConfig
from medflare.fediod.samples import sample_grid
from medflare.fediod.distill import Distiller, SiteInfo, steps_total
from medflare.presets import get_preset


def _weights(c: float | torch.Tensor) -> np.ndarray:
    """A site's GAN weight as sent: ``(1,)``, or ``(M, B)`` per input (styled generator)."""
    return c.detach().cpu().numpy().astype(np.float32) if isinstance(c, torch.Tensor) else np.array([c], dtype=np.float32)


class FedIODController(SiteRounds):
    """FedIOD (Gong et al. 2024), server side. See the module docstring for the protocol.

    Args:
        num_rounds: distillation rounds (the paper's epochs: each is ``fediod.windows_per_round`` windows of
            ``fediod.steps_per_window`` steps). Default 10.
        preset / overrides / seed: data, student and distillation settings (the ``fediod`` section,
            :class:`medflare.fediod.config.FedIODConfig`); the same as the sites', checked at START_RUN
            (:mod:`medflare.common.preset_check`). Defaults "fediod_cls", none, 0.
        validate_every: rounds between student validations at the sites (the final student is always scored;
            0 = only the final one). Default 1.
        num_samples: generated samples shown in TensorBoard each round. Default 16.
        gradient_trace: save the first window's inputs and G gradients as ``fediod_gradient_trace.pt``
            (tests compare them with a single-process computation). Default false.
        device: "auto" | "cpu" | "cuda:N" for G and S. Default "auto".
        persistor_id: the persistor component (:class:`medflare.fediod.persistor.FedIODPersistor`). Default "persistor".
        min_responses: fewest sites that must still answer to go on (0 = all); a site that stops (epsilon
            budget) or does not answer below that ends the distillation, saved. Default 0.
        task_timeout, task_check_period: see :class:`medflare.common.workflow.SiteRounds`. Defaults 3600, 0.1.
    """

    def __init__(
        self,
        num_rounds: int = 10,
        preset: str = "fediod_cls",
        overrides: Mapping[str, Any] | None = None,
        seed: int = 0,
        validate_every: int = 1,
        num_samples: int = 16,
        gradient_trace: bool = False,
        device: str = "auto",
        persistor_id: str = "persistor",
        min_responses: int = 0,
        task_timeout: int = 3600,
        task_check_period: float = 0.1,
    ):
        super().__init__(num_rounds=num_rounds, persistor_id=persistor_id, min_responses=min_responses,
                         task_timeout=task_timeout, task_check_period=task_check_period)
        keep_args(self, preset=preset, overrides=overrides or {}, seed=seed, validate_every=validate_every,
                  num_samples=num_samples, gradient_trace=gradient_trace, device=device)
        check_int("FedIODController", "validate_every", validate_every, 0)
        check_int("FedIODController", "num_samples", num_samples, 0)
        self.cfg = get_preset(preset, overrides)
        self.fcfg = FedIODConfig.from_preset(self.cfg)
        self.task, _, _, self.num_classes = data_shape(self.cfg, self.fcfg)
        check_offsets(self.fcfg.calibrate_offsets, self.task)

    # ---- set-up ------------------------------------------------------------------------------
    def _auxiliary_labels(self) -> torch.Tensor | None:
        """Segmentation: the server's own label maps that condition G (never a site's)."""
        if self.task != "segmentation":
            return None
        from medflare.data import load_site

        workspace = self.fl_ctx.get_prop(FLContextKey.WORKSPACE_OBJECT)
        local_dir = workspace.get_site_config_dir() if workspace is not None else None
        source = load_site(self.fcfg.label_source, self.cfg["data"], local_dir=local_dir)
        labels = torch.stack([source.train[i]["label"] for i in range(len(source.train))]).long()
        self.info(f"generator conditioned on {len(labels)} auxiliary label maps of '{self.fcfg.label_source}' ({source.source})")
        return labels

    def _init(self) -> None:
        self.torch_device = pick_device(self.device)
        self.tracker = SiteTracker(self, event_type=SERVER_EVENT_TYPE)
        self.nets = server_networks(self.cfg, self.fcfg, self.seed)
        initial = self.load_model()
        if initial is None:
            raise PayloadError("the persistor returned no initial student + generator")
        if initial.params:
            load_numpy_state(self.nets, initial.params, who=f"persistor '{self.persistor_id}'")
        self.distiller = Distiller(self.nets.generator, self.nets.student, self.fcfg, self.task, self.num_classes,
                                   total_steps=steps_total(self.num_rounds, self.fcfg), label_maps=self._auxiliary_labels(),
                                   device=self.torch_device, seed=self.seed, log=self.warning)
        self._steps_logged = 0  # the distiller's generator steps at the last round's log line
        self.offset = 0.0  # the decision offset of the saved student (medflare.fediod.calibration)
        self.output_bias = ""
        if self.fcfg.calibrate_offsets:  # checked before any site works: the student must have a per-class output bias
            with torch.no_grad():
                example = self.distiller.preview(2, self.seed).inputs()[0]
            self.output_bias = output_bias(self.nets.student, example)
        self.privacy: dict[str, dict] = {}
        self.stopped: dict[str, str] = {}
        self.teachers: dict[str, dict] = {}
        self.window = 0
        self.rnd = 0
        self._scores: dict[str, dict] = {}  # the sites' validation of the student in this round (for its summary line)
        self.ended = ""

    def _need(self) -> int:
        return self.min_responses or len(self.registered)

    # ---- stage 1 -----------------------------------------------------------------------------
    def _stage1(self) -> bool:
        names = self.sites()
        request = {s: FLModel(params=DXO(P.KIND_REQUEST, {}), current_round=0, total_rounds=self.num_rounds) for s in names}
        results = self.exchange(P.TASK_TEACHER, request, 0)
        if not results:
            return False
        infos = {}
        for site, res in results.items():
            parts = res.params or {}
            if P.PART_COUNTS not in parts or P.PART_TEACHER not in parts:
                raise PayloadError(f"site '{site}' answered the teacher task without '{P.PART_COUNTS}' and '{P.PART_TEACHER}'")
            teacher = dict(parts[P.PART_TEACHER].data)
            if int(teacher.get("num_outputs", -1)) != self.num_classes:
                raise PayloadError(f"site '{site}': its teacher predicts {teacher.get('num_outputs')} classes, the student "
                                   f"{self.num_classes} (preset data.num_classes): the sites' tasks differ")
            counts = np.asarray(parts[P.PART_COUNTS].data["counts"], dtype=np.float64)
            infos[site] = SiteInfo(torch.as_tensor(counts), int(np.asarray(parts[P.PART_COUNTS].data["size"]).reshape(-1)[0]))
            self.teachers[site] = teacher
            self.info(f"stage 1: site '{site}' teacher ready ({len(counts)} classes, {infos[site].size} training cases, "
                      f"classes held {[c for c in range(len(counts)) if counts[c] > 0]}); own validation "
                      + ", ".join(f"{k}={v:.4f}" for k, v in teacher.items() if k != "num_outputs"))
        self.distiller.set_sites(infos)
        self.registered = sorted(infos)
        self.active = list(self.registered)
        return True

    # ---- the Federation the Distiller talks to -------------------------------------------------
    def _model(self, data: DXO) -> FLModel:
        data.set_meta_prop(P.WINDOW, self.window)
        return FLModel(params=data, current_round=self.rnd, total_rounds=self.num_rounds)

    def _drop(self, site: str, why: str) -> None:
        if site in self.active:
            self.active.remove(site)
            self.stopped[site] = why
            self.warning(f"round {self.rnd} window {self.window}: site '{site}' no longer takes part: {why}")
        if len(self.active) < self._need() and not self.ended:
            self.ended = (f"{len(self.active)} of {len(self.registered)} sites still answer (min_responses="
                          f"{self.min_responses or 'all'}); stopped: {self.stopped}")

    def outputs(self, x: torch.Tensor, y: torch.Tensor | None):
        if self.ended:
            return {}, {}
        data = {"x": x.cpu().numpy().astype(np.float32)}
        if y is not None:
            data["y"] = y.cpu().numpy().astype(np.uint8 if self.num_classes < 256 else np.int64)
        payloads = {s: self._model(DXO(P.KIND_INPUTS, data)) for s in self.active}
        results = self.exchange(P.TASK_OUTPUTS, payloads, self.rnd, min_responses=min(self._need(), len(payloads)))
        out, stopped = {}, {}
        for s in list(payloads):
            res = results.get(s)
            if res is None:
                self._drop(s, f"no answer to '{P.TASK_OUTPUTS}' within {self.task_timeout} s")
                continue
            parts, meta = res.params or {}, res.meta or {}
            if P.PART_PRIVACY in parts:
                self.privacy[s] = dict(parts[P.PART_PRIVACY].data)
            if meta.get(P.STATUS) == "stopped":
                stopped[s] = str(meta.get(P.REASON, "stopped"))
                self._drop(s, stopped[s])
                continue
            if meta.get(P.WINDOW) != self.window or P.PART_LOGITS not in parts or P.PART_SCORES not in parts:
                raise PayloadError(f"site '{s}' answered window {meta.get(P.WINDOW)} (expected {self.window}) with parts {sorted(parts)}")
            out[s] = (torch.as_tensor(parts[P.PART_LOGITS].data["z"]), torch.as_tensor(parts[P.PART_SCORES].data["r"]))
        if self.ended:
            return {}, stopped
        return out, stopped

    def input_gradients(self, requests):
        payloads = {s: self._model(DXO(P.KIND_OUTPUT_GRADIENTS, {"g_z": g_z.cpu().numpy().astype(np.float32),
                                                                 "g_r": g_r.cpu().numpy().astype(np.float32),
                                                                 "adv_weight": _weights(c),
                                                                 "prior_weight": np.array([b], dtype=np.float32)}))
                    for s, (g_z, g_r, c, b) in requests.items()}
        results = self.exchange(P.TASK_GRADIENTS, payloads, self.rnd, min_responses=min(self._need(), len(payloads)))
        out = {}
        for s in payloads:
            res = results.get(s)
            if res is None:
                self._drop(s, f"no answer to '{P.TASK_GRADIENTS}' within {self.task_timeout} s")
                continue
            parts = res.params or {}
            if P.PART_PRIVACY in parts:
                self.privacy[s] = dict(parts[P.PART_PRIVACY].data)
            out[s] = torch.as_tensor(parts[P.PART_GRADIENTS].data["v"])
        return out

    def _trace(self, window, grads) -> None:
        if self.gradient_trace and self.window == 0:
            flat = [torch.cat([g.reshape(-1) for g in step if g is not None]).cpu() for step in grads]
            torch.save({"w": [w.cpu() for w in window.w], "x": window.inputs().cpu(), "grads": flat},
                       os.path.join(self.get_app_dir(), "fediod_gradient_trace.pt"))

    # ---- results -----------------------------------------------------------------------------
    def _result(self) -> FLModel:
        meta = {"fediod_round": self.rnd, "fediod_sites": list(self.registered), "fediod_privacy": self.privacy,
                "fediod_stopped": dict(self.stopped), "fediod_teachers": self.teachers, "fediod_steps": self.distiller.steps}
        params = state_to_numpy(self.nets)
        if self.offset:  # the saved (and validated) student carries the decision offset; the trained one does not
            params = fold_offset(params, f"student.{self.output_bias}", self.offset)
        meta["fediod_decision_offset"] = self.offset
        check_finite(params, "server")
        return FLModel(params_type=ParamsType.FULL, params=params, meta=meta)

    def _calibrate(self, rnd: int) -> None:
        """Segmentation with ``calibrate_offsets``: the sites score the student at each decision offset on their
        validation splits; the best mean becomes the offset of the student saved and validated this round."""
        if not self.fcfg.calibrate_offsets:
            return
        student = DXO(DataKind.WEIGHTS, flatten({"student": state_to_numpy(self.nets.student)}), meta={P.CALIBRATE: True})
        payloads = {s: FLModel(params=student, current_round=rnd, total_rounds=self.num_rounds) for s in self.active}
        results = self.exchange(P.TASK_VALIDATE, payloads, rnd, min_responses=min(self._need(), len(payloads)))
        key = self.cfg["eval"]["key_metric"]
        means = offset_means([dict(r.params[P.PART_METRICS].data) for r in results.values() if P.PART_METRICS in (r.params or {})],
                             key, self.fcfg.calibrate_offsets)
        self.offset = best_offset(means)
        if means:
            self.info(f"round {rnd}: decision offset {self.offset:g} on the background logit (mean val_{key} over sites per "
                      "offset: " + ", ".join(f"{d:g}: {v:.4f}" for d, v in means.items()) + ")")
        self.tracker.scalars(self.fl_ctx, {"student/decision_offset": self.offset}, rnd)
        if 0.0 in means:
            self.tracker.scalars(self.fl_ctx, {f"student/val_{key}_uncalibrated": means[0.0]}, rnd)

    def _validate(self, rnd: int, model: FLModel) -> None:
        """The sites score ``model``'s student (this round's :meth:`_result`: the student as saved)."""
        student = {k: v for k, v in model.params.items() if k.startswith("student.")}
        payloads = {s: FLModel(params_type=ParamsType.FULL, params=student, current_round=rnd, total_rounds=self.num_rounds)
                    for s in self.active}
        results = self.exchange(P.TASK_VALIDATE, payloads, rnd, min_responses=min(self._need(), len(payloads)))

        def mean_metrics(res: Mapping[str, FLModel]) -> dict[str, float]:
            per_site = [dict(r.params[P.PART_METRICS].data) for r in res.values() if P.PART_METRICS in (r.params or {})]
            names = sorted({k for m in per_site for k in m})
            return {k: float(np.mean([m[k] for m in per_site if k in m])) for k in names}

        self._scores = {s: dict(r.params[P.PART_METRICS].data) for s, r in results.items() if P.PART_METRICS in (r.params or {})}
        mean = self.aggregate(results, mean_metrics)
        self.info(f"round {rnd}: student, mean validation over sites: " + ", ".join(f"{k}={v:.4f}" for k, v in mean.items()))
        self.tracker.scalars(self.fl_ctx, {f"student/{k}": v for k, v in mean.items()}, rnd)
        key = f"val_{self.cfg['eval']['key_metric']}"
        if self.offer_best(mean.get(key, -np.inf)):
            self.info(f"round {rnd}: best student so far ({key} {self.best_value:.4f}) -> the persistor's best file")

    def _log_round(self, rnd: int, stats: Mapping[str, float], seconds: float) -> None:
        eps = {s: p.get("epsilon", float("inf")) for s, p in self.privacy.items()}
        # this round's optimisation steps on the record (issue 31): the generator's, and the student's (student_steps each)
        gen = self.distiller.steps - self._steps_logged
        self._steps_logged = self.distiller.steps
        student = gen * self.fcfg.student_steps
        self.tracker.scalars(self.fl_ctx, {"train/steps_generator": float(gen), "train/steps_student": float(student)}, rnd)
        self.info(f"round {rnd}: {gen} generator steps and {student} student steps ({self.distiller.steps} generator steps "
                  f"in all), {seconds:.1f} s; losses " + ", ".join(f"{k}={v:.4f}" for k, v in stats.items())
                  + "; epsilon per site " + ", ".join(f"{s}={e:.4g}" for s, e in sorted(eps.items())))
        self.tracker.scalars(self.fl_ctx, {f"loss/{k}": v for k, v in stats.items()}, rnd)
        self.tracker.scalars(self.fl_ctx, {f"privacy/epsilon_{s}": e for s, e in eps.items()}, rnd)
        if self.num_samples:
            with torch.no_grad():
                window = self.distiller.preview(self.num_samples, self.seed)
            labels = window.labels()[0] if window.y is not None else None
            self.tracker.image(self.fl_ctx, "generated/samples", sample_grid(window.inputs()[0], labels), rnd)

    def _report(self, rnd: int) -> None:
        """The round's summary line and federation curve: the student as the sites scored it at the round's start (the
        student that entered the round), and the round's time (validation and distillation)."""
        self.report_round(rnd, self.num_rounds + 1, f"val_{self.cfg['eval']['key_metric']}", self._scores)

    # ---- the workflow ------------------------------------------------------------------------
    def run(self) -> None:
        self._init()
        self.info(f"FedIOD: preset '{self.preset}', {self.num_rounds} rounds x {self.fcfg.windows_per_round} windows x "
                  f"{self.fcfg.steps_per_window} steps of {self.fcfg.batch_size} generated inputs")
        if not self._stage1():
            return
        self.info(f"stage 1 done: teachers of {self.registered}; stage 2 starts")
        for rnd in range(self.num_rounds + 1):
            self.rnd = rnd
            due = rnd == self.num_rounds or self.ended or (self.validate_every and rnd % self.validate_every == 0)
            self.start_round(rnd, self.num_rounds)
            if due and self.active:
                self._calibrate(rnd)
            model = self._result()
            self.publish(model)
            if rnd > 0:
                self.save_model(model)
            self._scores = {}
            if due and self.active:
                self._validate(rnd, model)
            if rnd == self.num_rounds or self.ended:
                self._report(rnd)
                break
            tic, totals = time.perf_counter(), {}
            for _ in range(self.fcfg.windows_per_round):
                req = self.distiller.run_window(self, on_gradients=self._trace)
                self.window += 1
                for k, v in req.stats.items():
                    totals[k] = totals.get(k, 0.0) + v / self.fcfg.windows_per_round
                if self.ended or self.abort_signal.triggered:
                    break
            if self.abort_signal.triggered:
                return
            self._log_round(rnd, totals, time.perf_counter() - tic)
            self._report(rnd)
        if self.ended:
            self.info(f"distillation ended early after round {self.rnd}: {self.ended}")
        self.info(f"FedIOD finished: student + generator in {self.get_app_dir()}")
