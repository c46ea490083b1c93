"""FedSM client: score the received super model, train global, personalised and selector, return weight diffs.

Task "train" (Algorithm 1, lines 6-13): the server sends this site the global model, the site's own
personalised model and the selector (FULL weights, prefixes ``global.``/``person.``/``select.``) with
the site-index map in the meta. The site first scores what it received on its validation split (global,
personalised and super-model Dice, selector accuracy: the server keeps the best super model by these),
then trains the global and personalised models with the segmentation loss on the same batches and returns
one WEIGHT_DIFF over the two, so FLARE's privacy filters apply to both unchanged. The selector is not
trained at the site: when the server asks (first round), the site sends the mean and covariance of the
selector's fixed features over its training images, labelled with its own index (Eq. 2), in the result
meta; the server calibrates the selector head on them (:mod:`.calibrate`, CCVR-style).

In FedSM-extra rounds ("extra" phase) the server also sends every site's personalised model; the site
labels each training case with the model of lowest loss (Eq. 1) and sends the feature statistics per label.

Task "validate": score the received models on validation and test splits, train nothing (the server
sends it once after the last round so the final super model is scored too).
"""

from __future__ import annotations

import torch
from nvflare.apis.fl_constant import FLMetaKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.utils.fl_model_utils import FLModelUtils
from medflare import MedflareError
from medflare.common.component import keep_args
from medflare.common.payload import check_finite, flatten, load_numpy_state, state_to_numpy, unflatten, weight_diff
from medflare.common.site_executor import SiteExecutor, format_metrics
from medflare.common.training import make_loss, make_optimizer, train_epochs
from medflare.fedsm import protocol as P
from medflare.fedsm.calibrate import add_noise, feature_stats, selector_features
from medflare.fedsm.extra import extra_labels, per_case_losses
from medflare.fedsm.routing import SuperModelPredictor, selection_frequency
from medflare.fedsm.selector import build_selector


class FedSMExecutor(SiteExecutor):
    """FedSM site: global, personalised and selector training; super-model validation.

    Args (besides :class:`medflare.common.site_executor.SiteExecutor`'s preset, overrides, device, seed,
    num_overlays, overlay_every):
        stats_noise: standard deviation of Gaussian noise the site adds to every entry of the feature
            means and covariances it sends (computed once per run and label set, so repeated rounds
            cannot average the noise away). Default 0 (off).
        train_task: name of the training task. Default "train".
        validate_task: name of the scoring-only task. Default "validate".

    The global and personalised models keep their own Adam state across rounds (the reference never
    resets client optimisers).
    """

    def __init__(
        self,
        *args,
        stats_noise: float = 0.0,
        train_task: str = "train",
        validate_task: str = "validate",
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        if not isinstance(stats_noise, (int, float)) or stats_noise < 0:
            raise MedflareError(f"FedSMExecutor: 'stats_noise' must be a number >= 0, got {stats_noise!r}")
        keep_args(self, stats_noise=stats_noise, train_task=train_task, validate_task=validate_task)
        self._own_stats = None
        self.register_task(train_task, self.train)
        self.register_task(validate_task, self.score_only)
        self.selector = None
        self.selector_spec = None

    def setup(self, fl_ctx: FLContext) -> None:
        train = self.cfg["train"]
        self.global_model, self.person_model = self.new_model(), self.new_model()
        self.opt_global = make_optimizer(train["optimizer"], self.global_model.parameters(), train["lr"])
        self.opt_person = make_optimizer(train["optimizer"], self.person_model.parameters(), train["lr"])
        self.loss_fn = make_loss(train["loss"], self.data.task)
        if self.data.task != "segmentation":
            raise MedflareError(f"FedSM trains segmentation models; preset '{self.preset}' is {self.data.task}")

    # ---- receiving ---------------------------------------------------------------------------
    def _receive(self, shareable: Shareable) -> tuple[FLModel, dict, list[str], int]:
        incoming = FLModelUtils.from_shareable(shareable)
        meta = incoming.meta or {}
        sites = list(meta.get(P.SITES) or [])
        if self.site not in sites:
            raise MedflareError(f"site '{self.site}' is not in the server's site-index map {sites}")
        spec = meta[P.SELECTOR]
        if self.selector is None or spec != self.selector_spec:
            self.selector = build_selector(spec).to(self.torch_device)
            self.selector_spec, self._own_stats = spec, None
        models = unflatten(incoming.params)
        load_numpy_state(self.global_model, models["global"], who="server (global)")
        load_numpy_state(self.selector, models["select"], who="server (selector)")
        if "person" in models:
            load_numpy_state(self.person_model, models["person"], who="server (personalised)")
        return incoming, models, sites, sites.index(self.site)

    def _all_person(self, models: dict, sites: list[str]) -> list[torch.nn.Module]:
        """Every site's personalised model (FedSM-extra payload), or only this site's own otherwise."""
        if "person_0" not in models:
            return []
        nets = []
        for i in range(len(sites)):
            net = self.person_model if sites[i] == self.site else self.new_model()
            load_numpy_state(net, models[f"person_{i}"], who=f"server (personalised {sites[i]})")
            nets.append(net)
        return nets

    # ---- scoring -----------------------------------------------------------------------------
    def score(self, split: str, sites: list[str], idx: int, gamma: float, global_class: bool, person_all) -> dict:
        """Dice of global, personalised and super model, selector accuracy and routing on ``split``.

        Without every site's personalised model (the usual FedSM payload), the super model routes a case to
        the global model unless the selector picks this site: the site can only run its own model, and its
        own cases are the ones the selector should send to it.
        """
        key = self.cfg["eval"]["key_metric"]
        out = {
            "global_dice": self.validate(self.global_model, split)[key],
            "person_dice": self.validate(self.person_model, split)[key],
        }
        persons = person_all or [self.person_model if i == idx else self.global_model for i in range(len(sites))]
        predictor = SuperModelPredictor(self.global_model, persons, self.selector, gamma, global_class)
        out["super_dice"] = self.validate(None, split, predict=predictor)[key]
        wanted = idx + 1 if global_class else idx
        with torch.no_grad():
            self.selector.eval()
            hits = total = 0
            for batch in self.loader(split):
                hits += int((self.selector(batch["image"].to(self.torch_device)).argmax(1) == wanted).sum())
                total += batch["image"].shape[0]
        out["selector_acc"] = hits / max(total, 1)
        freq = selection_frequency(predictor.choices, sites)
        out["selected_own"], out["selected_global"] = freq[self.site], freq["GM"]
        return out

    # ---- tasks -------------------------------------------------------------------------------
    def train(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        incoming, models, sites, idx = self._receive(shareable)
        meta = incoming.meta
        rnd = int(incoming.current_round or 0)
        phase = meta.get(P.PHASE, "main")
        if phase not in P.PHASES:
            raise MedflareError(f"unknown FedSM phase '{phase}' in the task meta (known: {list(P.PHASES)})")
        global_class = bool(meta.get(P.GLOBAL_CLASS, False))
        person_all = self._all_person(models, sites)
        metrics = self.score("val", sites, idx, float(meta.get(P.GAMMA, 0.9)), global_class, person_all)
        self.tracker.scalars(fl_ctx, metrics, rnd, prefix="val/")
        self.log_overlays(fl_ctx, self.person_model, "val_person", rnd, incoming.total_rounds)
        self.log_info(fl_ctx, f"round {rnd} ({phase}): '{self.site}' validation: {format_metrics(metrics)}")

        train = self.cfg["train"]
        out_meta = {FLMetaKey.NUM_STEPS_CURRENT_ROUND: len(self.data.train)}
        diff = {}
        if phase == "main":
            sent = {"global": models["global"], "person": models["person"]}
            nets = {"global": (self.global_model, self.opt_global), "person": (self.person_model, self.opt_person)}
            losses = {}
            for name, (net, opt) in nets.items():
                stats = train_epochs(
                    net, self.loader("train", shuffle=True, round_num=rnd), self.loss_fn, opt, epochs=train["epochs"],
                    max_steps=train.get("max_steps", 0), device=self.torch_device, should_stop=lambda: abort_signal.triggered,
                )
                losses[f"train_loss_{name}"] = stats.mean_loss
            self.tracker.scalars(fl_ctx, losses, rnd)
            diff = flatten({n: weight_diff(state_to_numpy(nets[n][0]), sent[n]) for n in nets})
            check_finite(diff, self.site)
            if meta.get(P.STATS):
                # The selector body is fixed, so the site's own-label statistics never change: compute (and
                # noise) them once, then resend the same values.
                if self._own_stats is None:
                    self._own_stats = self._stats([idx + 1 if global_class else idx] * len(self.data.train))
                out_meta[P.STATS] = self._own_stats
        else:
            labels = self._extra_labels(person_all)
            self.tracker.scalars(fl_ctx, {"extra_label_own": labels.count(idx + 1) / max(len(labels), 1)}, rnd)
            out_meta[P.STATS] = self._stats(labels)
        result = FLModel(params_type=ParamsType.DIFF, params=diff, metrics=metrics, meta=out_meta, current_round=rnd)
        return FLModelUtils.to_shareable(result)

    def _stats(self, labels: list[int]) -> dict:
        """Per-label mean and covariance of the fixed selector features of the training images (+ noise)."""
        feats = selector_features(self.selector, (b["image"].to(self.torch_device) for b in self.loader("train")))
        stats = feature_stats(feats, labels)
        return add_noise(stats, self.stats_noise) if self.stats_noise > 0 else stats

    def _extra_labels(self, person_all: list[torch.nn.Module]) -> list[int]:
        """Eq. 1 label of every training case: index of the lowest-loss model in [global, person_1..K]."""
        if not person_all:
            raise MedflareError("a FedSM-extra round needs every site's personalised model in the payload")
        labels: list[int] = []
        for batch in self.loader("train"):
            losses = per_case_losses(
                [self.global_model, *person_all], batch["image"].to(self.torch_device), batch["label"].to(self.torch_device), self.loss_fn
            )
            labels.extend(extra_labels(losses).tolist())
        return labels

    def score_only(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        incoming, models, sites, idx = self._receive(shareable)
        meta = incoming.meta
        rnd = int(incoming.current_round or 0)
        args = (sites, idx, float(meta.get(P.GAMMA, 0.9)), bool(meta.get(P.GLOBAL_CLASS, False)), self._all_person(models, sites))
        metrics = self.score("val", *args)
        metrics.update({f"test_{k}": v for k, v in self.score("test", *args).items()})
        self.tracker.scalars(fl_ctx, metrics, rnd, prefix="final/")
        self.log_info(fl_ctx, f"final models on '{self.site}': {format_metrics(metrics)}")
        out_meta = {FLMetaKey.NUM_STEPS_CURRENT_ROUND: len(self.data.train)}
        return FLModelUtils.to_shareable(FLModel(params_type=ParamsType.DIFF, params={}, metrics=metrics, meta=out_meta, current_round=rnd))
