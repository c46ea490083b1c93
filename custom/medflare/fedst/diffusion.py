"""FedST's style transfer generator: a label-map-conditioned diffusion model built from MONAI's generative parts.

Plain torch + MONAI, no FLARE. The denoiser is MONAI's ``DiffusionModelUNet``; noise is added and removed by
MONAI's schedulers (``DDPMScheduler`` for training, ``DDIMScheduler`` / ``DDPMScheduler`` for sampling, or
``RFlowScheduler`` for rectified flow) through ``DiffusionInferer`` in its ``"concat"`` mode, which puts the
encoded label map next to the noisy image (Palette, the paper's generator; see :mod:`.conditioning`).

Training objective, Eq. 2 of the paper (``L_simple``)::

    E_(x,y) E_eps E_t || f_theta([sqrt(abar_t) y + sqrt(1 - abar_t) eps, x], t) - eps ||^2

with y the image (scaled to [-1, 1]), x the encoded label map and t a uniformly drawn timestep
(:func:`simple_loss`). Every function here takes the typed ``diffusion`` section,
:class:`medflare.fedst.config.DiffusionConfig` (each key's meaning and default there), which a component builds once
from its preset.
"""

from __future__ import annotations

import copy
from functools import partial
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from monai.inferers import DiffusionInferer
from monai.networks.nets import DiffusionModelUNet
from monai.networks.nets.diffusion_model_unet import DiffusionUNetResnetBlock
from monai.networks.schedulers import DDIMScheduler, DDPMScheduler, RFlowScheduler, Scheduler
from torch import nn

from medflare import ConfigError, DataError, MedflareError, PayloadError
from medflare.fedst.conditioning import DomainModulation, check_domain_vectors, domain_vectors, encode_labels, mixture_vectors
from medflare.fedst.config import QUANTIZED_DTYPES, DiffusionConfig

#: name prefix of the domain modulation's parameters in a :class:`StyleGenerator`'s state (FedST-join)
DOMAIN_PREFIX = "modulation."
ALL, DOMAIN = "all", "domain"


def exchange_steps(cfg: DiffusionConfig, warmup: bool = False) -> list[int]:
    """FedST-join: the local steps of each generator exchange in one round -- ``steps_per_round`` split into chunks
    of ``sync_steps`` (the last one shorter), or one exchange of all of them when ``sync_steps`` is 0. In a
    generator-only round (``warmup``, the first ``warmup_rounds``) the chunks are ``warmup_sync_steps`` where set:
    more averages while the domain modulation forms, when no segmentation bytes travel. A segmentation round trains
    ``segmentation_steps`` where set: none (no exchange) when it is 0."""
    steps = cfg.steps_per_round if warmup or cfg.segmentation_steps is None else cfg.segmentation_steps
    sync = cfg.warmup_sync_steps if warmup and cfg.warmup_sync_steps is not None else cfg.sync_steps
    if steps == 0:
        return []
    if sync == 0 or sync >= steps:
        return [steps]
    return [sync] * (steps // sync) + ([steps % sync] if steps % sync else [])


def exchange_plan(cfg: DiffusionConfig, warmup: bool = False) -> list[tuple[int, str, str]]:
    """FedST-join: ``(local steps, what goes down, what comes back up)`` for each generator exchange of a round, the
    parts being "all" (the whole generator) or "domain" (only its ``modulation.*`` entries).

    ``sync_layers`` "all": every exchange moves the whole generator both ways. "domain": the round's first exchange
    downloads the whole generator, its last uploads the whole diff, every other transfer is the domain modulation only;
    between them the site keeps its own shared layers (so the whole-generator diff of the last exchange covers the
    round's local steps on the shared layers). A round of one exchange moves the whole generator both ways.
    """
    steps = exchange_steps(cfg, warmup)
    if cfg.sync_layers == ALL:
        return [(n, ALL, ALL) for n in steps]
    last = len(steps) - 1
    return [(n, ALL if i == 0 else DOMAIN, ALL if i == last else DOMAIN) for i, n in enumerate(steps)]


def is_domain_entry(name: str) -> bool:
    """Whether a generator state entry belongs to the domain modulation (what ``sync_layers`` "domain" syncs)."""
    return name.startswith(DOMAIN_PREFIX)


def select_entries(state: Mapping[str, Any], part: str) -> dict[str, Any]:
    """The entries of a generator state that ``part`` ("all" | "domain") moves."""
    if part not in (ALL, DOMAIN):
        raise ValueError(f"unknown generator part {part!r} (known: {ALL!r}, {DOMAIN!r})")
    return dict(state) if part == ALL else {k: v for k, v in state.items() if is_domain_entry(k)}


def quantized_bits(dtype: str) -> int | None:
    """The bits of a quantized ``diffusion.exchange_dtype`` ("int8" -> 8, "int4" -> 4); None for a float type."""
    return QUANTIZED_DTYPES.get(dtype)


def float_exchange_dtype(dtype: str) -> str:
    """The float type a generator exchange holds before any quantization: ``dtype`` itself for a float type, float16
    for a quantized one (the whole generator travels in it; a site's diff is rounded to it, then quantized by the job's
    filter after the site's privacy scope; the server decodes diffs to it)."""
    return "float16" if quantized_bits(dtype) else dtype


def in_exchange_dtype(state: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    """The float entries of a generator state (or diff) cast to ``diffusion.exchange_dtype`` for the wire; integer
    entries as they are. The receiver casts back: ``load_numpy_state`` to the model's dtype, the server's
    ``apply_diff`` to the global generator's float32. A finite value beyond the target's range (float16: 65504) raises
    PayloadError naming the entries instead of travelling as inf, in both directions. An entry already in ``dtype``
    (float32, the default) is passed on as it is, neither copied nor scanned."""
    target, out, lost = np.dtype(dtype), {}, []
    for k, v in state.items():
        a = np.asarray(v)
        if np.issubdtype(a.dtype, np.floating):
            cast = a.astype(target, copy=False)
            if cast is not a and not np.isfinite(cast).all() and np.isfinite(a).all():
                lost.append(k)
            v = cast
        out[k] = v
    if lost:
        raise PayloadError(f"generator entries {lost[:5]} overflow diffusion.exchange_dtype {dtype!r}; set it to 'float32'")
    return out


def proximal_anchor(generator: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of the shared (non-domain) parameters: the w_global of ``diffusion.prox_mu``'s term."""
    return {n: p.detach().clone() for n, p in generator.named_parameters() if not is_domain_entry(n)}


def proximal_term(generator: nn.Module, anchor: Mapping[str, torch.Tensor], mu: float) -> torch.Tensor:
    """FedProx's ``mu / 2 * ||w - w_global||^2`` over the shared parameters named in ``anchor``."""
    params = dict(generator.named_parameters())
    return 0.5 * mu * sum(((params[n] - a) ** 2).sum() for n, a in anchor.items())


# ---- the network ---------------------------------------------------------------------------------
class _Modulate:
    """Forward hook applying one :class:`DomainModulation` to a residual block's output with the current domain.

    A callable object (not a closure) so that ``copy.deepcopy`` of a generator re-targets it to the copy.
    """

    def __init__(self, modulation: DomainModulation, slot: dict):
        self.modulation, self.slot = modulation, slot

    def __call__(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return self.modulation(output, self.slot["domain"])


class StyleGenerator(nn.Module):
    """Label-conditioned denoiser: MONAI ``DiffusionModelUNet`` on [noisy image, one-hot label map], optionally
    with a domain vector that modulates every residual block (FedST-join, Fig. 3).

    Args:
        image_channels: channels of the images it generates (1 for grey scale).
        num_classes: classes of the label maps it is conditioned on (background included).
        num_domains: length of the one-hot domain vector; 0 = no domain input (FedST-separate). Default 0.
        channels, num_res_blocks, attention_levels, norm_num_groups, num_head_channels: MONAI
            ``DiffusionModelUNet`` arguments (2D). Defaults: a small CPU-friendly UNet (those of
            :class:`medflare.fedst.config.GeneratorSettings`).
        domain_init_std: initial weight std of the domain modulation (:class:`DomainModulation`). Default 0.02, the
            setting's: :func:`generator_args` always passes it; the default serves files saved before the setting.

    ``forward(x, timesteps, context=None, domain=None)``: x (B, image_channels + num_classes, H, W) = noisy image
    then label channels (what ``DiffusionInferer`` passes in ``"concat"`` mode), timesteps (B,) or (1,), domain
    (B, num_domains) one-hot (required iff num_domains > 0) -> prediction (B, image_channels, H, W). H and W must
    be divisible by 2 ** (len(channels) - 1).
    """

    def __init__(
        self,
        image_channels: int,
        num_classes: int,
        num_domains: int = 0,
        channels: Sequence[int] = (16, 32, 32),
        num_res_blocks: int | Sequence[int] = 1,
        attention_levels: Sequence[bool] = (False, False, False),
        norm_num_groups: int = 8,
        num_head_channels: int | Sequence[int] = 8,
        domain_init_std: float = 0.02,
    ):
        super().__init__()
        for key, value, low in (("image_channels", image_channels, 1), ("num_classes", num_classes, 2), ("num_domains", num_domains, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"StyleGenerator: '{key}' must be an int >= {low}, got {value!r}")
        self.image_channels, self.num_classes, self.num_domains = image_channels, num_classes, num_domains
        self.levels = len(channels)
        try:
            self.unet = DiffusionModelUNet(
                spatial_dims=2, in_channels=image_channels + num_classes, out_channels=image_channels,
                channels=list(channels), num_res_blocks=num_res_blocks, attention_levels=list(attention_levels),
                norm_num_groups=norm_num_groups, num_head_channels=num_head_channels,
            )
        except (ValueError, TypeError) as e:
            raise ConfigError(f"StyleGenerator: bad 'diffusion.generator' settings: {e}") from e
        self._slot: dict[str, torch.Tensor | None] = {"domain": None}
        if num_domains:
            blocks = [m for m in self.unet.modules() if isinstance(m, DiffusionUNetResnetBlock)]
            self.modulation = nn.ModuleList(DomainModulation(num_domains, b.out_channels, domain_init_std) for b in blocks)
            for block, mod in zip(blocks, self.modulation):
                block.register_forward_hook(_Modulate(mod, self._slot))

    def check_size(self, height: int, width: int, who: str = "the generator") -> None:
        """ConfigError unless H and W are divisible by the UNet's total down-sampling."""
        factor = 2 ** (self.levels - 1)
        if height % factor or width % factor:
            raise ConfigError(f"{who}: images of {height}x{width} cannot pass a {self.levels}-level UNet; H and W must be multiples of {factor}")

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor | None = None,
                domain: torch.Tensor | None = None) -> torch.Tensor:
        if self.num_domains:
            if domain is None:
                raise ValueError(f"this generator is domain-conditioned ({self.num_domains} domains): pass a one-hot 'domain'")
            check_domain_vectors(domain, self.num_domains)
            self._slot["domain"] = domain.to(device=x.device, dtype=x.dtype)
        elif domain is not None:
            raise ValueError("this generator has no domain input (FedST-separate): 'domain' must be None")
        try:
            return self.unet(x, timesteps=timesteps, context=context)
        finally:
            self._slot["domain"] = None


def generator_args(cfg: DiffusionConfig, image_channels: int, num_classes: int, num_domains: int = 0) -> dict[str, Any]:
    """The full constructor arguments of a :class:`StyleGenerator` (what a saved file records)."""
    gen = cfg.generator
    return {"image_channels": int(image_channels), "num_classes": int(num_classes), "num_domains": int(num_domains),
            **{k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in gen.items()}}


def build_style_generator(args: Mapping[str, Any]) -> StyleGenerator:
    """A :class:`StyleGenerator` from :func:`generator_args`' dict."""
    return StyleGenerator(**dict(args))


def generator_optimizer(generator: StyleGenerator, cfg: DiffusionConfig) -> torch.optim.Adam:
    """A site's own Adam for the generator: ``diffusion.lr`` for the UNet, ``diffusion.domain_lr`` for the domain
    modulation of a domain-conditioned generator (FedST-join).

    Why two rates: at a site the domain vector never changes, so the site's style can be learnt either by its domain
    column or by the shared layers; what goes into the shared layers is averaged back towards the mean style by the
    server, only the domain column keeps it. A larger rate for the domain module favours the column. Measured
    (benchmarks/RESULTS_fedst.md): the rate alone does not make the federated generator separate the styles (10x and
    50x did not, with 40 local steps per average); averaging every few local steps (``sync_steps``) does, at either rate.
    """
    domain = [p for name, p in generator.named_parameters() if is_domain_entry(name)]
    shared = [p for name, p in generator.named_parameters() if not is_domain_entry(name)]
    groups = [{"params": shared, "lr": cfg.lr}] + ([{"params": domain, "lr": cfg.domain_lr}] if domain else [])
    return torch.optim.Adam(groups)


def frozen_copy(generator: nn.Module) -> nn.Module:
    """A detached, frozen copy of a generator (the reference of :func:`other_domain_term`)."""
    ref = copy.deepcopy(generator).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def other_domain_term(generator: StyleGenerator, reference: nn.Module, scheduler: Scheduler, images: torch.Tensor,
                      condition: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor, domain: torch.Tensor) -> torch.Tensor:
    """Mean squared difference between the generator's and ``reference``'s predictions for ``domain`` (another site's
    one-hot vectors) on the same noisy images and label maps: a site's local steps keep what the generator draws for
    the other domains, so its own style goes into its own domain column."""
    with torch.no_grad():
        target = noised_prediction(reference, scheduler, images, condition, noise, timesteps, domain)
    return F.mse_loss(noised_prediction(generator, scheduler, images, condition, noise, timesteps, domain), target)


def simple_and_other_domain_losses(generator: StyleGenerator, reference: nn.Module, scheduler: Scheduler, images: torch.Tensor,
                                   condition: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor, own: torch.Tensor,
                                   other: torch.Tensor, kind: str = "mse") -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`simple_loss` under the site's own domain vectors ``own`` and :func:`other_domain_term` under ``other``,
    from one forward pass of the generator over both halves stacked into one batch (the same values and gradients:
    every layer of the generator treats each image on its own, GroupNorm included). A FedST-join local step on CPU
    costs 9 % less than with two passes (0.196 -> 0.178 s at fedst_tiny's batch of 8, one thread;
    benchmarks/fedst_join_step.py)."""
    n = images.shape[0]
    pair = lambda t: torch.cat([t, t])  # noqa: E731
    pred = noised_prediction(generator, scheduler, pair(images), pair(condition), pair(noise), pair(timesteps),
                             torch.cat([own, other]))
    value = _distance(pred[:n], training_target(scheduler, images, noise, timesteps), kind)
    with torch.no_grad():
        kept = noised_prediction(reference, scheduler, images, condition, noise, timesteps, other)
    return value, F.mse_loss(pred[n:], kept)


# ---- schedulers ----------------------------------------------------------------------------------
def _schedule(cfg: DiffusionConfig) -> dict[str, Any]:
    return {"num_train_timesteps": cfg.train_timesteps, "schedule": cfg.beta_schedule, "beta_start": cfg.beta_start,
            "beta_end": cfg.beta_end}


def training_scheduler(cfg: DiffusionConfig) -> Scheduler:
    """The forward (noising) process the generator is trained with."""
    if cfg.scheduler == "rflow":
        return RFlowScheduler(num_train_timesteps=cfg.train_timesteps, use_discrete_timesteps=True, sample_method="uniform", spatial_dim=2)
    return DDPMScheduler(prediction_type=cfg.prediction, **_schedule(cfg))


def sampling_scheduler(cfg: DiffusionConfig, steps: int | None = None) -> Scheduler:
    """The reverse process used to sample, set to ``steps`` (default ``sample_steps``) denoising steps."""
    steps = int(steps or cfg.sample_steps)
    if cfg.scheduler == "rflow":
        sched: Scheduler = training_scheduler(cfg)
    elif cfg.sampler == "ddim":
        sched = DDIMScheduler(prediction_type=cfg.prediction, clip_sample=True, **_schedule(cfg))
    else:
        sched = DDPMScheduler(prediction_type=cfg.prediction, clip_sample=True, **_schedule(cfg))
    sched.set_timesteps(steps)
    return sched


def draw_timesteps(scheduler: Scheduler, batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Uniform training timesteps in [0, T) (the E_t of Eq. 2), one per image."""
    return torch.randint(0, scheduler.num_train_timesteps, (batch,), generator=generator).long()


def training_target(scheduler: Scheduler, images: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
    """What the denoiser must output: eps (Eq. 2), the velocity, the clean image, or x0 - eps (rectified flow)."""
    if isinstance(scheduler, RFlowScheduler):
        return images - noise
    kind = scheduler.prediction_type
    if kind == "epsilon":
        return noise
    if kind == "v_prediction":
        return scheduler.get_velocity(images, noise, timesteps)
    return images


# ---- Eq. 2 ---------------------------------------------------------------------------------------
def noised_prediction(generator: Callable[..., torch.Tensor], scheduler: Scheduler, images: torch.Tensor, condition: torch.Tensor,
                      noise: torch.Tensor, timesteps: torch.Tensor, domain: torch.Tensor | None = None) -> torch.Tensor:
    """The generator's prediction for ``images`` noised to ``timesteps`` with ``noise``, the encoded label maps
    ``condition`` concatenated (MONAI's ``DiffusionInferer``, mode "concat"), under ``domain`` where given."""
    model = partial(generator, domain=domain) if domain is not None else generator
    return DiffusionInferer(scheduler)(inputs=images, diffusion_model=model, noise=noise, timesteps=timesteps,
                                       condition=condition, mode="concat")


def simple_loss(
    generator: Callable[..., torch.Tensor],
    scheduler: Scheduler,
    images: torch.Tensor,
    condition: torch.Tensor,
    noise: torch.Tensor,
    timesteps: torch.Tensor,
    domain: torch.Tensor | None = None,
    kind: str = "mse",
) -> torch.Tensor:
    """L_simple (Eq. 2) for one batch: images (B, C, H, W) in [-1, 1], condition (B, K, H, W) encoded labels,
    noise like images, timesteps (B,) -> scalar mean over pixels and batch (``kind`` "mse" = the squared norm of
    Eq. 2, "l1" = the reference code's). ``generator`` is called as ``generator(x, timesteps=, context=None)``."""
    return _distance(noised_prediction(generator, scheduler, images, condition, noise, timesteps, domain),
                     training_target(scheduler, images, noise, timesteps), kind)


def _distance(pred: torch.Tensor, target: torch.Tensor, kind: str) -> torch.Tensor:
    """Eq. 2's distance: "mse" (the squared norm) or "l1" (the reference code's), averaged over pixels and batch."""
    return F.mse_loss(pred, target) if kind == "mse" else F.l1_loss(pred, target)


def to_model_range(images: torch.Tensor) -> torch.Tensor:
    """[0, 1] images -> [-1, 1], the range the noise schedule is made for."""
    return images * 2.0 - 1.0


def from_model_range(images: torch.Tensor) -> torch.Tensor:
    """[-1, 1] samples -> [0, 1] images (clipped)."""
    return ((images.clamp(-1.0, 1.0) + 1.0) / 2.0).clamp(0.0, 1.0)


def cycle(batches: Callable[[int], Iterable[Mapping[str, torch.Tensor]]]) -> Iterator[Mapping[str, torch.Tensor]]:
    """Endless batches: ``batches(epoch)`` (e.g. a seeded shuffling loader per epoch) chained epoch after epoch."""
    epoch = 0
    while True:
        empty = True
        for batch in batches(epoch):
            empty = False
            yield batch
        if empty:
            raise DataError("the generator's training data is empty")
        epoch += 1


def train_generator(
    generator: StyleGenerator,
    scheduler: Scheduler,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[Mapping[str, torch.Tensor]],
    steps: int,
    *,
    domain_index: int | None = None,
    trained_classes: Sequence[int] | None = None,
    loss: str = "mse",
    device: torch.device | str = "cpu",
    seed: int = 0,
    should_stop: Callable[[], bool] | None = None,
    prox_mu: float = 0.0,
    anchor: Mapping[str, torch.Tensor] | None = None,
    keep_other_domains: float = 0.0,
    reference: nn.Module | None = None,
) -> list[float]:
    """``steps`` Adam steps of L_simple on batches ``{"image" (B,C,H,W) in [0,1], "label" (B,1,H,W)}``; per-step losses
    (L_simple alone, without the proximal term).

    ``domain_index`` (FedST-join) conditions every image on that one-hot domain. ``prox_mu`` > 0 adds
    :func:`proximal_term` towards ``anchor`` (default: the shared parameters at the start of the call).
    ``keep_other_domains`` > 0 (FedST-join) adds that weight times :func:`other_domain_term`: the generator's prediction
    for another domain (one drawn per step) on the same noisy input is kept at ``reference``'s (default: a frozen copy
    of the generator at the start of the call, i.e. the global generator received), so the site's style has to go
    into its own domain column instead of the shared layers. A non-finite loss raises MedflareError (lower
    ``diffusion.lr``).
    """
    if prox_mu > 0 and anchor is None:
        anchor = proximal_anchor(generator)
    others = [j for j in range(generator.num_domains) if j != domain_index] if domain_index is not None else []
    keep = keep_other_domains > 0 and bool(others)
    if keep and reference is None:
        reference = frozen_copy(generator)
    generator.train()
    rng = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    for step in range(steps):
        if should_stop is not None and should_stop():
            break
        batch = next(batches)
        images = to_model_range(batch["image"].float())
        cond = encode_labels(batch["label"], generator.num_classes, trained_classes)
        noise = torch.randn(images.shape, generator=rng)
        timesteps = draw_timesteps(scheduler, images.shape[0], rng)
        images, cond, noise, timesteps = images.to(device), cond.to(device), noise.to(device), timesteps.to(device)
        domain = domain_vectors(domain_index, generator.num_domains, images.shape[0]).to(device) if domain_index is not None else None
        optimizer.zero_grad(set_to_none=True)
        if keep:
            other = others[int(torch.randint(len(others), (1,), generator=rng))]
            value, kept = simple_and_other_domain_losses(
                generator, reference, scheduler, images, cond, noise, timesteps, domain,
                domain_vectors(other, generator.num_domains, images.shape[0]).to(device), loss)
        else:
            value = simple_loss(generator, scheduler, images, cond, noise, timesteps, domain, loss)
        if not torch.isfinite(value):
            raise MedflareError(f"the generator's loss became {value.item()} at step {step}; lower diffusion.lr")
        total = value + proximal_term(generator, anchor, prox_mu) if prox_mu > 0 else value
        if keep:
            total = total + keep_other_domains * kept
        total.backward()
        optimizer.step()
        losses.append(float(value.detach()))
    return losses


def domain_guided(generator: StyleGenerator, domain: torch.Tensor, weight: float) -> Callable[..., torch.Tensor]:
    """The denoiser pushed ``weight`` times further from the sites' mixture style than ``domain``'s own prediction:
    ``f(x, d) + w (f(x, d) - f(x, d_mix))`` with ``d_mix`` the uniform vector (:func:`mixture_vectors`).

    Classifier-free guidance (Ho & Salimans 2022) with the mixture style in place of the unconditional model: a
    federated generator whose domain vectors draw styles pulled toward the sites' mean (benchmarks/RESULTS_fedst.md,
    "Full scale") is extrapolated away from it at sampling time; no training, no bytes. Not in the paper. ``weight``
    0 is the plain generator. Both predictions come from one forward pass over the doubled batch."""
    if weight == 0:
        return partial(generator, domain=domain)
    mixture = mixture_vectors(generator.num_domains, domain.shape[0]).to(domain)

    def guided(x: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        own, mix = generator(torch.cat([x, x]), timesteps, context, domain=torch.cat([domain, mixture])).chunk(2)
        return own + weight * (own - mix)

    return guided


@torch.no_grad()
def sample_images(
    generator: StyleGenerator,
    scheduler: Scheduler,
    label_maps: torch.Tensor,
    *,
    domain_index: int | None = None,
    trained_classes: Sequence[int] | None = None,
    seed: int = 0,
    batch_size: int = 32,
    device: torch.device | str = "cpu",
    who: str = "the generator",
    guidance: float = 0.0,
) -> torch.Tensor:
    """Synthetic images (B, image_channels, H, W) in [0, 1] for label maps (B, 1, H, W) (in the domain ``domain_index``
    for a domain-conditioned generator, steered ``guidance`` away from the sites' mixture: :func:`domain_guided`; a
    draw without ``domain_index`` has no mixture to leave and ignores it), by the reverse process of ``scheduler``
    from seeded Gaussian noise."""
    generator.eval()
    if label_maps.shape[0] == 0:
        return torch.empty(0, generator.image_channels, *label_maps.shape[2:])
    generator.check_size(int(label_maps.shape[-2]), int(label_maps.shape[-1]), who)
    if generator.num_domains and domain_index is None:
        raise ConfigError(f"{who} is domain-conditioned: name the domain (site) to draw")
    rng = torch.Generator().manual_seed(seed)
    inferer = DiffusionInferer(scheduler)
    out = []
    for start in range(0, label_maps.shape[0], batch_size):
        labels = label_maps[start:start + batch_size]
        cond = encode_labels(labels, generator.num_classes, trained_classes, who).to(device)
        noise = torch.randn((labels.shape[0], generator.image_channels, *labels.shape[2:]), generator=rng).to(device)
        model: Callable[..., torch.Tensor] = generator
        if domain_index is not None:
            model = domain_guided(generator, domain_vectors(domain_index, generator.num_domains, labels.shape[0]).to(device), guidance)
        images = inferer.sample(input_noise=noise, diffusion_model=model, scheduler=scheduler, conditioning=cond,
                                mode="concat", verbose=False)
        out.append(from_model_range(images).cpu())
    return torch.cat(out)


def generator_nbytes(generator: nn.Module) -> int:
    """Bytes of a generator's state on the wire (parameters and buffers), the G of the communication cost."""
    return int(sum(t.numel() * t.element_size() for t in generator.state_dict().values()))

