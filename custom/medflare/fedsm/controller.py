"""FedSM server workflow (Algorithm 1, lines 3-17, and FedSM-extra), on FLARE's component model.

Each round the server sends every site, at once and each its own task, the global model, that site's
personalised model and the selector; the sites reply with their model updates and the Gaussian of their
encoder features (:mod:`.executor`); :func:`medflare.fedsm.aggregate.aggregate_round` turns the replies into
the next super model (FedAvg, SoftPull, the selector's Gaussians; in FedSM-extra rounds one step of the
selector head). After the last round a ``validate`` task scores the final super model with every site's
personalised model.

FLARE's pieces see it as they see FLARE's own FedAvg (:class:`medflare.common.workflow.SiteRounds`): the
super model is loaded and saved by the persistor named ``persistor_id`` (a
:class:`~medflare.fedsm.persistor.SuperModelPersistor`); each round publishes the super model it sends as
``GLOBAL_MODEL``, the sites' scores of it come back in ``initial_metrics``, and FLARE's
``IntimeModelSelector`` (key metric ``own_or_global_<key>``, see :mod:`.scoring`) fires
``GLOBAL_BEST_MODEL_AVAILABLE``, on which the persistor saves ``best_FedSM_super_model.pt``. The final
validation is one more round in which nothing is trained, so the final super model competes for "best" too.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
from nvflare.apis.dxo import DXO, DataKind
from nvflare.apis.fl_constant import FLMetaKey
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

from medflare import ConfigError, PayloadError
from medflare.common.component import keep_args
from medflare.checks import check_int
from medflare.common.payload import flatten, load_numpy_state, payload_bytes, state_to_numpy, unflatten
from medflare.common.site_executor import format_metrics
from medflare.common.workflow import SiteRounds
from medflare.fedsm import protocol as P
from medflare.fedsm.aggregate import SiteReply, SuperState, aggregate_round
from medflare.fedsm.extra import HeadAdam
from medflare.fedsm.persistor import SuperModelPersistor
from medflare.fedsm.scoring import SWEEP_NAME, choose_gamma, choose_site_gammas
from medflare.fedsm.config import FedSMConfig
from medflare.fedsm.selector import build_selector, selector_spec
from medflare.fedsm.softpull import check_lambda
from medflare.presets import get_preset

#: what each task's reply holds (named in the error when a site's privacy scope refuses it)
REPLY_HOLDS = {
    (P.TASK_TRAIN, P.MAIN): "WEIGHT_DIFF (global and personalised model updates) and STATISTICS (the selector's feature Gaussian)",
    (P.TASK_TRAIN, P.EXTRA): "WEIGHT_DIFF (the selector head's gradient step)",
    (P.TASK_VALIDATE, P.MAIN): "METRICS (validation and test scores)",
}


def parse_reply(site: str, result: FLModel, phase: str) -> SiteReply:
    """A site's COLLECTION result (as FLARE hands it to the server) as a :class:`SiteReply`; PayloadError names the site
    and the missing part."""
    parts = result.params if isinstance(result.params, Mapping) else {}

    def part(name: str, kind: str) -> dict:
        dxo = parts.get(name)
        if not isinstance(dxo, DXO) or dxo.data_kind != kind:
            raise PayloadError(f"site '{site}' sent no {kind} part '{name}' (parts: {sorted(parts)})")
        return dxo.data

    n = int(result.meta.get(FLMetaKey.NUM_STEPS_CURRENT_ROUND, 1))
    if phase == P.EXTRA:
        return SiteReply(n=n, head_step=part(P.HEAD_PART, DataKind.WEIGHT_DIFF))
    return SiteReply(n=n, diffs=unflatten(part(P.WEIGHTS_PART, DataKind.WEIGHT_DIFF)), stats=part(P.STATS_PART, DataKind.STATISTICS))


class FedSMController(SiteRounds):
    """FedSM: FedAvg global model, SoftPull personalised models, encoder-Gaussian selector; optional FedSM-extra.

    Args:
        num_rounds: main training rounds (Algorithm 1). Default 10.
        preset / overrides / seed: the segmentation network, as the sites' executors and the persistor (checked equal
            at START_RUN, :class:`medflare.common.preset_check.PresetCheck`). FedSM's own settings (SoftPull's lambda,
            gamma, the selector, FedSM-extra's rounds and head learning rate) are the preset's ``fedsm`` section
            (:class:`medflare.fedsm.config.FedSMConfig`), set through ``overrides``. Defaults "seg_synthetic", none, 0.
        resume_round: first round to run, to resume a run by resubmission from its saved super model (the
            persistor's ``source_ckpt_file_full_name``): the rounds before it are taken as done. A resume inside
            the FedSM-extra rounds starts the head's Adam moments afresh (they are not saved). Default 0.
        persistor_id: id of the :class:`~medflare.fedsm.persistor.SuperModelPersistor`. Default "persistor".
        min_responses, task_timeout, task_check_period: see :class:`medflare.common.workflow.SiteRounds`.
    """

    def __init__(
        self,
        num_rounds: int = 10,
        preset: str = "seg_synthetic",
        overrides: Mapping[str, Any] | None = None,
        seed: int = 0,
        resume_round: int = 0,
        persistor_id: str = "persistor",
        min_responses: int = 0,
        task_timeout: int = 3600,
        task_check_period: float = 0.2,
    ):
        super().__init__(num_rounds=num_rounds, persistor_id=persistor_id, min_responses=min_responses,
                         task_timeout=task_timeout, task_check_period=task_check_period)
        keep_args(self, preset=preset, overrides=overrides or {}, seed=seed, resume_round=resume_round)
        cfg = get_preset(preset, overrides)
        fedsm = FedSMConfig.from_preset(cfg)
        self.softpull_lambda, self.gamma, self.selector = fedsm.softpull_lambda, fedsm.gamma, fedsm.selector
        self.gamma_from_validation = fedsm.gamma_from_validation
        self.extra_rounds, self.head_lr = fedsm.extra_rounds, fedsm.head_lr
        check_int("FedSMController", "resume_round", resume_round, 0)
        if resume_round > num_rounds + self.extra_rounds:
            raise ConfigError(f"FedSMController: 'resume_round' {resume_round} is past the job's last round "
                              f"({num_rounds} + {self.extra_rounds} extra)")
        self.model_spec = cfg["model"]
        self.key = cfg["eval"]["key_metric"]

    # ---- state -------------------------------------------------------------------------------
    def _init_state(self) -> SuperState:
        sites = self.sites()
        check_lambda(self.softpull_lambda, len(sites))  # fail before the first round, not after it
        self.spec = selector_spec(self.model_spec, sites, self.extra_rounds > 0, self.selector)
        if not isinstance(self.persistor, SuperModelPersistor):
            raise ConfigError(f"FedSMController: persistor_id '{self.persistor_id}' must name a medflare.fedsm.persistor.SuperModelPersistor, "
                              f"got {type(self.persistor).__name__}")
        self.persistor.configure(sites, self.spec, self.softpull_lambda, self.gamma)
        initial = self.load_model()
        if initial is None:
            raise ConfigError(f"FedSMController: persistor '{self.persistor_id}' returned no super model")
        models = unflatten(initial.params)
        select = build_selector(self.spec)
        load_numpy_state(select, models[P.SELECT], who=f"persistor '{self.persistor_id}' (selector)")
        state = SuperState(sites=sites, global_params=models[P.GLOBAL],
                           person={s: models[P.person_key(i)] for i, s in enumerate(sites)}, selector=select)
        if select.global_class:
            state.head_opt = HeadAdam(select.head, lr=self.head_lr)
        return state

    @staticmethod
    def _super_model(state: SuperState, completed: int) -> FLModel:
        """The super model as one flat FULL model (the persistor's container layout); meta: rounds it reflects."""
        models = {P.GLOBAL: state.global_params, **{P.person_key(i): state.person[s] for i, s in enumerate(state.sites)},
                  P.SELECT: state_to_numpy(state.selector)}
        return FLModel(params_type=ParamsType.FULL, params=flatten(models), meta={"round": completed})

    def _payloads(self, state: SuperState, phase: str, rnd: int, total: int, all_persons: bool) -> dict[str, FLModel]:
        """Each site's task data: global, selector and its own personalised model (or every site's, for Eq. 1 and exact scores)."""
        select = state_to_numpy(state.selector)
        meta = {P.SITES: state.sites, P.SELECTOR: self.spec, P.PHASE: phase, P.GAMMA: float(self.gamma)}
        persons = {P.person_key(i): state.person[s] for i, s in enumerate(state.sites)} if all_persons else {}
        return {site: FLModel(params_type=ParamsType.FULL, current_round=rnd, total_rounds=total, meta=dict(meta),
                              params=flatten({P.GLOBAL: state.global_params, P.SELECT: select,
                                              **(persons or {P.PERSON: state.person[site]})}))
                for site in state.sites}

    # ---- replies -----------------------------------------------------------------------------
    def _scores(self, results: Mapping[str, FLModel], rnd: int) -> dict[str, float]:
        """Mean over sites of each score the sites reported (they describe the super model sent this round); logs the parts' sizes."""
        per_site = [r.metrics or {} for r in results.values()]
        names = sorted({k for m in per_site for k in m})
        mean = {k: float(np.mean([m[k] for m in per_site if k in m])) for k in names}
        self.info(f"round {rnd}: mean over sites: {format_metrics(mean)}")
        for site, res in results.items():
            if isinstance(res.params, Mapping):
                sizes = ", ".join(f"{name} {getattr(dxo.data_kind, 'value', dxo.data_kind)} {payload_bytes(dxo)} B" for name, dxo in res.params.items() if isinstance(dxo, DXO))
                self.info(f"round {rnd}: {site} sent {sizes}")
        return mean

    def _choose_gamma(self, results: Mapping[str, FLModel], sites: Sequence[str]) -> None:
        """The super model's thresholds from the sites' final validation sweeps: one per site
        (:func:`medflare.fedsm.scoring.choose_site_gammas`), or one for all (:func:`~medflare.fedsm.scoring.choose_gamma`)
        where a site's reply lacks the per-site shares; logged as tables, recorded by the persistor in the files it saves
        from now on and in the best file."""
        per_site = {site: dict(res.params[P.METRICS_PART].data) for site, res in results.items()
                    if isinstance(res.params, Mapping) and isinstance(res.params.get(P.METRICS_PART), DXO)}
        gamma, table = choose_gamma(per_site, self.key, self.gamma)
        if not table:
            self.warning(f"no site reported validation scores per gamma: the super model keeps gamma {self.gamma}")
            return
        rows = "; ".join(f"gamma {g:g}: seen {100 * seen:.2f} %, unseen {100 * unseen:.2f} %" for g, (seen, unseen) in table.items())
        self.info(f"one gamma for all sites, chosen on the sites' validation cases ({len(per_site)} sites, mean {self.key} as seen "
                  f"sites and left out one at a time): {gamma:g} (configured {self.gamma:g}); {rows}")
        for site, m in sorted(per_site.items()):
            cells = ", ".join(f"{g:g}: {100 * m.get(SWEEP_NAME.format(what='super', key=self.key, gamma=g), float('nan')):.2f}"
                              f" / {100 * m.get(SWEEP_NAME.format(what='unseen', key=self.key, gamma=g), float('nan')):.2f}" for g in table)
            self.info(f"gamma sweep of {site} (seen / left out, %): {cells}")
        chosen = choose_site_gammas(per_site, self.key, len(sites))
        if chosen is None:
            self.warning("a site sent no per-site shares of its sweep (an older medflare?): one gamma for all sites")
            self.persistor.record_gamma(gamma)
            return
        gammas, shares = chosen
        one = sum(table[gamma]) / 2
        self.info("gamma per site, chosen on the same cases: " + ", ".join(f"{s} {g:g}" for s, g in zip(sites, gammas))
                  + f"; mean {self.key} (seen + left out) / 2: {100 * sum(shares):.2f} % with them, {100 * one:.2f} % with {gamma:g} for all")
        self.persistor.record_gamma(gammas)

    def _report(self, results: Mapping[str, FLModel], rnd: int, total: int) -> None:
        """The round's summary line and federation curve: the super model as the sites scored it (``own_or_global``,
        the score the best model is chosen by), beside the global model's and, where the sites hold every personalised
        model (FedSM-extra and the final round), the exact super model's."""
        self.report_round(rnd, total, f"own_or_global_{self.key}", {s: r.metrics or {} for s, r in results.items()},
                          also=(f"global_{self.key}", f"super_{self.key}"))

    # ---- the workflow --------------------------------------------------------------------------
    def run(self) -> None:
        state = self._init_state()
        total = self.num_rounds + self.extra_rounds
        self.info(f"FedSM: sites {state.sites}, lambda {self.softpull_lambda}, gamma {self.gamma}, "
                  f"{self.num_rounds} rounds + {self.extra_rounds} FedSM-extra rounds + 1 validation round"
                  + (f", resuming at round {self.resume_round}" if self.resume_round else ""))
        for rnd in range(self.resume_round, total):
            phase = P.MAIN if rnd < self.num_rounds else P.EXTRA
            sent = self._super_model(state, rnd)  # the models the sites score this round
            self.start_round(rnd, total + 1, validated=sent)
            results = self.exchange(P.TASK_TRAIN, self._payloads(state, phase, rnd, total + 1, phase == P.EXTRA), rnd,
                                    reply_holds=REPLY_HOLDS[(P.TASK_TRAIN, phase)])
            if not results:
                return
            sent.meta["metrics"] = self._scores(results, rnd)
            self.publish(sent)  # a best-model save now records the scores as well
            replies = {site: parse_reply(site, res, phase) for site, res in results.items()}

            def combine(_results, replies=replies, phase=phase, rnd=rnd) -> FLModel:
                aggregate_round(state, replies, phase, self.softpull_lambda)
                return self._super_model(state, rnd + 1)

            self.save_model(self.aggregate(results, combine))
            self._report(results, rnd, total + 1)
        # One more round that trains nothing: every site scores the final super model exactly (all personalised
        # models), and the best-model selector judges it like the others.
        final = self._super_model(state, total)
        self.start_round(total, total + 1, validated=final)
        results = self.exchange(P.TASK_VALIDATE, self._payloads(state, P.MAIN, total, total + 1, True), total,
                                reply_holds=REPLY_HOLDS[(P.TASK_VALIDATE, P.MAIN)])
        if not results:
            return
        final.meta["metrics"] = self._scores(results, total)
        if self.gamma_from_validation:
            self._choose_gamma(results, state.sites)  # before the final model is saved or judged best, so its files record it
        self.publish(final)
        self.aggregate(results, lambda _: final)
        self.save_model(final)
        self._report(results, total, total + 1)
        self.info(f"FedSM finished: super model saved by persistor '{self.persistor_id}'")
