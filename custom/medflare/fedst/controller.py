"""FedST's server workflows: FedST-separate (per-site generators in a shared style store) and FedST-join (one
federated generator with a domain vector), both with FedAvg segmentation on real + cross-domain synthetic images.

Each round (after the generator phase described per class below) every site, all at once:

1. ``sample``: draws images in another site's style from its own label maps (cached at the site, redrawn on
   refresh rounds); the server sends new style-store entries (separate) or nothing (join);
2. ``train``: receives the global segmentation model, reports its validation metrics (Dice, VI, MPA), trains
   with Eq. 3 and returns the weight diff; the server averages the diffs weighted by the sites' training cases.

After the last round a ``validate`` task scores the final model on every site's validation and test split; its
validation score competes for the best file like every round's (before issue 32 it did not, so the best file
could never be the final model).
Every round the persistor saves the style store / join generator with the segmentation model; when the sites'
mean validation key metric of the model sent that round is the best so far, the workflow publishes it as
``GLOBAL_MODEL`` and fires FLARE's ``GLOBAL_BEST_MODEL_AVAILABLE`` (what ``IntimeModelSelector`` does for
FedAvg) and the persistor writes the ``best_`` file. The bytes each site received and sent per round and task
go to ``communication.json`` in the server's app folder with the totals the formulas of :mod:`.comm` predict.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np
from nvflare.apis.fl_constant import FLMetaKey
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

from medflare import ConfigError, PayloadError
from medflare.common.aggregation import apply_diff, weighted_mean
from medflare.common.component import keep_args
from medflare.common.diff_quantizer import WIRE_BYTES
from medflare.common.payload import flatten, nbytes, payload_bytes, unflatten
from medflare.common.quantize import decode, encode, encoded_bytes
from medflare.common.workflow import SiteRounds
from medflare.fedst import comm
from medflare.fedst import protocol as P
from medflare.fedst.conditioning import participation_mean
from medflare.fedst.config import DiffusionConfig, FedSTConfig
from medflare.fedst.diffusion import ALL, DOMAIN, exchange_plan, float_exchange_dtype, in_exchange_dtype, quantized_bits, select_entries
from medflare.fedst.persistor import META_CLASSES, META_METRICS, META_ROUND, META_SITES, META_SIZE, META_VERSIONS
from medflare.presets import get_preset

LEDGER_FILE = "communication.json"



def generator_summary(res: FLModel) -> dict:
    """The site's summary beside its generator (:data:`~medflare.fedst.protocol.SUMMARY`): classes, image size, losses."""
    return dict((res.meta or {}).get(P.SUMMARY) or {})

class FedSTController(SiteRounds):
    """What both FedST workflows share (use :class:`FedSTSeparateController` or :class:`FedSTJoinController`).

    Args:
        num_rounds: segmentation rounds. Default 10 (the recipes pass the preset's ``fedst.rounds``). When the job's
            overrides set ``fedst.rounds`` too, the two must agree (ConfigError otherwise): a job folder's rounds are
            its ``num_rounds``, and an override that would be ignored is refused instead.
        preset / overrides / seed: as the sites' executors and the persistor (checked equal at START_RUN,
            :class:`medflare.common.preset_check.PresetCheck`). The algorithm's settings are the preset's ``fedst``
            section (``cds_lambda``, ``refresh_every``, ``generator_weights``: :class:`medflare.fedst.config.FedSTConfig`)
            and its ``diffusion`` section (:class:`medflare.fedst.config.DiffusionConfig`). Defaults "fedst", none, 0.
        generator_task / sample_task / train_task / validate_task: task names. Defaults "train_generator",
            "sample", "train", "validate".
        persistor_id, min_responses, task_timeout, task_check_period: see :class:`medflare.common.workflow.SiteRounds`.
    """

    variant = ""

    def __init__(
        self,
        num_rounds: int = 10,
        preset: str = "fedst",
        overrides: Mapping[str, Any] | None = None,
        seed: int = 0,
        generator_task: str = P.TRAIN_GENERATOR,
        sample_task: str = P.SAMPLE,
        train_task: str = P.TRAIN,
        validate_task: str = "validate",
        persistor_id: str = "persistor",
        min_responses: int = 0,
        task_timeout: int = 3600,
        task_check_period: float = 0.2,
    ):
        super().__init__(num_rounds=num_rounds, persistor_id=persistor_id, min_responses=min_responses,
                         task_timeout=task_timeout, task_check_period=task_check_period)
        keep_args(self, preset=preset, overrides=overrides or {}, seed=seed,
                  generator_task=generator_task, sample_task=sample_task, train_task=train_task, validate_task=validate_task)
        name = type(self).__name__
        cfg = get_preset(preset, overrides)
        if "diffusion" not in cfg:
            raise ConfigError(f"{name}: preset '{preset}' has no 'diffusion' section; FedST needs one (e.g. preset 'fedst')")
        self.fedst = FedSTConfig.from_preset(cfg)
        wanted = ((overrides or {}).get("fedst") or {}).get("rounds")
        if wanted is not None and wanted != num_rounds:
            raise ConfigError(f"{name}: the overrides set 'fedst.rounds' {wanted} but the workflow's 'num_rounds' is {num_rounds}; "
                              "set the rounds in one place (a job folder: num_rounds; a recipe or `medflare run`: fedst.rounds)")
        self.lam = self.fedst.cds_lambda
        self.refresh_every = self.fedst.refresh(self.variant)
        self.diffusion = DiffusionConfig.from_preset(cfg)
        self.key_metric = cfg["eval"]["key_metric"]
        if not persistor_id:
            raise ConfigError(f"{name}: 'persistor_id' must name the job's FedSTPersistor (it saves the style store / generator)")

    # ---- shared bookkeeping ------------------------------------------------------------------------
    def _start(self) -> None:
        model = self.load_model()
        if model is None:
            raise ConfigError(f"{type(self).__name__}: the persistor '{self.persistor_id}' returned no initial model")
        self.site_names = self.sites()
        meta = dict(model.meta or {})
        if list(meta.get(META_SITES, [])) != self.site_names:
            raise ConfigError(f"the persistor's site list {meta.get(META_SITES)} differs from the job's sites {self.site_names}")
        self.parts = unflatten(model.params)
        self.classes: dict[str, list[int]] = {s: list(v) for s, v in (meta.get(META_CLASSES) or {}).items()}
        self.image_size = meta.get(META_SIZE)
        self.image_size_of: dict[str, list[int]] = {}
        self.versions: dict[str, int] = dict(meta.get(META_VERSIONS) or {})
        self.held: dict[str, dict[str, int]] = {s: {} for s in self.site_names}  # site -> {generator: version it holds}
        self.ledger = comm.Ledger()
        self.metrics: dict[str, float] = {}

    def _meta(self, **extra: Any) -> dict[str, Any]:
        return {P.VARIANT: self.variant, P.SITES: self.site_names, P.CLASSES: self.classes, **extra}

    def _send(self, task: str, payloads: Mapping[str, FLModel], rnd: int, part: str) -> dict[str, FLModel]:
        """``exchange`` + the byte ledger (what each site received and sent, of which ``part``)."""
        results = self.exchange(task, payloads, rnd)
        for site, res in results.items():
            arrived = (res.meta or {}).get(WIRE_BYTES) or payload_bytes(res.params)  # a quantized diff: its bytes on the wire
            self.ledger.record(rnd, task, site, part, payload_bytes(payloads[site].params), int(arrived))
        return results

    def _note_site(self, site: str, res: FLModel) -> None:
        """Keep a site's label classes; refuse a federation whose sites' images differ in size."""
        summary = generator_summary(res)
        if "classes" in summary:
            self.classes[site] = [int(c) for c in np.asarray(summary["classes"]).reshape(-1)]
        if "image_size" in summary:
            self.image_size_of[site] = [int(v) for v in np.asarray(summary["image_size"]).reshape(-1)]
            sizes = {tuple(v) for v in self.image_size_of.values()} | ({tuple(self.image_size)} if self.image_size else set())
            if len(sizes) > 1:
                detail = ", ".join(f"{s}: {v[0]}x{v[1]}" for s, v in sorted(self.image_size_of.items()))
                raise ConfigError(f"the sites' images differ in size ({detail}{'; init_file: ' + str(self.image_size) if self.image_size else ''}); "
                                  "FedST's generators need one image size across the federation (resample the data)")
            self.image_size = self.image_size or list(self.image_size_of[site])

    def _weights(self, results: Mapping[str, FLModel], order: list[str]) -> list[float]:
        return [float((results[s].meta or {}).get(FLMetaKey.NUM_STEPS_CURRENT_ROUND, 1)) for s in order]

    def _fedavg(self, base: Mapping[str, np.ndarray], results: Mapping[str, FLModel], prefix: str) -> dict[str, np.ndarray]:
        """``base`` + the n_k-weighted mean of the sites' diffs under ``prefix``."""
        order = [s for s in self.site_names if s in results]
        diffs = [unflatten(results[s].params)[prefix] for s in order]
        return apply_diff(base, weighted_mean(diffs, self._weights(results, order)))

    def _model(self, metrics: Mapping[str, float] | None = None, rnd: int = 0) -> FLModel:
        """Everything the persistor saves, as one flat FULL model with its meta."""
        meta = {META_SITES: self.site_names, META_CLASSES: self.classes, META_SIZE: self.image_size, META_VERSIONS: self.versions,
                META_ROUND: rnd, META_METRICS: dict(metrics or {})}
        return FLModel(params_type=ParamsType.FULL, params=flatten(self.parts), meta=meta)

    def _segmentation_round(self, rnd: int, refresh: bool, sample_payload) -> None:
        """sample + train (Eq. 3) + FedAvg; best model saved when the sites' validation says so."""
        sent = self._model(rnd=rnd)  # what the sites validate this round
        if self.lam > 0:
            payloads = {s: FLModel(params_type=ParamsType.FULL, params=sample_payload(s), current_round=rnd,
                                   meta=self._meta(**{P.REFRESH: refresh, P.VERSIONS: self.versions})) for s in self.site_names}
            self._send(self.sample_task, payloads, rnd, "generator")
        payloads = {s: FLModel(params_type=ParamsType.FULL, params=flatten({P.SEG: self.parts[P.SEG]}), current_round=rnd,
                               total_rounds=self.rounds_in_job, meta=self._meta(**{P.CDS_LAMBDA: self.lam})) for s in self.site_names}
        results = self._send(self.train_task, payloads, rnd, "segmentation")
        if not results:
            return
        self._scored(results, sent, rnd)
        self.aggregate(results, lambda res: self._combine_segmentation(res, rnd))
        self.save_model(self._model(self.metrics, rnd + 1))
        self.report_round(rnd, self.rounds_in_job + 1, self.key_metric, {s: r.metrics or {} for s, r in results.items()})

    def _combine_segmentation(self, results: Mapping[str, FLModel], rnd: int) -> FLModel:
        self.parts[P.SEG] = self._fedavg(self.parts[P.SEG], results, P.SEG)
        return self._model(rnd=rnd + 1)

    def _scored(self, results: Mapping[str, FLModel], sent: FLModel, rnd: int) -> None:
        """Mean (n_k-weighted) validation metrics of the model sent this round; publish and save it if the best."""
        order = [s for s in self.site_names if s in results and results[s].metrics]
        if not order:
            return
        weights = np.asarray(self._weights(results, order))
        names = sorted(set.intersection(*(set(results[s].metrics) for s in order)))
        self.metrics = {k: float(np.average([results[s].metrics[k] for s in order], weights=weights)) for k in names}
        self.info(f"round {rnd}: validation of the global segmentation model, mean over sites: "
                  + ", ".join(f"{k}={v:.4f}" for k, v in self.metrics.items()))
        value = self.metrics.get(self.key_metric, -np.inf)
        sent.meta[META_METRICS] = dict(self.metrics)
        if self.offer_best(value, sent):  # the persistor writes the best file
            self.info(f"round {rnd}: new best mean validation {self.key_metric} {value:.4f}")

    def _finish(self, rnd: int) -> None:
        self.summary.start()  # the final model's validation: the summary's last line
        payloads = {s: FLModel(params_type=ParamsType.FULL, params=flatten({P.SEG: self.parts[P.SEG]}), current_round=rnd,
                               meta=self._meta()) for s in self.site_names}
        results = self._send(self.validate_task, payloads, rnd, "evaluation")
        if results:
            order = [s for s in self.site_names if s in results]
            weights = self._weights(results, order)
            names = sorted(set.intersection(*(set(results[s].metrics or {}) for s in order)))
            final = {k: float(np.average([results[s].metrics[k] for s in order], weights=weights)) for k in names}
            self.info("final segmentation model, mean over sites: " + ", ".join(f"{k}={v:.4f}" for k, v in final.items()))
            model = self._model(final, rnd)
            if self.offer_best(final.get(self.key_metric, -np.inf), model):  # judged like every round's (issue 32)
                self.info(f"the final model is the best (mean validation {self.key_metric} {self.best_value:.4f})")
            self.save_model(model)
            self.report_round(rnd, self.rounds_in_job + 1, self.key_metric, {s: results[s].metrics or {} for s in order})
        self._write_ledger()

    def predicted_generator_bytes(self) -> int:
        raise NotImplementedError

    def _write_ledger(self) -> None:
        seg_bytes = nbytes(self.parts[P.SEG])
        summary = {
            "variant": self.variant, "sites": len(self.site_names), "segmentation_rounds": self.num_rounds,
            "generator_bytes_each": self.generator_size(), "segmentation_bytes_each": seg_bytes,
            "measured_generator_bytes": self.ledger.total("generator"),
            "predicted_generator_bytes": self.predicted_generator_bytes(),
            "measured_segmentation_bytes": self.ledger.total("segmentation"),
            "predicted_segmentation_bytes": comm.segmentation_bytes(len(self.site_names), self.num_rounds, seg_bytes),
            "measured_total_bytes": self.ledger.total(),
            **self.cost_terms(),
        }
        path = os.path.join(self.get_app_dir(), LEDGER_FILE)
        self.ledger.write(path, summary)
        self.info(f"communication: generator {summary['measured_generator_bytes']} B measured vs {summary['predicted_generator_bytes']} B "
                  f"predicted; segmentation {summary['measured_segmentation_bytes']} B vs {summary['predicted_segmentation_bytes']} B -> {path}")

    def generator_size(self) -> int:
        raise NotImplementedError

    def cost_terms(self) -> dict[str, Any]:
        return {}

    @property
    def rounds_in_job(self) -> int:
        return self.num_rounds


class FedSTSeparateController(FedSTController):
    """FedST-separate: every site trains its own generator and uploads it once to the style store, which the
    server keeps (persisted with the job) and shares with every site; segmentation by FedAvg with Eq. 3.

    Round 0 starts with ``train_generator`` at every site not yet in the store (``diffusion.warmup_steps`` local
    steps; FULL weights up). With ``fedst.refresh_every`` > 0 the sites keep training their generators
    (``refresh_every * diffusion.steps_per_round`` steps between uploads) and re-upload them every ``refresh_every``
    rounds; the refreshed store goes out again and the sites redraw their synthetic images (Fig. 9d). A site
    receives only the generators of other sites that changed since it last got them.

    Args: see :class:`FedSTController` (``fedst.refresh_every`` null means 0 here: upload once, as in the paper).
    """

    variant = "separate"

    def _store(self) -> dict[str, dict[str, np.ndarray]]:
        return {s: self.parts[P.store_prefix(i)] for i, s in enumerate(self.site_names) if P.store_prefix(i) in self.parts}

    def run(self) -> None:
        self._start()
        self.info(f"FedST-separate: sites {self.site_names}, {self.num_rounds} rounds, lambda {self.lam}, refresh every "
                  f"{self.refresh_every or 'never'}")
        for rnd in range(self.num_rounds):
            self.start_round(rnd, self.num_rounds)
            refresh = rnd == 0 or (self.refresh_every > 0 and rnd % self.refresh_every == 0)
            upload = [s for s in self.site_names if s not in self.versions] if rnd == 0 else (self.site_names if refresh else [])
            if upload:
                steps = self.diffusion.warmup_steps if rnd == 0 else self.refresh_every * self.diffusion.steps_per_round
                self._collect_generators(upload, steps, rnd)
            if self.abort_signal.triggered:
                return
            self._segmentation_round(rnd, refresh, self._store_payload)
        self._finish(self.num_rounds)
        self.info(f"FedST-separate finished: style store of {sorted(self._store())} in {self.get_app_dir()}")

    def _collect_generators(self, sites: list[str], steps: int, rnd: int) -> None:
        payloads = {s: FLModel(params_type=ParamsType.FULL, params={}, current_round=rnd, meta=self._meta(**{P.STEPS: steps}))
                    for s in sites}
        results = self._send(self.generator_task, payloads, rnd, "generator")
        for site, res in results.items():
            generator = unflatten(res.params or {}).get(P.GEN)
            if generator is None:
                raise PayloadError(f"round {rnd}: site '{site}' sent no generator ('{P.GEN}.' weights)")
            self._note_site(site, res)
            self.parts[P.store_prefix(self.site_names.index(site))] = generator
            self.versions[site] = rnd
            self.info(f"round {rnd}: style store <- generator of '{site}' ({nbytes(generator)} B, classes {self.classes.get(site)}, "
                      f"L_simple {generator_summary(res).get('loss_mean')})")
        missing = [s for s in self.site_names if s not in self.versions]
        if missing:
            raise PayloadError(f"round {rnd}: the style store lacks the generator(s) of {missing}; every site must share one")
        self.save_model(self._model(self.metrics, rnd))

    def _store_payload(self, site: str) -> dict[str, np.ndarray]:
        """The other sites' generators this site does not hold in their current version."""
        new = {}
        for i, other in enumerate(self.site_names):
            if other != site and self.held[site].get(other) != self.versions[other]:
                new[P.store_prefix(i)] = self.parts[P.store_prefix(i)]
                self.held[site][other] = self.versions[other]
        return flatten(new)

    def generator_size(self) -> int:
        store = self._store()
        return nbytes(next(iter(store.values()))) if store else 0

    def predicted_generator_bytes(self) -> int:
        return comm.separate_generator_bytes(len(self.site_names), self.generator_size(), comm.store_shares(self.num_rounds, self.refresh_every))

    def cost_terms(self) -> dict[str, Any]:
        return {"store_shares": comm.store_shares(self.num_rounds, self.refresh_every)}


class FedSTJoinController(FedSTController):
    """FedST-join: one generator with a domain vector, trained by FedAvg across sites; segmentation by FedAvg with Eq. 3.

    Every round starts with ``train_generator``: each site receives the global generator (FULL), trains it on its own
    images with its own one-hot domain vector and returns the WEIGHT_DIFF; the server averages the diffs (see below).
    The round's ``diffusion.steps_per_round`` steps are split into exchanges of ``diffusion.sync_steps`` local steps,
    each one ``train_generator`` task and one averaging (:func:`~medflare.fedst.diffusion.exchange_steps`; 0 = one
    exchange per round, the paper's schedule): with many local steps under its constant domain vector a site's style
    goes into the shared layers and the average draws the mean style for every vector, unless the sites' local steps
    keep the other domains' predictions (``diffusion.keep_other_domains``, the presets' choice: one exchange per round).
    With ``diffusion.sync_layers`` "domain" the exchanges inside a round move only the domain modulation
    (:func:`~medflare.fedst.diffusion.exchange_plan`). The first
    ``diffusion.warmup_rounds`` rounds train only the generator; the ``num_rounds`` segmentation rounds follow.
    Sites draw cross-domain images by switching the domain vector; they redraw them every ``fedst.refresh_every``
    segmentation rounds (0 = draw once).

    The generator's diffs are averaged entry by entry over the sites that changed the entry
    (:func:`~medflare.fedst.conditioning.participation_mean`): the domain module's column for site k is trained only
    at site k and keeps its whole update, where plain FedAvg (the paper's and the reference code's choice) would shrink it
    to n_k / n of it every round.

    Args: see :class:`FedSTController` (``fedst.refresh_every`` null means 2 here; ``fedst.generator_weights``: "equal",
    every site's domain counts the same in the shared layers, or "cases", weighted by the sites' training cases as the
    segmentation model).
    """

    variant = "join"

    @property
    def rounds_in_job(self) -> int:
        return self.diffusion.warmup_rounds + self.num_rounds

    def plan(self, rnd: int) -> list[tuple[int, str, str]]:
        """(local steps, part down, part up) of each generator exchange in round ``rnd``: a generator-only round
        splits its steps by ``diffusion.warmup_sync_steps`` where set (:func:`~medflare.fedst.diffusion.exchange_plan`)."""
        return exchange_plan(self.diffusion, warmup=rnd < self.diffusion.warmup_rounds)

    def run(self) -> None:
        self._start()
        self.copies: dict[str, dict[str, np.ndarray] | None] = {}  # quantized exchanges: the generator each site holds
        warmup = self.diffusion.warmup_rounds
        self.info(f"FedST-join: sites {self.site_names}, {warmup} generator rounds + {self.num_rounds} rounds, lambda {self.lam}, "
                  f"refresh every {self.refresh_every or 'never'}")
        for rnd in range(self.rounds_in_job):
            self.start_round(rnd, self.rounds_in_job)
            if not self._train_generator(rnd):
                return
            if rnd < warmup:
                self.save_model(self._model(self.metrics, rnd + 1))
                self.report_round(rnd, self.rounds_in_job + 1, self.key_metric, {})  # a generator round: no scores yet
                continue
            seg_round = rnd - warmup
            refresh = seg_round == 0 or (self.refresh_every > 0 and seg_round % self.refresh_every == 0)
            self._segmentation_round(rnd, refresh, lambda site, rnd=rnd: self._sample_payload(site, rnd))
        self._finish(self.rounds_in_job)
        self.info(f"FedST-join finished: generator and segmentation model in {self.get_app_dir()}")

    def _train_generator(self, rnd: int) -> bool:
        """Round ``rnd``'s generator exchanges (none where :meth:`plan` is empty); False when no site answered."""
        plan = self.plan(rnd)
        if not plan:
            return True
        for exchange, (steps, down, up) in enumerate(plan):
            payloads, pending = {}, {}
            for s in self.site_names:
                params, params_type, pending[s] = self._download(s, down)
                payloads[s] = FLModel(params_type=params_type, params=flatten({P.GEN: params}), current_round=rnd,
                                      meta=self._meta(**{P.STEPS: steps, P.EXCHANGE: exchange, P.EXCHANGES: len(plan),
                                                         P.UPLOAD: up}))
            results = self._send(self.generator_task, payloads, rnd, "generator")
            for s in self.site_names:  # a site that answered holds what was sent; one that did not gets it whole next time
                self.copies[s] = pending[s] if s in results else None
            if not results:
                return False
            for site, res in results.items():
                self._note_site(site, res)
            self.parts[P.GEN] = self._combine_generator(results, up)
        losses = {s: generator_summary(r).get("loss_mean") for s, r in results.items()}
        self.info(f"round {rnd}: join generator averaged over {sorted(results)} {len(plan)} time(s) "
                  f"({self.diffusion.sync_layers} layers, {self.diffusion.exchange_dtype}); "
                  f"mean L_simple per site in the last exchange {losses}")
        return True

    def _download(self, site: str, part: str) -> tuple[dict[str, np.ndarray], ParamsType, dict[str, np.ndarray] | None]:
        """What goes down to ``site`` of the generator's ``part``, as (params, FULL | DIFF, the site's copy once it has it).

        With a quantized ``diffusion.exchange_dtype``: the global generator minus the site's copy, quantized (the copy
        then holds the last rounding, so the next diff sends it again: error feedback without a residual), or, to a
        site the server holds no copy of, the whole generator in float16. With a float one: ``part`` as it travels
        (no copy is kept)."""
        bits, glob, copy = quantized_bits(self.diffusion.exchange_dtype), self.parts[P.GEN], self.copies.get(site)
        if bits is None:
            return self._on_the_wire(select_entries(glob, part)), ParamsType.FULL, None
        if copy is None:
            sent = self._on_the_wire(glob)
            return sent, ParamsType.FULL, {k: np.asarray(v, np.float32) for k, v in sent.items()}
        wanted = select_entries(glob, part)
        sent = encode({k: np.asarray(v, np.float32) - copy[k] for k, v in wanted.items()}, bits)
        got = decode(sent, bits)
        return sent, ParamsType.DIFF, {**copy, **{k: copy[k] + got[k] for k in got}}

    def _sample_payload(self, site: str, rnd: int) -> dict[str, np.ndarray]:
        """What the ``sample`` task carries to ``site``: nothing in a round that trains the generator (the site samples
        with the generator of the round's last exchange); in a round that does not (``diffusion.segmentation_steps``
        0), the finished generator, to a site that does not hold it yet (the same bookkeeping as FedST-separate's store)."""
        version = max((r for r in range(rnd) if self.plan(r)), default=-1)  # the round that last trained it
        if self.plan(rnd) or self.held[site].get(P.GEN) == version:
            return {}
        self.held[site][P.GEN] = version
        self.info(f"round {rnd}: the finished join generator goes to '{site}' for sampling")
        return flatten({P.GEN: self._on_the_wire(self.parts[P.GEN])})

    def _combine_generator(self, results: Mapping[str, FLModel], part: str = ALL) -> dict[str, np.ndarray]:
        """The global generator plus the per-entry mean of the sites' diffs of ``part`` ("all" | "domain": the other
        entries stay as they are)."""
        order = [s for s in self.site_names if s in results]
        weights = self._weights(results, order) if self.fedst.generator_weights == "cases" else [1.0] * len(order)
        diffs = [unflatten(results[s].params).get(P.GEN, {}) for s in order]
        want = select_entries(self.parts[P.GEN], part)
        for site, diff in zip(order, diffs):
            if set(diff) != set(want):
                raise PayloadError(f"site '{site}' sent a generator diff of {len(diff)} entries where the exchange asked for "
                                   f"the {part!r} part ({len(want)} entries)")
        return {**self.parts[P.GEN], **apply_diff(want, participation_mean(diffs, weights))}

    def _on_the_wire(self, state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The whole generator (or ``state``'s part of it) as it travels when sent whole: in ``diffusion.exchange_dtype``,
        float16 where that is a quantized type (the server keeps float32)."""
        return in_exchange_dtype(state, float_exchange_dtype(self.diffusion.exchange_dtype))

    def _exchange_bytes(self, part: str) -> int:
        """Bytes of one transfer of ``part`` in an exchange: sent whole, or as a quantized diff."""
        state, bits = select_entries(self.parts[P.GEN], part), quantized_bits(self.diffusion.exchange_dtype)
        return encoded_bytes(state, bits) if bits else nbytes(self._on_the_wire(state))

    def generator_size(self) -> int:
        return self._exchange_bytes(ALL)

    def full_generator_size(self) -> int:
        """Bytes of the whole generator sent whole (a site's first download, the finished one for sampling)."""
        return nbytes(self._on_the_wire(self.parts[P.GEN]))

    @property
    def exchanges_in_job(self) -> int:
        """Generator exchanges (download + diff upload per site) in the whole job: ``diffusion.sync_steps`` splits a round
        (``warmup_sync_steps`` a generator-only one)."""
        return sum(len(self.plan(rnd)) for rnd in range(self.rounds_in_job))

    @property
    def partial_exchanges_in_job(self) -> int:
        """Of :attr:`exchanges_in_job`, those that move only the domain modulation (``diffusion.sync_layers`` "domain":
        all but one per round; the round's first and last exchanges together move the whole generator once each way)."""
        return self.exchanges_in_job - self.rounds_in_job if self.diffusion.sync_layers == DOMAIN else 0

    def domain_size(self) -> int:
        return self._exchange_bytes(DOMAIN)

    @property
    def final_downloads_in_job(self) -> int:
        """1 where the segmentation rounds exchange no generator and sample from it (the finished one goes down once)."""
        return int(self.lam > 0 and self.num_rounds > 0 and not self.plan(self.rounds_in_job - 1))

    def predicted_generator_bytes(self) -> int:
        partial = self.partial_exchanges_in_job
        return comm.join_generator_bytes(len(self.site_names), self.exchanges_in_job - partial, self.generator_size(), partial,
                                         self.domain_size(), self.final_downloads_in_job, self.full_generator_size())

    def cost_terms(self) -> dict[str, Any]:
        c, m, g = len(self.site_names), self.exchanges_in_job, self.generator_size()
        return {"generator_rounds": self.rounds_in_job, "generator_exchanges": m, "sync_layers": self.diffusion.sync_layers,
                "domain_only_exchanges": self.partial_exchanges_in_job, "domain_bytes_each": self.domain_size(),
                "final_downloads": self.final_downloads_in_job,
                "exchange_dtype": self.diffusion.exchange_dtype,
                "paper_join_bytes": comm.paper_join_bytes(c, m, g),
                "separate_bytes_same_sites": comm.separate_generator_bytes(c, nbytes(self.parts[P.GEN])),  # sent in float32
                "eq4_join_cheaper": comm.eq4_join_cheaper(m, c)}
