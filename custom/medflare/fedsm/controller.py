"""FedSM server workflow (Algorithm 1, lines 3-17): per-site payloads in parallel, FedAvg + SoftPull, the super model.

Each round the server sends every site, at once and each its own task, the global model, that site's
personalised model and the selector; it waits for the standing tasks, then sets the global model to the
n_k/n-weighted average and the personalised models by SoftPull (Eq. 11). The selector's head is calibrated
here from the sites' feature statistics (:mod:`.calibrate`; a deviation from the paper, which trains the
selector by FedAvg: that stays at chance, see the module docstring there). It keeps all K personalised
models between rounds and saves the super model (see :mod:`.supermodel`) after every round and,
separately, whenever the sites' mean validation super-model Dice is the best so far.
"""

from __future__ import annotations

import os
import time
from typing import Any, Mapping

import numpy as np
import torch
from nvflare.apis.fl_constant import FLMetaKey
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

from medflare import ConfigError
from medflare.common.component import keep_args
from medflare.common.payload import flatten, state_to_numpy, unflatten
from medflare.common.checks import check_int
from medflare.common.workflow import SiteRounds
from medflare.common.persistence import model_from_preset
from medflare.common.results import describe
from medflare.fedsm import protocol as P
from medflare.fedsm.calibrate import fit_head, head_of, set_head
from medflare.common.aggregation import weighted_mean
from medflare.fedsm.softpull import check_lambda, softpull
from medflare.fedsm.supermodel import BEST_SUPER_MODEL_FILE, SUPER_MODEL_FILE, save_super_model
from medflare.fedsm.selector import build_selector
from medflare.presets import get_preset

DEFAULT_SELECTOR = {"name": "style_selector", "args": {"width": 16, "depth": 3}}


class FedSMController(SiteRounds):
    """FedSM: global model by FedAvg, personalised models by SoftPull, selector head calibrated from feature statistics.

    Args:
        num_rounds: main training rounds (Algorithm 1). Default 10.
        softpull_lambda: lambda of Eq. 11 in [1/K, 1]; 1/K = FedAvg, 1 = local training. Default 0.7 (paper,
            low-similarity sites).
        extra_rounds: FedSM-extra rounds after the main ones: the selector (then with K + 1 outputs, column 0
            = global model) is recalibrated there with Eq. 1 labels; 0 = plain FedSM. Default 0.
        gamma: routing threshold used for the super-model Dice the sites report each round (evaluation
            only: training never uses it; FedSM-extra routes by argmax, gamma 0). Default 0.9.
        preset / overrides / seed: the segmentation network, as the sites' executors (must match). Defaults
            "seg_synthetic", none, 0.
        selector: ``{"name", "args"}`` of the selector; ``num_classes`` and ``in_channels`` are filled in.
            Must have ``features()`` and a Linear ``classifier``. Default style_selector width 16, depth 3.
        calibration: arguments of :func:`medflare.fedsm.calibrate.fit_head` (samples_per_class 500, steps 300,
            lr 0.05, eps 1e-3). Default {}.
        train_task / validate_task: task names. Defaults "train", "validate".
        persistor_id, min_responses, task_timeout, task_check_period: see :class:`medflare.common.workflow.SiteRounds`
            (persistor_id "" until the super model has its persistor).
    """

    def __init__(
        self,
        num_rounds: int = 10,
        softpull_lambda: float = 0.7,
        extra_rounds: int = 0,
        gamma: float = 0.9,
        preset: str = "seg_synthetic",
        overrides: Mapping[str, Any] | None = None,
        seed: int = 0,
        selector: Mapping[str, Any] | None = None,
        calibration: Mapping[str, Any] | None = None,
        train_task: str = "train",
        validate_task: str = "validate",
        persistor_id: str = "",
        min_responses: int = 0,
        task_timeout: int = 3600,
        task_check_period: float = 0.2,
    ):
        super().__init__(num_rounds=num_rounds, persistor_id=persistor_id, min_responses=min_responses,
                         task_timeout=task_timeout, task_check_period=task_check_period)
        selector = selector or DEFAULT_SELECTOR
        keep_args(self, softpull_lambda=softpull_lambda, extra_rounds=extra_rounds, gamma=gamma, preset=preset,
                  overrides=overrides or {}, seed=seed, selector=selector, calibration=calibration or {},
                  train_task=train_task, validate_task=validate_task)
        check_int("FedSMController", "extra_rounds", extra_rounds, 0)
        if not 0 <= float(gamma) <= 1:
            raise ConfigError(f"FedSMController: 'gamma' must lie in [0, 1], got {gamma!r}")
        self.lam = float(softpull_lambda)
        self.selector_spec = {"name": selector["name"], "args": dict(selector.get("args", {}))}
        unknown = set(self.calibration) - {"samples_per_class", "steps", "lr", "eps"}
        if unknown:
            raise ConfigError(f"FedSMController: unknown 'calibration' keys {sorted(unknown)}")

    # ---- state -------------------------------------------------------------------------------
    def _init_state(self) -> None:
        self.site_names = self.sites()
        K = len(self.site_names)
        check_lambda(self.lam, K)  # fail before the first round, not after it
        self.global_class = self.extra_rounds > 0
        cfg = get_preset(self.preset, self.overrides)
        self.selector_spec["args"].update(
            in_channels=cfg["model"]["args"].get("in_channels", 1), num_classes=K + int(self.global_class)
        )
        start = state_to_numpy(model_from_preset(self.preset, self.overrides, self.seed))
        self.global_params = start
        # All personalised models start from the initial global model (as in the reference).
        self.person = {s: {k: v.copy() for k, v in start.items()} for s in self.site_names}
        torch.manual_seed(self.seed)
        self.selector_net = build_selector(self.selector_spec)  # body fixed for the run; only the head is calibrated
        head_of(self.selector_net)  # a selector without a Linear head on features() fails here, not after round 1
        self.select = state_to_numpy(self.selector_net)
        self.stats: dict[str, dict] = {}  # site -> its own-label feature statistics (sent once)
        self.description = describe(self.preset, self.overrides, kind="fedsm_super_model")
        self.best = -np.inf

    def _payload(self, site: str, phase: str) -> dict[str, np.ndarray]:
        models = {"global": self.global_params, "select": self.select}
        if phase == "extra":  # Eq. 1 needs every personalised model at every site
            models.update({f"person_{i}": self.person[s] for i, s in enumerate(self.site_names)})
        else:
            models["person"] = self.person[site]
        return flatten(models)

    # ---- one round ---------------------------------------------------------------------------
    def _round(self, task: str, rnd: int, phase: str, total: int) -> dict[str, FLModel]:
        """Send each site its own payload (all at once); results by site."""
        payloads = {}
        for site in self.site_names:
            meta = {
                P.SITES: self.site_names, P.SELECTOR: self.selector_spec, P.GLOBAL_CLASS: self.global_class,
                P.PHASE: phase, P.GAMMA: 0.0 if self.global_class else self.gamma,
                P.STATS: phase == "extra" or site not in self.stats,
            }
            payloads[site] = FLModel(params_type=ParamsType.FULL, params=self._payload(site, phase), meta=meta,
                                     current_round=rnd, total_rounds=total)
        return self.exchange(task, payloads, rnd)

    def _super_model(self) -> FLModel:
        """Global, personalised (site-index order) and selector weights as one flat FULL model."""
        models = {"global": self.global_params, "select": self.select}
        models.update({f"person_{i}": self.person[s] for i, s in enumerate(self.site_names)})
        return FLModel(params_type=ParamsType.FULL, params=flatten(models))

    def _aggregate(self, results: dict[str, FLModel], phase: str) -> None:
        """FedAvg of the global model (n_k/n), SoftPull of the personalised models (Eq. 11), selector head calibration."""
        order = [s for s in self.site_names if s in results]
        if phase == "main":
            weights = [float(results[s].meta.get(FLMetaKey.NUM_STEPS_CURRENT_ROUND, 1)) for s in order]
            diffs = {s: unflatten(results[s].params) for s in order}
            mean = weighted_mean([diffs[s]["global"] for s in order], weights)
            self.global_params = {k: v + mean[k].astype(v.dtype) for k, v in self.global_params.items()}
            # A site that did not answer enters SoftPull with its model unchanged.
            trained = [
                {k: v + diffs[s]["person"][k].astype(v.dtype) for k, v in self.person[s].items()} if s in diffs else self.person[s]
                for s in self.site_names
            ]
            self.person = dict(zip(self.site_names, softpull(trained, self.lam)))
        fresh = {s: results[s].meta[P.STATS] for s in order if results[s].meta.get(P.STATS)}
        if phase == "main":
            if not fresh:
                return  # nothing new: the head stays as calibrated
            self.stats.update(fresh)
            used = self.stats
        else:
            used = fresh  # Eq. 1 labels of this round's models
        labels = sorted({label for stats in used.values() for label in stats})
        if len(labels) < 2:
            self.info(f"selector head not calibrated: statistics of fewer than 2 labels ({labels})")
            return
        tic = time.perf_counter()
        weight, bias = fit_head(list(used.values()), len(self.site_names) + int(self.global_class), seed=self.seed, **self.calibration)
        set_head(self.selector_net, weight, bias)
        self.select = state_to_numpy(self.selector_net)
        self.info(f"selector head calibrated on feature statistics of {sorted(used)} ({phase}) in {time.perf_counter() - tic:.2f} s")

    def _save(self, name: str, rnd: int, metrics: Mapping[str, float]) -> None:
        save_super_model(
            os.path.join(self.get_app_dir(), name), description=self.description, sites=self.site_names,
            selector_spec=self.selector_spec, global_class=self.global_class, global_params=self.global_params,
            person_params=self.person, selector_params=self.select, lam=self.lam, round_num=rnd, metrics=metrics,
            gamma=0.0 if self.global_class else self.gamma,
        )

    def _scored(self, results: dict[str, FLModel], rnd: int) -> dict[str, float]:
        """Mean over sites of the validation metrics of the models sent this round; save them if the best."""
        per_site = [r.metrics or {} for r in results.values()]
        names = sorted({k for m in per_site for k in m})
        mean = {k: float(np.mean([m[k] for m in per_site if k in m])) for k in names}
        self.info(f"round {rnd}: mean validation " + ", ".join(f"{k}={v:.4f}" for k, v in mean.items()))
        if mean.get("super_dice", -np.inf) > self.best:
            self.best = mean["super_dice"]
            self._save(BEST_SUPER_MODEL_FILE, rnd, mean)
            self.info(f"round {rnd}: new best super model (mean validation super Dice {self.best:.4f}) -> {BEST_SUPER_MODEL_FILE}")
        return mean

    def run(self) -> None:
        self._init_state()
        total = self.num_rounds + self.extra_rounds
        self.info(f"FedSM: sites {self.site_names}, lambda {self.lam}, {self.num_rounds} rounds + {self.extra_rounds} extra")
        for rnd in range(total):
            phase = "main" if rnd < self.num_rounds else "extra"
            self.start_round(rnd, total)
            results = self._round(self.train_task, rnd, phase, total)
            if not results:
                return
            # The metrics describe the models sent this round (validated before training): save those if best.
            # In FedSM-extra the selector is untrained during the main rounds: "best" is judged only after them.
            if not self.global_class or phase == "extra":
                self._scored(results, rnd)
            self.aggregate(results, lambda res: self._aggregate(res, phase) or self._super_model())
            self._save(SUPER_MODEL_FILE, rnd + 1, {})  # not scored yet: the next round's validation scores it
        results = self._round(self.validate_task, total, "extra" if self.global_class else "main", total)
        if results:
            self._save(SUPER_MODEL_FILE, total, self._scored(results, total))
        self.info(f"FedSM finished: super model in {os.path.join(self.get_app_dir(), SUPER_MODEL_FILE)}")
