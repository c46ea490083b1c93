"""FedSM client: score what it received, send its selector statistics, train global and personalised models.

Task ``train``, main rounds (Algorithm 1, lines 6-13): the server sends the global model, this site's
personalised model and the selector (one WEIGHTS DXO, prefixes from :mod:`.protocol`). The site

1. scores them on its validation split in one pass (:mod:`.scoring`): global, personalised and
   super-model scores, site identification;
2. computes the Gaussian of the *received* global model's encoder features over its training cases, and
   the distances of its validation cases under it (:func:`medflare.fedsm.density.site_gaussian`), noised by
   its own setting ``privacy.fedsm_stats_noise`` in ``local/medflare_site.json``;
3. trains the global and personalised models with the segmentation loss on the same batches, each with its own
   optimiser; FedSM's preset starts both afresh each round (``train.optimizer_state`` "fresh"; the reference keeps
   their Adam moments, which measured 0.69 Dice lower over nineteen seeds: benchmarks/RESULTS_fedsm.md);
4. replies with a COLLECTION: the two models' updates as one WEIGHT_DIFF part and the Gaussian as a
   STATISTICS part, so each is seen by the site's privacy scope (PercentilePrivacy acts on the diffs,
   a DXOBlocker can refuse the statistics), and the validation scores as a METRICS part, which the server's
   intake puts where FLARE's best-model selector reads them (meta ``initial_metrics``; :mod:`medflare.common.egress`).

FedSM-extra rounds: the server sends every site's personalised model; the site labels each training case
with the lowest-loss model (Eq. 1, once: the models no longer change) and replies with one gradient step of
the selector head on those labels (a WEIGHT_DIFF part, :mod:`.extra`).

Task ``validate``: score the final super model on validation and test splits with every site's personalised
model (exact super-model scores), and on validation at every threshold of the gamma grid, as a seen site and as if
this site were new, also split by the site each case is most typical of (:func:`medflare.fedsm.scoring.gamma_sweep`;
the server chooses the super model's threshold per site from them);
the reply holds metrics only (a COLLECTION with one METRICS part).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Mapping

import numpy as np
import torch
from nvflare.apis.dxo import DXO, DataKind, MetaKey
from nvflare.apis.fl_constant import FLMetaKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal
from nvflare.app_common.utils.fl_model_utils import FLModelUtils

from medflare import MedflareError, PayloadError
from medflare.common.egress import site_reply
from medflare.common.payload import (check_finite, flatten, load_numpy_state, nbytes, payload_bytes, state_to_numpy,
                                    unflatten, weight_diff)
from medflare.common.site_config import setting
from medflare.common.site_executor import SiteExecutor, format_metrics
from medflare.common.training import local_work, make_loss, make_optimizer, round_optimizer, train_epochs
from medflare.fedsm import protocol as P
from medflare.fedsm.density import site_gaussian
from medflare.fedsm.extra import extra_labels, head_gradient_step, per_case_losses
from medflare.fedsm.scoring import case_scorer, is_sweep_score, one_pass, summarize
from medflare.fedsm.selector import build_selector, encoder_features, unet_down_blocks

#: the site setting (``local/medflare_site.json``, section "privacy") for noise on the feature statistics
NOISE_SETTING = "fedsm_stats_noise"


def _digest(params: Mapping[str, np.ndarray]) -> str:
    """A fingerprint of a flat state (to reuse per-case scores and Eq. 1 labels while the models do not change)."""
    h = hashlib.sha1()
    for key in sorted(params):
        h.update(key.encode())
        h.update(np.ascontiguousarray(params[key]).tobytes())
    return h.hexdigest()


class FedSMExecutor(SiteExecutor):
    """FedSM site (see the module docstring). Args: those of :class:`medflare.common.site_executor.SiteExecutor`.

    Site setting (the site's own ``local/medflare_site.json``, never the job's): ``privacy.fedsm_stats_noise``,
    the standard deviation of Gaussian noise on the feature mean and covariance the site sends, in units of
    each feature's standard deviation (0 = none, the default). The draw is fixed for the run (a secret of
    the site), so averaging rounds does not remove it. The global and personalised models each have their own
    optimiser; ``train.optimizer_state`` says whether its state (Adam's moments) carries across rounds ("kept", as the
    reference's clients do) or each round starts afresh ("fresh").
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.register_task(P.TASK_TRAIN, self.train)
        self.register_task(P.TASK_VALIDATE, self.score_only)
        self.selector = None
        self.selector_spec: dict | None = None
        self._scores: dict[tuple[str, str, str], torch.Tensor] = {}  # (split, model, digest) -> per-case scores (N, 2, K), see case_scorer
        self._labels: tuple[str, list[int]] | None = None  # (digest of all models, Eq. 1 labels of the training cases)

    def setup(self, fl_ctx: FLContext) -> None:
        if self.data.task != "segmentation":
            raise MedflareError(f"FedSM trains segmentation models; preset '{self.preset}' is {self.data.task}")
        train = self.cfg["train"]
        self.global_model, self.person_model = self.new_model(), self.new_model()
        self.opt_global = make_optimizer(train["optimizer"], self.global_model.parameters(), train["lr"])
        self.opt_person = make_optimizer(train["optimizer"], self.person_model.parameters(), train["lr"])
        self.loss_fn = make_loss(train["loss"], self.data.task)
        self.key = self.cfg["eval"]["key_metric"]
        self.score_cases = case_scorer(self.data.task, self.data.num_classes, self.key, self.torch_device)
        self.stats_noise = float(setting(self.site_config, "privacy", NOISE_SETTING, 0.0,
                                         check=lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0, site=self.site))
        self._noise_seed = int.from_bytes(os.urandom(7), "little")  # the site's secret: the server cannot regenerate the noise

    # ---- receiving ---------------------------------------------------------------------------
    def _receive(self, shareable: Shareable) -> tuple[Any, dict, list[str], int]:
        incoming = FLModelUtils.from_shareable(shareable)
        meta = incoming.meta or {}
        sites = list(meta.get(P.SITES) or [])
        if self.site not in sites:
            raise PayloadError(f"site '{self.site}' is not in the server's site-index map {sites}")
        spec = meta.get(P.SELECTOR)
        if not spec:
            raise PayloadError(f"the task data for '{self.site}' names no selector ('{P.SELECTOR}')")
        if self.selector is None or spec != self.selector_spec:
            self.selector = build_selector(spec).to(self.torch_device)
            self.selector_spec = spec
        models = unflatten(incoming.params)
        load_numpy_state(self.global_model, models[P.GLOBAL], who="server (global)")
        load_numpy_state(self.selector, models[P.SELECT], who="server (selector)")
        idx = sites.index(self.site)
        load_numpy_state(self.person_model, self._own(models, idx), who="server (personalised)")
        return incoming, models, sites, idx

    def _own(self, models: dict, idx: int) -> dict:
        """This site's personalised model in a payload: under PERSON (main rounds) or person_<idx> (all-models payloads)."""
        own = models.get(P.PERSON, models.get(P.person_key(idx)))
        if own is None:
            raise PayloadError(f"the task data for '{self.site}' holds no personalised model for it")
        return own

    def _all_person(self, models: dict, sites: list[str], idx: int) -> list[torch.nn.Module] | None:
        """Every site's personalised model in site order (FedSM-extra and validate payloads), else None."""
        if P.person_key(0) not in models:
            return None
        nets = []
        for i, site in enumerate(sites):
            net = self.person_model if i == idx else self.new_model()
            if i != idx:
                load_numpy_state(net, models[P.person_key(i)], who=f"server (personalised {site})")
            nets.append(net)
        return nets

    # ---- scoring -----------------------------------------------------------------------------
    def score(self, split: str, models: dict, idx: int, gamma: float, persons: list[torch.nn.Module] | None,
              sweep: bool = False) -> dict[str, float]:
        """One pass over ``split``: every model and the selector per batch (see :mod:`medflare.fedsm.scoring`);
        ``sweep`` (with every site's model): also the scores of every threshold of the gamma grid, seen and unseen.

        Per-case scores of a model are reused while its weights do not change (FedSM-extra rounds)."""
        nets = {P.GLOBAL: (self.global_model, models[P.GLOBAL]), P.PERSON: (self.person_model, self._own(models, idx))}
        if persons is not None:
            nets.update({P.person_key(i): (net, models[P.person_key(i)]) for i, net in enumerate(persons) if i != idx})
        digests = {name: _digest(params) for name, (_, params) in nets.items()}
        todo = {name: net for name, (net, _) in nets.items() if (split, name, digests[name]) not in self._scores}
        whole = self.data.whole_volumes if self.data.spatial_dims == 3 else None
        if whole is None:
            loader = self.loader(split)
        else:
            # 3D presets: each case is a whole volume, which a patch-trained network predicts by sliding windows; the
            # selector's stem (encoder blocks only) reads the whole volume directly
            for net in todo.values():
                net.eval()
            loader, todo = whole.loader(split), {name: whole.predictor(net) for name, net in todo.items()}
        fresh, typicality, head = one_pass(loader, todo, self.selector, self.score_cases, self.torch_device)
        self._scores = {key: v for key, v in self._scores.items() if key[2] in digests.values()}  # keep only current models
        self._scores.update({(split, name, digests[name]): v for name, v in fresh.items()})
        case_scores = {name: self._scores[(split, name, digests[name])] for name in nets}
        case_scores.update({P.person_key(idx): case_scores[P.PERSON]})
        person_names = [P.person_key(i) for i in range(len(persons))] if persons is not None else None
        return summarize(case_scores, typicality, head, idx, gamma, self.key, P.GLOBAL, person_names, P.PERSON, sweep=sweep)

    # ---- what the site sends ------------------------------------------------------------------
    def _feature_stats(self, fl_ctx: FLContext, rnd: int) -> dict[str, np.ndarray]:
        """The received global model's encoder Gaussian over the training cases, calibrated on validation (+ the site's noise)."""
        blocks = unet_down_blocks(self.global_model, self.selector.levels)
        self.global_model.eval()
        with torch.no_grad():
            feats = {split: [encoder_features(blocks, b["image"].to(self.torch_device)).cpu() for b in self.loader(split)]
                     for split in ("train", "val")}
        empty = torch.zeros(0, self.selector.dim, dtype=torch.float64)
        train, val = (torch.cat(feats[s]) if feats[s] else empty for s in ("train", "val"))
        stats = site_gaussian(train, val, self.selector.shrinkage, self.stats_noise, torch.Generator().manual_seed(self._noise_seed))
        source = f"'{NOISE_SETTING}' of local/medflare_site.json" if self.stats_noise else "none set in local/medflare_site.json"
        self.log_info(fl_ctx, f"round {rnd}: '{self.site}' sends feature statistics (STATISTICS): {int(stats['n'])} training cases, "
                              f"mean of {self.selector.dim} and a {self.selector.dim}x{self.selector.dim} covariance, moments of "
                              f"{int(stats['val_n'])} validation distances; noise {self.stats_noise} x feature std ({source}); {nbytes(stats)} B")
        return stats

    def _extra_step(self, fl_ctx: FLContext, rnd: int, persons: list[torch.nn.Module], models: dict, sites: list[str], idx: int) -> dict[str, np.ndarray]:
        """One gradient step of the selector head on Eq. 1 labels of the training cases (labels computed once)."""
        digest = "|".join(_digest(models[name]) for name in (P.GLOBAL, *(P.person_key(i) for i in range(len(sites)))))
        if self._labels is None or self._labels[0] != digest:
            labels: list[int] = []
            for batch in self.loader("train"):
                image, label = batch["image"].to(self.torch_device), batch["label"].to(self.torch_device)
                labels.extend(extra_labels(per_case_losses([self.global_model, *persons], image, label, self.loss_fn)).tolist())
            self._labels = (digest, labels)
            counts = np.bincount(labels, minlength=len(sites) + 1)
            self.log_info(fl_ctx, f"round {rnd}: '{self.site}' Eq. 1 labels of {len(labels)} training cases: global {counts[0]}, "
                                  + ", ".join(f"{s} {c}" for s, c in zip(sites, counts[1:])))
        self.selector.eval()
        with torch.no_grad():
            inputs = torch.cat([self.selector.head_input(self.selector.features(b["image"].to(self.torch_device))).cpu() for b in self.loader("train")])
        head = self.selector.head
        return head_gradient_step(head.weight.cpu(), head.bias.cpu(), inputs, torch.tensor(self._labels[1]))

    def _reply(self, fl_ctx: FLContext, parts: Mapping[str, DXO], n: int, metrics: Mapping[str, float], rnd: int) -> Shareable:
        self.log_info(fl_ctx, f"round {rnd}: '{self.site}' replies with " + ", ".join(
            f"{name} ({getattr(dxo.data_kind, 'value', dxo.data_kind)}, {payload_bytes(dxo)} B)" for name, dxo in parts.items())
            + f" and {len(metrics)} validation scores (the best-model selector's)")
        n = {FLMetaKey.NUM_STEPS_CURRENT_ROUND: n}
        return site_reply(parts, lift={MetaKey.INITIAL_METRICS: DXO(DataKind.METRICS, data=dict(metrics))}, meta=n, rnd=rnd)

    # ---- tasks -------------------------------------------------------------------------------
    def train(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        incoming, models, sites, idx = self._receive(shareable)
        meta = incoming.meta
        rnd = int(incoming.current_round or 0)
        phase = meta.get(P.PHASE, P.MAIN)
        if phase not in P.PHASES:
            raise PayloadError(f"unknown FedSM phase '{phase}' in the task meta (known: {list(P.PHASES)})")
        persons = self._all_person(models, sites, idx)
        metrics = self.score("val", models, idx, float(meta.get(P.GAMMA, 0.05)), persons)
        self.tracker.scalars(fl_ctx, metrics, rnd, prefix="val/")
        self.log_overlays(fl_ctx, self.person_model, "val_person", rnd, incoming.total_rounds)
        self.log_info(fl_ctx, f"round {rnd} ({phase}): '{self.site}' validation: {format_metrics(metrics)}")
        n = len(self.data.train)
        if phase == P.EXTRA:
            if persons is None:
                raise PayloadError("a FedSM-extra round needs every site's personalised model in the task data")
            step = self._extra_step(fl_ctx, rnd, persons, models, sites, idx)
            return self._reply(fl_ctx, {P.HEAD_PART: DXO(DataKind.WEIGHT_DIFF, data=step, meta={FLMetaKey.NUM_STEPS_CURRENT_ROUND: 1})}, n, metrics, rnd)

        stats = self._feature_stats(fl_ctx, rnd)  # with the received global model, before it trains
        train = self.cfg["train"]
        sent = {P.GLOBAL: models[P.GLOBAL], P.PERSON: self._own(models, idx)}
        self.opt_global = round_optimizer(self.opt_global, self.global_model, train)
        self.opt_person = round_optimizer(self.opt_person, self.person_model, train)
        nets = {P.GLOBAL: (self.global_model, self.opt_global), P.PERSON: (self.person_model, self.opt_person)}
        losses, steps = {}, {}
        for name, (net, opt) in nets.items():
            result = train_epochs(
                net, self.loader("train", shuffle=True, round_num=rnd), self.loss_fn, opt, **local_work(train),
                device=self.torch_device, should_stop=lambda: abort_signal.triggered,
            )
            losses[f"train_loss_{name}"], steps[name] = result.mean_loss, result.steps
        self.tracker.scalars(fl_ctx, losses, rnd)
        self.log_steps(fl_ctx, rnd, min(steps.values()), "each of " + " and ".join(f"{name} {k}" for name, k in steps.items()))
        diff = flatten({name: weight_diff(state_to_numpy(nets[name][0]), sent[name]) for name in nets})
        check_finite(diff, self.site)
        return self._reply(fl_ctx, {P.WEIGHTS_PART: DXO(DataKind.WEIGHT_DIFF, data=diff, meta={FLMetaKey.NUM_STEPS_CURRENT_ROUND: n}),
                            P.STATS_PART: DXO(DataKind.STATISTICS, data=stats)}, n, metrics, rnd)

    def score_only(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        incoming, models, sites, idx = self._receive(shareable)
        rnd = int(incoming.current_round or 0)
        gamma = float(incoming.meta.get(P.GAMMA, 0.05))
        persons = self._all_person(models, sites, idx)
        scored = self.score("val", models, idx, gamma, persons, sweep=True)
        sweep = {k: v for k, v in scored.items() if is_sweep_score(k)}  # for the server's choice of gamma
        metrics = {k: v for k, v in scored.items() if k not in sweep}
        self.tracker.scalars(fl_ctx, metrics, rnd, prefix="val/")  # the validation curve's last point: the final model
        metrics.update({f"test_{k}": v for k, v in self.score("test", models, idx, gamma, persons).items()})
        self.tracker.scalars(fl_ctx, metrics, rnd, prefix="final/")
        self.log_info(fl_ctx, f"final super model on '{self.site}': {format_metrics(metrics)}")
        return self._reply(fl_ctx, {P.METRICS_PART: DXO(DataKind.METRICS, data={**metrics, **sweep})}, len(self.data.train),
                           metrics, rnd)
