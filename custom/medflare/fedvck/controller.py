"""FedVCK server workflow: collect the sites' condensed sets and prototypes, train the global model on them.

Each round t: send every site the global model M_t (all at once, each its own task); each site scores it,
condenses its data and replies with a condensed set, logit prototypes and class counts (:mod:`.protocol`).
The server checks every reply, keeps the condensed sets of the last ``keep_rounds`` rounds, and (between
FLARE's BEFORE_/AFTER_AGGREGATION events) updates the global model (:mod:`.update`): global logit prototypes
(Eq. 12), hard negatives (Eq. 13), feature prototypes of the earlier condensed sets (Eq. 14), then SGD on
L_ce + beta L_rc (Eq. 15-16). After the last round a ``validate`` task scores the final model at every site.

Persistence: the persistor component (``persistor_id``, a :class:`~medflare.fedvck.persistor.FedVCKPersistor`)
writes the global model after every round (``FL_global_model.pt``) and, when the sites' pooled validation accuracy
of the model they were sent is the best so far, ``best_FL_global_model.pt`` (FLARE's GLOBAL_BEST_MODEL_AVAILABLE,
as IntimeModelSelector fires it); the controller hands it the last global model, the projector and the kept
condensed sets, which it writes as ``FedVCK_result.pt`` (kind in :mod:`.results`). TensorBoard (server folder): accuracy per site, the update's loss
terms, upload bytes per site and round, and a grid of the received condensed images per class.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

import numpy as np
import torch
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

from medflare import ConfigError
from medflare.common.component import keep_args
from medflare.common.payload import load_numpy_state, nbytes, payload_bytes, state_to_numpy
from medflare.common.tracking import SERVER_EVENT_TYPE, SiteTracker
from medflare.common.training import pick_device
from medflare.common.workflow import SiteRounds
from medflare.fedvck import protocol as P
from medflare.fedvck.augment import DiffAugment
from medflare.fedvck.condense import quantize
from medflare.fedvck.config import FedVCKConfig
from medflare.fedvck.contrastive import Projector
from medflare.fedvck.executor import check_encoder
from medflare.fedvck.persistor import FedVCKPersistor
from medflare.fedvck.prototypes import aggregate_prototypes
from medflare.fedvck.protocol import SiteUpload, unpack_reply
from medflare.fedvck.update import embed, kept_images, relation_for_round, train_global
from medflare.metrics.visualize import image_grid
from medflare.nets import build_from_spec
from medflare.presets import get_preset


class FedVCKController(SiteRounds):
    """FedVCK (Yan et al., AAAI 2025): sites send condensed knowledge, the server trains the global model on it.

    Args:
        num_rounds: communication rounds (paper's limited budget: 10). Default 10.
        preset / overrides / seed: network and FedVCK settings (the preset's ``fedvck`` section), as the sites'
            executors (checked equal at START_RUN, medflare.common.preset_check). Defaults "fedvck_synthetic", none, 0.
        device: where the server trains: "auto" (GPU when present), "cpu", "cuda:N". Default "auto".
        images_per_class: condensed images per class shown in each round's TensorBoard grid (0 = none). Default 32.
        condense_task / validate_task: task names. Defaults "condense", "validate".
        persistor_id: the :class:`~medflare.fedvck.persistor.FedVCKPersistor` (initial model, last and best global model,
            ``FedVCK_result.pt``). Default "persistor".
        min_responses, task_timeout, task_check_period: see :class:`medflare.common.workflow.SiteRounds`.
    """

    def __init__(
        self,
        num_rounds: int = 10,
        preset: str = "fedvck_synthetic",
        overrides: Mapping[str, Any] | None = None,
        seed: int = 0,
        device: str = "auto",
        images_per_class: int = 32,
        condense_task: str = P.TASK_CONDENSE,
        validate_task: str = P.TASK_VALIDATE,
        persistor_id: str = "persistor",
        min_responses: int = 0,
        task_timeout: int = 3600,
        task_check_period: float = 0.2,
    ):
        super().__init__(num_rounds=num_rounds, persistor_id=persistor_id, min_responses=min_responses,
                         task_timeout=task_timeout, task_check_period=task_check_period)
        keep_args(self, preset=preset, overrides=overrides or {}, seed=seed, device=device, images_per_class=images_per_class,
                  condense_task=condense_task, validate_task=validate_task)
        self.cfg = get_preset(preset, overrides)
        self.fv = FedVCKConfig.from_preset(self.cfg)  # a bad kernel or p% fails when the job is built, naming the key

    # ---- state -------------------------------------------------------------------------------
    def _init_state(self) -> None:
        if not isinstance(self.persistor, FedVCKPersistor):
            raise ConfigError(f"FedVCKController: persistor_id '{self.persistor_id}' must name a "
                              f"medflare.fedvck.persistor.FedVCKPersistor (it writes FedVCK_result.pt), got "
                              f"{type(self.persistor).__name__}")
        self.site_names = self.sites()
        self.torch_device = pick_device(self.device)
        self.model = build_from_spec(self.cfg["model"])
        classifier = getattr(self.model, "classifier", None)
        self.num_classes = int(getattr(classifier, "out_features", 0))
        check_encoder(self.model, self.cfg["data"].get("num_classes") or self.num_classes, self.preset)
        start = self.load_model()  # the persistor's initial model (the preset's network from the seed)
        load_numpy_state(self.model, {k: np.asarray(v) for k, v in start.params.items()}, who="the persistor")
        self.model.to(self.torch_device)
        self.projector: Projector | None = None
        self.kept: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]] = {}  # round -> site -> (uint8 images, labels)
        self.generator = torch.Generator().manual_seed(self.seed)
        self.augment = DiffAugment(self.fv.server_augment)
        self.tracker = SiteTracker(self, event_type=SERVER_EVENT_TYPE)
        self.image_shape: tuple[int, ...] | None = None

    def _global(self, rnd: int) -> FLModel:
        return FLModel(params_type=ParamsType.FULL, params=state_to_numpy(self.model), current_round=rnd, total_rounds=self.num_rounds)

    # ---- one round ---------------------------------------------------------------------------
    def _uploads(self, results: Mapping[str, FLModel], rnd: int) -> dict[str, SiteUpload]:
        uploads = {}
        for site, res in sorted(results.items()):
            up = unpack_reply(res.params, site, self.num_classes, self.image_shape)
            if len(up.labels):
                self.image_shape = self.image_shape or tuple(up.images.shape[1:])
            uploads[site] = up
            sizes = {name: payload_bytes(part) for name, part in res.params.items()}
            self.tracker.scalars(self.fl_ctx, {f"upload_bytes/{site}": sum(sizes.values()), f"upload_images/{site}": len(up.labels),
                                               f"accuracy/{site}": up.metrics.get("accuracy", float("nan"))}, rnd)
            self.info(f"round {rnd}: {site} sent {len(up.labels)} condensed images, bytes per part {sizes}"
                      + (f", filters {up.filters}" if up.filters else ""))
        return uploads

    def _score(self, per_site: Mapping[str, Mapping[str, float]], rnd: int, prefix: str = "") -> float:
        """Pooled accuracy over the sites' validation cases of the model they were sent; announce it if the best."""
        cases = {s: m.get("val_cases", 0.0) for s, m in per_site.items()}
        total = sum(cases.values())
        pooled = sum(m.get("accuracy", 0.0) * cases[s] for s, m in per_site.items()) / total if total else float("nan")
        self.tracker.scalars(self.fl_ctx, {f"{prefix}val_accuracy_pooled": pooled}, rnd)
        self.info(f"round {rnd}: pooled validation accuracy of the model the sites received {pooled:.4f}")
        if self.offer_best(pooled):  # the persistor saves the published GLOBAL_MODEL as best_FL_global_model.pt
            self.info(f"round {rnd}: new best global model (pooled validation accuracy {pooled:.4f})")
        return pooled

    def _update(self, uploads: Mapping[str, SiteUpload], rnd: int) -> FLModel:
        """Eq. 12-16 on the kept condensed sets; returns the new global model."""
        fv = self.fv
        self.kept[rnd] = {s: (quantize(u.images), u.labels.numpy()) for s, u in uploads.items()}
        if fv.keep_rounds:
            for r in sorted(self.kept)[:-fv.keep_rounds]:
                del self.kept[r]
        rounds = {r: [(torch.from_numpy(x).float() / 255.0, torch.from_numpy(y)) for x, y in per_site.values()] for r, per_site in self.kept.items()}
        images, labels = kept_images(rounds, 0)
        if not len(labels):
            self.warning(f"round {rnd}: no site sent condensed images; the global model stays as it is")
            return self._global(rnd + 1)
        tic = time.perf_counter()
        protos, counts = aggregate_prototypes([u.logits for u in uploads.values()], [u.counts for u in uploads.values()])
        earlier, earlier_labels = kept_images(rounds, 0, before=rnd)
        if self.projector is None:
            dim = int(embed(self.model, images[:2], self.torch_device).shape[1])
            self.projector = Projector(dim, fv.projector_dim).to(self.torch_device)
        feat_protos, relation, negs = relation_for_round(self.model, earlier, earlier_labels, protos, counts, self.num_classes,
                                                         fv.top_k, self.torch_device)
        stats = train_global(
            self.model, self.projector, images, labels, steps=fv.update_steps(len(labels)), batch_size=fv.server_batch, lr=fv.server_lr,
            momentum=fv.server_momentum, weight_decay=fv.server_weight_decay, contrastive_weight=fv.contrastive_weight,
            temperature=fv.temperature, protos=feat_protos, relation=relation, augment=self.augment, generator=self.generator,
            device=self.torch_device, should_stop=lambda: self.abort_signal.triggered,
        )
        seconds = time.perf_counter() - tic
        self.tracker.scalars(self.fl_ctx, {"update/loss_ce": stats.ce, "update/loss_rc": stats.rc, "update/loss_total": stats.total,
                                           "update/images": float(len(labels)), "time/update_s": seconds,
                                           "train/steps": float(stats.steps)}, rnd)
        self.info(f"round {rnd}: global update on {len(labels)} condensed images ({len(self.kept)} rounds kept), {stats.steps} steps "
                  f"in {seconds:.1f} s: L_ce {stats.ce:.4f}, L_rc {stats.rc:.4f}; hard negatives {negs}")
        self._images(rnd)
        return self._global(rnd + 1)

    def _images(self, rnd: int) -> None:
        """A grid of this round's condensed images per class in TensorBoard."""
        if not self.images_per_class:
            return
        received = [(x, y) for x, y in self.kept.get(rnd, {}).values() if len(y)]
        if not received:
            return
        x, y = np.concatenate([r[0] for r in received]), np.concatenate([r[1] for r in received])
        for c in np.unique(y):
            self.tracker.image(self.fl_ctx, f"condensed/class_{int(c)}", image_grid(x[y == c][: self.images_per_class]), rnd)

    def _save(self, rnd: int, metrics: Mapping[str, float]) -> None:
        """``FedVCK_result.pt`` through the persistor (the only writer of the file)."""
        self.persistor.save_result(global_state=state_to_numpy(self.model), projector=self.projector, condensed=self.kept,
                                   sites=self.site_names, round_num=rnd, metrics=metrics)

    def run(self) -> None:
        self._init_state()
        self.info(f"FedVCK: sites {self.site_names}, {self.num_rounds} rounds, settings {self.fv.as_dict()}; "
                  f"the global model is {nbytes(state_to_numpy(self.model))} B (what FedAvg uploads per site per round)")
        for rnd in range(self.num_rounds):
            sent = self._global(rnd)
            self.start_round(rnd, self.num_rounds, validated=sent)
            results = self.exchange(self.condense_task, {s: sent for s in self.site_names}, rnd)
            if not results:
                return
            uploads = self._uploads(results, rnd)
            self._score({s: u.metrics for s, u in uploads.items()}, rnd)
            new = self.aggregate(results, lambda res: self._update(uploads, rnd))
            self.save_model(new)
            self._save(rnd + 1, {})
            self.report_round(rnd, self.num_rounds + 1, "accuracy", {s: u.metrics for s, u in uploads.items()})
        final = self._global(self.num_rounds)
        self.summary.start()  # the final model's validation: the summary's last line
        self.publish(final)
        results = self.exchange(self.validate_task, {s: final for s in self.site_names}, self.num_rounds)
        if not results:
            return
        metrics = {s: (r.metrics or {}) for s, r in results.items()}
        for site, m in metrics.items():
            self.tracker.scalars(self.fl_ctx, {f"final/{k}/{site}": v for k, v in m.items()}, self.num_rounds)
        pooled = self._score(metrics, self.num_rounds, prefix="final/")
        cases = sum(m.get("test_cases", 0.0) for m in metrics.values())
        test = sum(m.get("test_accuracy", 0.0) * m.get("test_cases", 0.0) for m in metrics.values()) / cases if cases else float("nan")
        self.tracker.scalars(self.fl_ctx, {"final/test_accuracy_pooled": test}, self.num_rounds)
        self._save(self.num_rounds, {"val_accuracy_pooled": pooled, "test_accuracy_pooled": test})
        self.report_round(self.num_rounds, self.num_rounds + 1, "accuracy", metrics, also=("test_accuracy",))
        self.info(f"FedVCK finished: pooled test accuracy {test:.4f}; results in {self.get_app_dir()}")
