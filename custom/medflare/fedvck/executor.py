"""FedVCK client: score the received global model, condense the site's data into a small image set, send that.

Task "condense" (every round t): load the global model M_t from the task data; score it on the validation
split; compute its logits on every training image (one pass serves Eq. 7 and Eq. 11); weigh the images by
the self-ensemble error of M_t and M_{t-1} (Eq. 5-7; M_{t-1}'s logits are kept from the last round); run the round's
condensation steps on the warm-started condensed set (:func:`.condense.condense`); reply with one COLLECTION
(:mod:`.protocol`): the uint8 condensed set, the logit prototypes with class counts, the validation metrics.

Task "validate" (after the last round): score the final model on the validation and test splits; reply
with the metrics only.

What the site decides itself (``local/medflare_site.json``, section ``privacy``):
``fedvck_min_class_images`` (default 10): a class with fewer local training images is not condensed and
gets no prototype (count 0): a condensed image then summarises at least that many patients. Further
protection of what leaves (cap per class, noise, coarser quantisation) is the site's privacy scope with
:class:`medflare.fedvck.filters.CondensedSetFilter`.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from nvflare.apis.dxo import DXO, DataKind
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.utils.fl_model_utils import FLModelUtils

from medflare import ConfigError
from medflare.common.component import keep_args
from medflare.common.payload import load_numpy_state
from medflare.common.site_config import setting
from medflare.common.site_executor import SiteExecutor, format_metrics
from medflare.data.util import stable_seed
from medflare.fedvck import protocol as P
from medflare.fedvck.augment import DiffAugment
from medflare.fedvck.condense import CondensedSet, condense, condensed_sizes, predict_logits, stack_dataset
from medflare.fedvck.config import FedVCKConfig
from medflare.fedvck.importance import ImportanceSampler, ensemble_error, importance_weights
from medflare.fedvck.prototypes import logit_prototypes
from medflare.fedvck.protocol import pack_reply

MIN_CLASS_IMAGES = "fedvck_min_class_images"
DEFAULT_MIN_CLASS_IMAGES = 10


def check_encoder(model: torch.nn.Module, num_classes: int, preset: str) -> None:
    """FedVCK needs ``features()`` (the encoder psi) and a Linear ``classifier`` with one output per class."""
    classifier = getattr(model, "classifier", None)
    if not hasattr(model, "features") or not isinstance(classifier, torch.nn.Linear):
        raise ConfigError(f"preset '{preset}': FedVCK needs a model with features() and a Linear classifier "
                          f"(convnet, resnet8, resnet18), got {type(model).__name__}")
    if classifier.out_features != num_classes:
        raise ConfigError(f"preset '{preset}': the model has {classifier.out_features} outputs (config key 'model.args.num_classes') "
                          f"but the data has {num_classes} classes ('data.num_classes')")


class FedVCKExecutor(SiteExecutor):
    """FedVCK site: validation, importance weights, condensation, logit prototypes (see the module docstring).

    Args (besides :class:`medflare.common.site_executor.SiteExecutor`'s preset, overrides, device, seed,
    num_overlays, overlay_every): condense_task, validate_task: task names. Defaults "condense", "validate".
    The algorithm's settings are the preset's ``fedvck`` section (:class:`medflare.fedvck.config.FedVCKConfig`).
    The condensed set and the previous global model's logits stay in memory between rounds, so the simulator
    needs ``-t`` equal to ``-n``.
    """

    def __init__(self, *args, condense_task: str = P.TASK_CONDENSE, validate_task: str = P.TASK_VALIDATE, **kwargs):
        kwargs.setdefault("preset", "fedvck_synthetic")
        super().__init__(*args, **kwargs)
        keep_args(self, condense_task=condense_task, validate_task=validate_task)
        self.fv = FedVCKConfig.from_preset(self.cfg)  # a bad kernel or p% fails when the job is built, naming the key
        self.register_task(condense_task, self.condense)
        self.register_task(validate_task, self.score_only)
        self.cset: CondensedSet | None = None
        self.prev_logits: torch.Tensor | None = None

    def setup(self, fl_ctx: FLContext) -> None:
        if self.data.task != "classification":
            raise ConfigError(f"FedVCK condenses classification data; preset '{self.preset}' is {self.data.task}")
        self.model = self.new_model()
        check_encoder(self.model, self.data.num_classes, self.preset)
        self.real_images, self.real_labels = stack_dataset(self.data.train)
        min_images = setting(self.site_config, "privacy", MIN_CLASS_IMAGES, DEFAULT_MIN_CLASS_IMAGES,
                             check=lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, site=self.site)
        counts = {c: int((self.real_labels == c).sum()) for c in range(self.data.num_classes)}
        shared = {c: n for c, n in counts.items() if n >= min_images}
        held_back = {c: n for c, n in counts.items() if 0 < n < min_images}
        self.sizes = condensed_sizes(shared, self.fv.ipc_percent, self.fv.min_ipc)
        self.generator = torch.Generator().manual_seed(stable_seed("fedvck", self.seed, self.site))
        if self.sizes:
            x = self.real_images
            self.cset = CondensedSet(self.sizes, tuple(x.shape[1:]), float(x.mean()), float(x.std()), self.generator).to(self.torch_device)
        else:
            self.log_warning(fl_ctx, f"site '{self.site}': no class has {min_images} training images ({MIN_CLASS_IMAGES}); "
                                     "this site condenses nothing and sends empty sets")
        self.augment = DiffAugment(self.fv.augment)
        self.log_info(fl_ctx, f"site '{self.site}': classes {counts}; condensing {self.sizes} ({sum(self.sizes.values())} images, "
                              f"p={self.fv.ipc_percent}%, min {self.fv.min_ipc}/class)"
                              + (f"; held back (fewer than {min_images} images): {held_back}" if held_back else ""))

    # ---- tasks -------------------------------------------------------------------------------
    def _receive(self, shareable: Shareable):
        incoming = FLModelUtils.from_shareable(shareable)
        load_numpy_state(self.model, incoming.params, who="server (global model)")
        return incoming, int(incoming.current_round or 0)

    def _metrics(self, split: str, prefix: str = "") -> dict[str, float]:
        """The preset's metrics of the loaded model on ``split`` (names prefixed) and ``<split>_cases``."""
        metrics = {prefix + k: v for k, v in self.validate(self.model, split).items()}
        metrics[f"{split}_cases"] = float(len(getattr(self.data, split)))
        return metrics

    def condense(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        incoming, rnd = self._receive(shareable)
        tic = time.perf_counter()
        metrics = self._metrics("val")
        self.tracker.scalars(fl_ctx, metrics, rnd, prefix="val/")
        self.log_info(fl_ctx, f"round {rnd}: global model on '{self.site}' validation: {format_metrics(metrics)}")

        fv = self.fv
        logits_now = predict_logits(self.model, self.real_images, self.torch_device)
        # M_{t-1}'s logits on the same images are last round's M_t logits: kept instead of the model (round 0: M_{-1} = M_0)
        logits_prev = self.prev_logits if self.prev_logits is not None else logits_now
        self.prev_logits = logits_now
        scoring_s = time.perf_counter() - tic

        logs: dict[str, float] = {}
        tic = time.perf_counter()
        if self.cset is not None:
            err = ensemble_error(logits_now, logits_prev, self.real_labels, fv.alpha)
            weights = importance_weights(err, fv.b) if fv.importance else None
            sampler = ImportanceSampler(self.real_labels, weights)
            stats = condense(
                self.model, self.cset, self.real_images, self.real_labels, sampler,
                iterations=fv.iterations, real_batch=fv.real_batch, image_lr=fv.image_lr, image_momentum=fv.image_momentum,
                clip_norm=fv.clip_norm, kernel=fv.kernel, latent_constraints=fv.latent_constraints, augment=self.augment,
                generator=self.generator, device=self.torch_device, should_stop=lambda: abort_signal.triggered,
            )
            images, labels = self.cset.quantized()
            logs.update({"condense/loss_first": stats.first_loss, "condense/loss_last": stats.last_loss,
                         "condense/steps": stats.steps, "importance/err_mean": float(err.mean()),
                         "importance/w_mean": float(weights.mean()) if weights is not None else 1.0})
        else:
            images = np.zeros((0, *self.real_images.shape[1:]), np.uint8)
            labels = np.zeros(0, np.int64)
        condense_s = time.perf_counter() - tic
        protos, counts = logit_prototypes(logits_now, self.real_labels, self.data.num_classes, classes=list(self.sizes))
        logs.update({"time/condense_s": condense_s, "time/scoring_s": scoring_s, "upload/images": float(len(labels))})
        self.tracker.scalars(fl_ctx, logs, rnd)
        self.log_info(fl_ctx, f"round {rnd}: condensed {len(labels)} images in {condense_s:.1f} s "
                              f"(loss {logs.get('condense/loss_first', float('nan')):.4f} -> {logs.get('condense/loss_last', float('nan')):.4f}); "
                              f"scoring {scoring_s:.1f} s")
        reply = pack_reply(images, labels, protos.numpy(), counts.numpy(), metrics)
        return self._reply(reply, rnd)

    def score_only(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        incoming, rnd = self._receive(shareable)
        metrics = {**self._metrics("val"), **self._metrics("test", prefix="test_")}
        self.tracker.scalars(fl_ctx, metrics, rnd, prefix="final/")
        self.log_info(fl_ctx, f"final global model on '{self.site}': {format_metrics(metrics)}")
        return self._reply(DXO(DataKind.METRICS, data=metrics), rnd)

    @staticmethod
    def _reply(dxo: DXO, rnd: int) -> Shareable:
        shareable = dxo.to_shareable()
        shareable.set_header(AppConstants.CURRENT_ROUND, rnd)
        return shareable
