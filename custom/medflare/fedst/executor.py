"""FedST's site side: three FLARE executors, one per kind of work, handing results over through the site's own folder.

- :class:`GeneratorTrainingExecutor` (task ``train_generator``): trains the style generator with L_simple (Eq. 2)
  on the site's real images and label maps. FedST-separate: the site's own generator, sent as WEIGHTS (the server
  puts it into the style store). FedST-join: the received global generator with this site's one-hot domain
  vector, sent back as a WEIGHT_DIFF (FedAvg on the server). Its Adam state stays at the site, one optimiser per
  site and process: nothing of it is sent, and no other site's training touches it (the reference code shares
  one optimiser between simulated clients).
- :class:`StyleSamplingExecutor` (task ``sample``): keeps the generators it receives (the style store's, or the
  join generator the training executor received), picks another domain at random each round, and draws images
  in that domain's style from this site's own training label maps, cached per domain and redrawn on the
  server's refresh rounds. The images stay at the site.
- :class:`SegmentationExecutor` (tasks ``train``, ``validate``): FedAvg segmentation with Eq. 3: the loss on real
  images plus lambda times the loss on this round's synthetic images; sends the WEIGHT_DIFF.

Every handler logs to TensorBoard: losses, seconds, bytes received/sent, and every round the synthetic images
next to their label maps and the segmentation model's prediction on them.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from nvflare.apis.dxo import DXO, DataKind, MetaKey
from nvflare.apis.fl_constant import FLContextKey, FLMetaKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.utils.fl_model_utils import FLModelUtils

from medflare import ConfigError, DataError, PayloadError
from medflare.common.component import keep_args
from medflare.common.egress import site_reply
from medflare.common.payload import check_finite, flatten, load_numpy_state, payload_bytes, state_to_numpy, unflatten, weight_diff
from medflare.common.quantize import decode, encoded_bytes
from medflare.common.site_executor import SiteExecutor, format_metrics
from medflare.common.training import local_work, make_loader, make_loss, make_optimizer, round_optimizer, train_epochs
from medflare.data.util import stable_seed
from medflare.fedst import protocol as P
from medflare.fedst.cache import JOIN_KEY, SiteStyleCache
from medflare.fedst.config import DiffusionConfig
from medflare.fedst.diffusion import (ALL, build_style_generator, cycle, float_exchange_dtype, frozen_copy, generator_args, generator_optimizer,
                                      in_exchange_dtype, is_domain_entry, proximal_anchor, quantized_bits, sample_images, sampling_scheduler, select_entries,
                                      train_generator, training_scheduler)
from medflare.fedst.losses import CrossDomainTerm
from medflare.fedst.visual import synthetic_panel
from medflare.metrics import overlay_image

CACHE_FOLDER = "fedst_site"


class FedSTSiteExecutor(SiteExecutor):
    """What FedST's executors share: the site's label maps, classes and image size, its cache folder, the diffusion settings.

    Args: see :class:`medflare.common.site_executor.SiteExecutor` (preset default "fedst"; its ``diffusion``
    section configures the generator, see :mod:`medflare.fedst.diffusion`).
    """

    def __init__(self, *args, preset: str = "fedst", **kwargs):
        super().__init__(*args, preset=preset, **kwargs)
        self.cache: SiteStyleCache | None = None

    def setup(self, fl_ctx: FLContext) -> None:
        if self.data.task != "segmentation":
            raise ConfigError(f"FedST trains segmentation models; preset '{self.preset}' is {self.data.task}")
        if "diffusion" not in self.cfg:
            raise ConfigError(f"preset '{self.preset}' has no 'diffusion' section; FedST needs one (e.g. preset 'fedst')")
        self.diffusion = DiffusionConfig.from_preset(self.cfg)
        expected = int(self.cfg["model"]["args"].get("in_channels", 1))
        if self.data.in_channels != expected:
            raise DataError(f"site '{self.site}': images have {self.data.in_channels} channel(s), preset '{self.preset}' expects {expected}")
        shapes = {}
        for i in range(len(self.data.train)):
            shapes.setdefault(tuple(self.data.train[i]["label"].shape[-2:]), self.data.train[i]["name"])
        if len(shapes) != 1:
            raise DataError(f"site '{self.site}': training images differ in size ({', '.join(f'{n}: {s[0]}x{s[1]}' for s, n in shapes.items())}); "
                            "FedST's generator needs one image size per federation")
        self.image_size = list(next(iter(shapes)))
        self.train_labels = torch.stack([self.data.train[i]["label"] for i in range(len(self.data.train))])
        self.classes = sorted(int(c) for c in torch.unique(self.train_labels))
        root = fl_ctx.get_prop(FLContextKey.APP_ROOT) or "."
        self.cache = SiteStyleCache(Path(root) / CACHE_FOLDER)

    def generator_args(self, num_domains: int) -> dict:
        return generator_args(self.diffusion, self.data.in_channels, self.data.num_classes, num_domains)

    def log_bytes(self, fl_ctx: FLContext, task: str, incoming: FLModel, outgoing, rnd: int, sent_bytes: int | None = None) -> None:
        """Bytes this site received and sent in ``task`` this round, to TensorBoard (``comm/<task>_*_bytes``);
        ``sent_bytes``: what ``outgoing`` will be on the wire where a job filter compresses it."""
        sent = payload_bytes(outgoing or {}) if sent_bytes is None else sent_bytes
        self.tracker.scalars(fl_ctx, {f"comm/{task}_received_bytes": payload_bytes(incoming.params or {}),
                                      f"comm/{task}_sent_bytes": sent}, rnd)


def _receive(shareable: Shareable, site: str) -> tuple[FLModel, dict, list[str], int]:
    """The task's FLModel, its meta, the job's site list and the round; PayloadError if this site is not in the list."""
    incoming = FLModelUtils.from_shareable(shareable)
    meta = incoming.meta or {}
    sites = list(meta.get(P.SITES) or [])
    if site not in sites:
        raise PayloadError(f"site '{site}' is not in the server's site list {sites}")
    variant = meta.get(P.VARIANT)
    if variant not in P.VARIANTS:
        raise PayloadError(f"unknown FedST variant {variant!r} in the task meta (known: {list(P.VARIANTS)})")
    return incoming, meta, sites, int(incoming.current_round or 0)


class GeneratorTrainingExecutor(FedSTSiteExecutor):
    """Trains the style generator on this site's images and label maps (see the module docstring).

    Args: those of :class:`FedSTSiteExecutor`; ``task_name`` (default "train_generator"); ``curve_every``: generator
    steps per point of the ``generator/loss_curve`` TensorBoard series (default 10).
    """

    def __init__(self, *args, task_name: str = P.TRAIN_GENERATOR, curve_every: int = 10, **kwargs):
        super().__init__(*args, **kwargs)
        keep_args(self, task_name=task_name, curve_every=curve_every)
        self.register_task(task_name, self.train)
        self.generator = None
        self.steps_done = 0
        self.base: dict | None = None  # FedST-join: what this site last received of each generator entry
        self.anchor: dict | None = None  # FedST-join: the shared layers last received (diffusion.prox_mu)
        self.reference = None  # FedST-join: a frozen copy of the whole generator last received (diffusion.keep_other_domains)

    def _build(self, num_domains: int) -> None:
        if self.generator is not None and self.generator.num_domains == num_domains:
            return
        torch.manual_seed(self.seed)
        self.generator = build_style_generator(self.generator_args(num_domains)).to(self.torch_device)
        self.generator.check_size(*self.image_size, who=f"site '{self.site}'")
        self.optimizer = generator_optimizer(self.generator, self.diffusion)  # this site's own
        self.scheduler = training_scheduler(self.diffusion)

    def _receive_generator(self, received: dict, diff: bool = False) -> dict:
        """Load the join generator's entries the server sent: all of them (the whole generator; it becomes the anchor of
        ``diffusion.prox_mu``'s term) or only the domain modulation's (``diffusion.sync_layers`` "domain": the site keeps
        its own shared layers). ``diff``: the server sent them as a quantized diff from what this site last received
        (``diffusion.exchange_dtype`` "int8" / "int4"). Returns what this site last received of every entry, the base
        of its next diff."""
        if diff:
            bits = quantized_bits(self.diffusion.exchange_dtype)
            if bits is None:
                raise PayloadError(f"site '{self.site}': the server sent a diff of the join generator, but this site's "
                                   f"diffusion.exchange_dtype {self.diffusion.exchange_dtype!r} sends whole generators")
            if self.base is None:
                raise PayloadError(f"site '{self.site}': the server sent a diff of the join generator before the whole one "
                                   f"(this site holds none to add it to); it sends the whole one next time")
            change = decode(received, bits)
            unknown = sorted(set(change) - set(self.base))
            if unknown:
                raise PayloadError(f"site '{self.site}': the server's generator diff has entries this site does not hold: {unknown[:5]}")
            received = {k: np.asarray(self.base[k], np.float32) + v for k, v in change.items()}
        own = state_to_numpy(self.generator)
        if set(received) != set(own):
            extra = sorted(k for k in received if k not in own or not is_domain_entry(k))
            if extra or self.base is None:
                raise PayloadError(f"site '{self.site}': the server sent a part of the join generator that is not its domain "
                                   f"modulation ({extra[:5]}) or before the whole generator ({len(received)} of {len(own)} entries)")
            load_numpy_state(self.generator, {**own, **received}, who="server (join generator's domain modulation)")
            return {**self.base, **received}
        load_numpy_state(self.generator, received, who="server (join generator)")
        self.anchor = proximal_anchor(self.generator) if self.diffusion.prox_mu > 0 else None
        self.reference = frozen_copy(self.generator) if self.diffusion.keep_other_domains > 0 else None
        return dict(received)

    def train(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        incoming, meta, sites, rnd = _receive(shareable, self.site)
        join = meta[P.VARIANT] == "join"
        exchange = int(meta.get(P.EXCHANGE, 0))  # FedST-join: several exchanges per round get their own batches and noise
        self._build(len(sites) if join else 0)
        sent, upload = None, str(meta.get(P.UPLOAD, ALL))
        if join:
            received = unflatten(incoming.params or {}).get(P.GEN)
            if received is None:
                raise PayloadError(f"site '{self.site}': the join task carries no generator ('{P.GEN}.' weights)")
            self.base = self._receive_generator(received, diff=incoming.params_type == ParamsType.DIFF)
            if exchange == int(meta.get(P.EXCHANGES, 1)) - 1:  # only the round's last one: each would overwrite the last
                self.cache.put_generator(JOIN_KEY, self.base, rnd)  # the sampler draws with the latest global generator of this round
            sent = self.base
        steps = int(meta.get(P.STEPS, self.diffusion.steps_per_round))
        batch = self.diffusion.batch_size
        batches = cycle(lambda epoch: make_loader(self.data.train, batch, True, seed=stable_seed("fedst-gen", self.seed, rnd, exchange, epoch)))
        tic = time.perf_counter()
        losses = train_generator(
            self.generator, self.scheduler, self.optimizer, batches, steps, domain_index=sites.index(self.site) if join else None,
            loss=self.diffusion.loss, device=self.torch_device, seed=stable_seed("fedst-noise", self.seed, self.site, rnd, exchange),
            should_stop=lambda: abort_signal.triggered, prox_mu=self.diffusion.prox_mu if join else 0.0, anchor=self.anchor if join else None,
            keep_other_domains=self.diffusion.keep_other_domains if join else 0.0, reference=self.reference if join else None,
        )
        seconds = time.perf_counter() - tic
        every = max(1, self.curve_every)
        for start in range(0, len(losses), every):
            chunk = losses[start:start + every]
            self.tracker.scalars(fl_ctx, {"generator/loss_curve": float(np.mean(chunk))}, self.steps_done + start + len(chunk))
        self.steps_done += len(losses)
        summary = {"first": losses[0], "last": losses[-1], "mean": float(np.mean(losses))} if losses else {}
        self.tracker.scalars(fl_ctx, {"generator/loss": summary.get("mean", float("nan")), "time/generator_train_s": seconds,
                                      "time/generator_step_s": seconds / max(len(losses), 1)}, rnd)
        self.log_info(fl_ctx, f"round {rnd}: generator trained {len(losses)} steps in {seconds:.1f} s, L_simple "
                              f"{summary.get('first', float('nan')):.4f} -> {summary.get('last', float('nan')):.4f}")
        params = state_to_numpy(self.generator)
        dtype = float_exchange_dtype(self.diffusion.exchange_dtype)  # int8 / int4: quantized after the privacy scope
        out = flatten({P.GEN: in_exchange_dtype(weight_diff(select_entries(params, upload), sent), dtype) if join else params})
        check_finite(out, self.site)
        bits = quantized_bits(self.diffusion.exchange_dtype) if join else None
        self.log_bytes(fl_ctx, "train_generator", incoming, out, rnd, sent_bytes=encoded_bytes(out, bits) if bits else None)
        n = {FLMetaKey.NUM_STEPS_CURRENT_ROUND: len(self.data.train)}
        about = {"classes": np.asarray(self.classes, dtype=np.int64), "image_size": np.asarray(self.image_size, dtype=np.int64),
                 **{f"loss_{k}": float(v) for k, v in summary.items()}}
        generator = DXO(DataKind.WEIGHT_DIFF if join else DataKind.WEIGHTS, data=out, meta=n)
        return site_reply({P.PART_GENERATOR: generator}, lift={P.SUMMARY: DXO(DataKind.STATISTICS, data=about)}, unwrap=P.PART_GENERATOR,
                          meta=n, rnd=rnd)


class StyleSamplingExecutor(FedSTSiteExecutor):
    """Draws cross-domain images from this site's label maps with another domain's generator (see the module docstring).

    Args: those of :class:`FedSTSiteExecutor`; ``task_name`` (default "sample"); ``num_panels``: synthetic images
    shown in TensorBoard when a set is drawn (default 2).
    """

    def __init__(self, *args, task_name: str = P.SAMPLE, num_panels: int = 2, **kwargs):
        super().__init__(*args, **kwargs)
        keep_args(self, task_name=task_name, num_panels=num_panels)
        self.register_task(task_name, self.sample)

    def _available(self, domain: str, join: bool) -> bool:
        return self.cache.generator(JOIN_KEY if join else domain) is not None

    def choose_domain(self, sites: list[str], classes: dict, join: bool, rnd: int) -> str:
        """Another site whose generator this site holds and that was trained on every class of this site's labels."""
        others = [s for s in sites if s != self.site and self._available(s, join)]
        usable = [s for s in others if set(self.classes) <= set(classes.get(s, []))]
        if not usable:
            detail = ", ".join(f"{s}: {classes.get(s, 'no generator')}" for s in others) or "no other site's generator has arrived"
            raise DataError(f"site '{self.site}': no other domain's generator was trained on all of this site's label classes "
                            f"{self.classes} ({detail})")
        rng = np.random.default_rng(stable_seed("fedst-domain", self.seed, self.site, rnd))
        return usable[int(rng.integers(len(usable)))]

    def sample(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        incoming, meta, sites, rnd = _receive(shareable, self.site)
        join = meta[P.VARIANT] == "join"
        classes = {s: list(v) for s, v in (meta.get(P.CLASSES) or {}).items()}
        versions = {s: int(v) for s, v in (meta.get(P.VERSIONS) or {}).items()}
        for prefix, params in unflatten(incoming.params or {}).items():  # FedST-separate: new style-store entries
            if join and prefix == P.GEN:  # FedST-join whose generator trained only in the warm-up: the finished one, once
                self.cache.put_generator(JOIN_KEY, params, rnd)
                continue
            index = int(prefix.rpartition("_")[2])
            domain = sites[index]
            self.cache.put_generator(domain, params, versions.get(domain, rnd), classes.get(domain, []))
        domain = self.choose_domain(sites, classes, join, rnd)
        entry = self.cache.generator(JOIN_KEY if join else domain)
        cached = self.cache.synthetic(domain)
        drawn, seconds = 0, 0.0
        if cached is None or (meta.get(P.REFRESH) and cached["version"] != entry["version"]):
            tic = time.perf_counter()
            images, labels = self.draw(domain, sites, entry, classes.get(domain), join, rnd)
            seconds = time.perf_counter() - tic
            self.cache.put_synthetic(domain, images, labels, entry["version"], rnd)
            drawn = len(images)
            for i in range(min(self.num_panels, drawn)):
                real = self.data.train[self._subset(rnd)[i]]["image"]
                self.tracker.image(fl_ctx, f"synthetic/{domain}/case{i}", synthetic_panel(real, images[i], labels[i]), rnd)
            self.log_info(fl_ctx, f"round {rnd}: drew {drawn} images in the style of '{domain}' (generator of round "
                                  f"{entry['version']}) in {seconds:.1f} s")
        else:
            self.log_info(fl_ctx, f"round {rnd}: reusing the cached images in the style of '{domain}' (generator of round {cached['version']})")
        self.cache.set_current(domain, rnd)
        metrics = {"synthetic_drawn": float(drawn), "time/sample_s": seconds, "domain_index": float(sites.index(domain))}
        self.tracker.scalars(fl_ctx, {k if k.startswith("time/") else f"sampling/{k}": v for k, v in metrics.items()}, rnd)
        self.log_bytes(fl_ctx, "sample", incoming, {}, rnd)
        return FLModelUtils.to_shareable(FLModel(metrics=metrics, current_round=rnd))

    def _subset(self, rnd: int) -> list[int]:
        """Indices of the training label maps to draw from (all, or ``num_synthetic`` seeded ones)."""
        n, k = len(self.train_labels), self.diffusion.num_synthetic
        if not k or k >= n:
            return list(range(n))
        rng = np.random.default_rng(stable_seed("fedst-subset", self.seed, self.site, rnd))
        return sorted(rng.choice(n, size=k, replace=False).tolist())

    def draw(self, domain: str, sites: list[str], entry: dict, trained: list[int] | None, join: bool, rnd: int):
        """Images (N, C, H, W) in ``domain``'s style for this site's label maps (N, 1, H, W), and those label maps."""
        generator = build_style_generator(self.generator_args(len(sites) if join else 0))
        load_numpy_state(generator, {k: v.numpy() for k, v in entry["state"].items()}, who=f"the generator of '{domain}'")
        generator.to(self.torch_device)
        labels = self.train_labels[self._subset(rnd)]
        images = sample_images(
            generator, sampling_scheduler(self.diffusion), labels, domain_index=sites.index(domain) if join else None,
            trained_classes=trained, seed=stable_seed("fedst-sample", self.seed, self.site, domain, rnd),
            batch_size=self.diffusion.sample_batch, device=self.torch_device, who=f"site '{self.site}' drawing '{domain}'",
            guidance=self.diffusion.domain_guidance,
        )
        return images, labels


class SegmentationExecutor(FedSTSiteExecutor):
    """FedAvg segmentation with Eq. 3 on real and cached cross-domain synthetic images (see the module docstring).

    Args: those of :class:`FedSTSiteExecutor`; ``train_task`` / ``validate_task`` (defaults "train", "validate").
    The preset's ``train`` section sets epochs, batch size, lr, optimizer and the loss (``dicefocal``: focal + Dice).
    The model persists across rounds at the site, and its optimiser's state (Adam's moments) too unless
    ``train.optimizer_state`` is "fresh" (:func:`medflare.common.training.round_optimizer`).
    """

    def __init__(self, *args, train_task: str = P.TRAIN, validate_task: str = "validate", **kwargs):
        super().__init__(*args, **kwargs)
        keep_args(self, train_task=train_task, validate_task=validate_task)
        self.register_task(train_task, self.train)
        self.register_task(validate_task, self.score)

    def setup(self, fl_ctx: FLContext) -> None:
        super().setup(fl_ctx)
        train = self.cfg["train"]
        self.model = self.new_model()
        self.optimizer = make_optimizer(train["optimizer"], self.model.parameters(), train["lr"])
        self.loss_fn = make_loss(train["loss"], self.data.task)

    def _load(self, incoming: FLModel) -> dict:
        received = unflatten(incoming.params or {}).get(P.SEG)
        if received is None:
            raise PayloadError(f"site '{self.site}': the task carries no segmentation model ('{P.SEG}.' weights)")
        load_numpy_state(self.model, received, who="server (segmentation model)")
        return received

    def train(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        incoming, meta, sites, rnd = _receive(shareable, self.site)
        sent = self._load(incoming)
        tic = time.perf_counter()
        metrics = self.validate(self.model)
        self.tracker.scalars(fl_ctx, metrics, rnd, prefix="val_global/")
        self.log_overlays(fl_ctx, self.model, "val_global", rnd, incoming.total_rounds)
        self.log_info(fl_ctx, f"round {rnd}: global segmentation model on '{self.site}' validation: {format_metrics(metrics)}")
        validate_s = time.perf_counter() - tic

        lam = float(meta.get(P.CDS_LAMBDA, 0.0))
        train = self.cfg["train"]
        term, domain = None, None
        if lam > 0:
            syn = self.cache.current(self.site)
            domain = syn["domain"]
            dataset = [{"image": img, "label": lbl} for img, lbl in zip(syn["images"], syn["labels"])]
            batches = cycle(lambda epoch: make_loader(dataset, train["batch_size"], True, seed=stable_seed("fedst-syn", self.seed, rnd, epoch)))
            term = CrossDomainTerm(self.loss_fn, batches, lam, self.torch_device)
        self.optimizer = round_optimizer(self.optimizer, self.model, train)
        tic = time.perf_counter()
        stats = train_epochs(
            self.model, self.loader("train", shuffle=True, round_num=rnd), self.loss_fn, self.optimizer, **local_work(train),
            device=self.torch_device, extra_loss=term, should_stop=lambda: abort_signal.triggered,
        )
        train_s = time.perf_counter() - tic
        losses = {"train/loss_seg": stats.mean_loss, "time/seg_train_s": train_s, "time/validate_s": validate_s}
        if term is not None:
            losses["train/loss_cds"] = term.mean
            self.log_cross_domain(fl_ctx, syn, rnd)
        self.tracker.scalars(fl_ctx, losses, rnd)
        self.log_steps(fl_ctx, rnd, stats.steps, f"segmentation (lambda {lam}, synthetic style "
                              f"{domain or 'none'}), L_Seg {stats.mean_loss:.4f}, L_CDS {losses.get('train/loss_cds', float('nan')):.4f}, {train_s:.1f} s")
        diff = flatten({P.SEG: weight_diff(state_to_numpy(self.model), sent)})
        check_finite(diff, self.site)
        self.log_bytes(fl_ctx, "train", incoming, diff, rnd)
        n = {FLMetaKey.NUM_STEPS_CURRENT_ROUND: len(self.data.train)}
        return site_reply({P.PART_UPDATE: DXO(DataKind.WEIGHT_DIFF, data=diff, meta=n)},
                          lift={MetaKey.INITIAL_METRICS: DXO(DataKind.METRICS, data=dict(metrics))}, unwrap=P.PART_UPDATE, rnd=rnd)

    @torch.no_grad()
    def log_cross_domain(self, fl_ctx: FLContext, syn: dict, rnd: int) -> None:
        """This round's synthetic images | their label maps | the model's prediction on them, to TensorBoard."""
        self.model.eval()
        for i in range(min(self.num_overlays, len(syn["images"]))):
            image = syn["images"][i]
            pred = self.model(image[None].to(self.torch_device)).argmax(1).cpu()
            self.tracker.image(fl_ctx, f"cross_domain/{syn['domain']}/case{i}", overlay_image(image, syn["labels"][i], pred), rnd)

    def score(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        incoming, meta, sites, rnd = _receive(shareable, self.site)
        self._load(incoming)
        metrics = self.validate(self.model, "val")
        self.tracker.scalars(fl_ctx, metrics, rnd, prefix="val_global/")  # the validation curve's last point: the final model
        metrics.update({f"test_{k}": v for k, v in self.validate(self.model, "test").items()})
        self.tracker.scalars(fl_ctx, metrics, rnd, prefix="final/")
        self.log_info(fl_ctx, f"final segmentation model on '{self.site}': {format_metrics(metrics)}")
        return FLModelUtils.to_shareable(FLModel(metrics=metrics, current_round=rnd,
                                                 meta={FLMetaKey.NUM_STEPS_CURRENT_ROUND: len(self.data.train)}))
