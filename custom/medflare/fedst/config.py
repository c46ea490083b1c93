"""FedST's settings: the ``diffusion`` section (the label-conditioned generator) and the ``fedst`` section (the workflow).

Both are read by the server's workflow, the persistor and every site executor from the job's preset, so a job-folder
override (``"overrides": {"fedst": {"cds_lambda": 0}}``) or ``medflare run fedst_join --set diffusion.sync_steps=10``
reaches every side; an unknown key is refused naming the section and its valid keys.
"""

from __future__ import annotations

from medflare import ConfigError
from medflare.settings import (NON_NEGATIVE, POSITIVE, Bool, Check, Int, Items, Nested, Number, OneOf, OrNone, Section,
                               Text, section, setting)

SCHEDULERS = ("ddpm", "rflow")
SAMPLERS = ("ddim", "ddpm")
PREDICTIONS = ("epsilon", "v_prediction", "sample")
LOSSES = ("mse", "l1")
GENERATOR_WEIGHTS = ("equal", "cases")
#: ``diffusion.sync_layers``: what FedST-join averages every ``sync_steps`` local steps ("all": the whole generator;
#: "domain": only the domain modulation, the whole generator once per round)
SYNC_LAYERS = ("all", "domain")
#: ``diffusion.exchange_dtype``: the type FedST-join's generator travels in, both ways (the int ones: blockwise
#: quantized diffs with error feedback, :mod:`medflare.common.quantize`)
QUANTIZED_DTYPES = {"int8": 8, "int4": 4}  # name -> bits
EXCHANGE_DTYPES = ("float32", "float16", *QUANTIZED_DTYPES)
#: ``fedst.refresh_every`` when a preset leaves it null: FedST-separate uploads once (the paper), FedST-join redraws
#: its synthetic images every 2 rounds
REFRESH_EVERY = {"separate": 0, "join": 2}


def _per_level(key: str, value: object) -> int | list[int]:
    """An int >= 1, or one per level (MONAI takes either for ``num_res_blocks`` and ``num_head_channels``)."""
    return Items(Int(1), min_items=1)(key, value) if isinstance(value, (list, tuple)) else Int(1)(key, value)


@section("diffusion.generator")
class GeneratorSettings(Section):
    """MONAI ``DiffusionModelUNet`` arguments of the generator (in/out channels are the data's, see
    :func:`medflare.fedst.diffusion.generator_args`).

    Keys: channels (per level, default [16, 32, 32]), num_res_blocks (an int or one per level, default 1),
    attention_levels (per level, default all false), norm_num_groups (8), num_head_channels (an int or one per level, 8);
    domain_init_std: FedST-join only, the standard deviation of the initial weights of the domain modulation
    (:class:`medflare.fedst.conditioning.DomainModulation`; default 0.02, every domain starting close to the
    unmodulated UNet). 1.0 (domains distinct from the start) made the six report sites' generator draw site-2's
    inverted style at seed 3 where 0.02 drew it flat, but the segmentation scored 63.11 against 74.31 (seed 0: 76.88
    against 76.89; benchmarks/RESULTS_fedst.md "Seed 3 at full scale"), so no preset sets it.
    """

    channels: list = setting([16, 32, 32], Items(Int(1), min_items=1))
    num_res_blocks: int | list = setting(1, Check(_per_level))
    attention_levels: list = setting([False, False, False], Items(Bool(), min_items=1))
    norm_num_groups: int = setting(8, Int(1))
    num_head_channels: int | list = setting(8, Check(_per_level))
    domain_init_std: float = setting(0.02, NON_NEGATIVE)

    def check(self) -> None:
        if len(self.attention_levels) != len(self.channels):
            raise ConfigError(f"'diffusion.generator.attention_levels' needs one entry per level of 'channels' "
                              f"({len(self.channels)}), got {self.attention_levels}")


@section("diffusion")
class DiffusionConfig(Section):
    """FedST's style transfer generator (Eq. 2 of the paper; :mod:`medflare.fedst.diffusion`).

    Keys:
        generator: the denoiser UNet (:class:`GeneratorSettings`). Default 3 levels of 16, 32, 32 channels.
        scheduler: "ddpm" (Eq. 2, epsilon prediction by default) or "rflow" (rectified flow: velocity x0 - eps, Euler
            sampling; straighter paths, usable with fewer sampling steps). Default "ddpm".
        prediction: what the DDPM denoiser predicts: "epsilon" (Eq. 2), "v_prediction" or "sample". Default "epsilon".
        train_timesteps: T of the forward process (paper/reference: 1000 for sampling, 2000 for training). Default 1000.
        beta_schedule, beta_start, beta_end: MONAI noise schedule name and its end points, in (0, 1). Defaults
            "linear_beta", 1e-4, 2e-2.
        sampler: "ddim" (deterministic, few steps) or "ddpm" (ancestral, the paper's 1000 steps); rflow always uses its
            own Euler steps. Default "ddim".
        sample_steps: denoising steps when sampling, <= train_timesteps. Default 20.
        loss: "mse" (Eq. 2) or "l1" (the reference code). Default "mse".
        lr, batch_size: Adam learning rate and batch of the generator. Defaults 1e-3, 8.
        domain_lr: FedST-join: Adam learning rate of the domain modulation (its own parameter group), meant to be larger
            than ``lr`` so that a site's style goes into its domain column (which the per-entry mean keeps whole)
            rather than into the shared layers; see :func:`medflare.fedst.diffusion.generator_optimizer`. Default 1e-2.
        warmup_steps: FedST-separate: local generator steps before the one upload to the style store. Default 400.
        steps_per_round: generator steps per round (FedST-join every round; FedST-separate only when the store is
            refreshed during training, ``fedst.refresh_every``). Default 100.
        sync_steps: FedST-join: local generator steps between two averagings of the generator. A round's
            ``steps_per_round`` steps are split into exchanges of at most ``sync_steps`` steps, each one download of
            the global generator, local training and one diff upload per site
            (:func:`medflare.fedst.diffusion.exchange_steps`); 0 = one exchange per round (the paper's schedule). Why: a
            site trains under one constant domain vector, so over many local steps its style goes into the shared
            layers, which the server averages back to the mean style; with few local steps per exchange the federated
            generator learns both styles and switches with the domain vector as a centrally trained one does
            (measured, benchmarks/RESULTS_fedst.md; the paper's Fig. 9d also finds that longer communication intervals
            hurt). Costs 2 G per site and exchange. Default 5. The ``fedst`` preset (six report sites) sets 8, 13
            exchanges in its rounds of 100 steps, with ``exchange_dtype`` int4 (34 with float16 until session 63);
            ``fedst_tiny`` (two sites) sets 0
            with ``keep_other_domains`` 5, which follows style at two sites but not at six (issue 32,
            benchmarks/RESULTS_fedst.md "Six sites").
        warmup_sync_steps: FedST-join: ``sync_steps`` in the ``warmup_rounds`` (generator-only rounds, where no
            segmentation bytes travel); null = ``sync_steps``. More averages while the domain modulation forms, at a
            generator exchange's bytes each (2 G per site). Measured at the report's six sites (issue 32,
            benchmarks/RESULTS_fedst.md "Seed 3 at full scale"): 20 with ``fedst``'s 34 (five
            averages in each of its three warm-up rounds, 4.9x FedST-separate's bytes) drew the same styles as null
            and scored lower (seeds 3 / 0: 63.68 / 76.23 against 74.31 / 76.89), so no preset sets it. Default null.
        sync_layers: FedST-join: what an exchange within a round averages. "all": the whole generator every exchange
            (2 G per site and exchange). "domain": only the domain modulation (``modulation.*``, 1-3 % of G) every
            ``sync_steps`` steps, the whole generator once per round (the round's first exchange downloads all of it,
            its last uploads all of it): 2 G + 2 (E - 1) D per site and round for E exchanges and D bytes of the domain
            modulation (:func:`medflare.fedst.comm.join_generator_bytes`). Default "all".
        prox_mu: FedST-join: mu of a FedProx-style proximal term ``mu / 2 ||w - w_global||^2`` on the shared (non-domain)
            layers during a site's local generator steps, w_global the shared layers last received; 0 = none. Default 0.
        keep_other_domains: FedST-join: weight of a term that keeps, during a site's local generator steps, the
            generator's prediction for another domain (one drawn per step, on the same noisy image and label map) at
            that of the generator last received (:func:`medflare.fedst.diffusion.other_domain_term`): the shared
            layers cannot move the other sites' styles, so the site's own style has to go into its domain column.
            0 = none. Default 0.
        exchange_dtype: FedST-join: the float type the generator travels in, both ways ("float32" | "float16"). With
            "float16" the server sends the global generator rounded to float16 and a site sends its diff (taken
            against what it received) in float16; the server keeps and averages the generator in float32 and a site
            trains it in float32. Halves the generator's bytes, so the same byte budget buys twice the exchanges
            (``sync_steps``). "int8" / "int4": every exchange after a site's first sends diffs both ways, blockwise
            quantized (64 values per float16 scale, :mod:`medflare.common.quantize`) with error feedback: the server
            sends the global generator minus what the site holds (it keeps each site's copy) and the whole generator in
            float16 to a site it holds no copy of (the first exchange, or after a site missed one); a site's diff is
            quantized by a job filter after its privacy scope's filters (:class:`~medflare.common.diff_quantizer.DiffQuantizer`,
            which keeps what the rounding lost for the next send). About 1/7 (int4) of float32's bytes per exchange.
            Default "float32".
        domain_guidance: FedST-join: weight w of domain guidance when a site draws another site's style: the
            denoiser's output ``f(x, d) + w (f(x, d) - f(x, d_mix))``, pushed away from the sites' mixture style
            (the uniform domain vector; :func:`medflare.fedst.diffusion.domain_guided`). Classifier-free guidance with
            the mixture as the reference; sampling only (twice the sampling compute, no bytes). Not in the paper.
            0 = off. Default 0.
        warmup_rounds: FedST-join: rounds in which only the generator is trained (FedAvg), before segmentation. Default 2.
        segmentation_steps: FedST-join: generator steps in each segmentation round (split by ``sync_steps`` as
            ``steps_per_round`` is); null = ``steps_per_round``. 0 = the generator is trained only in the
            ``warmup_rounds``, as FedST-separate's is before its one upload: no generator exchange in the segmentation
            rounds; the server sends the finished generator once, with the first ``sample`` task (c G), and the sites
            draw their cross-domain images from it. Default null.
        num_synthetic: label maps of a site turned into synthetic images per refresh (0 = all training cases). Default 0.
        sample_batch: images denoised together when sampling. Default 32.
    """

    generator: dict = setting(GeneratorSettings().as_dict(), Nested(GeneratorSettings))
    scheduler: str = setting("ddpm", OneOf(SCHEDULERS))
    prediction: str = setting("epsilon", OneOf(PREDICTIONS))
    train_timesteps: int = setting(1000, Int(1))
    beta_schedule: str = setting("linear_beta", Text(empty=False))
    beta_start: float = setting(1e-4, Number(0.0, 1.0, low_open=True, high_open=True))
    beta_end: float = setting(2e-2, Number(0.0, 1.0, low_open=True, high_open=True))
    sampler: str = setting("ddim", OneOf(SAMPLERS))
    sample_steps: int = setting(20, Int(1))
    loss: str = setting("mse", OneOf(LOSSES))
    lr: float = setting(1e-3, POSITIVE)
    domain_lr: float = setting(1e-2, POSITIVE)
    batch_size: int = setting(8, Int(1))
    warmup_steps: int = setting(400, Int(0))
    steps_per_round: int = setting(100, Int(0))
    sync_steps: int = setting(5, Int(0))
    warmup_sync_steps: int | None = setting(None, OrNone(Int(0)))
    sync_layers: str = setting("all", OneOf(SYNC_LAYERS))
    prox_mu: float = setting(0.0, NON_NEGATIVE)
    keep_other_domains: float = setting(0.0, NON_NEGATIVE)
    exchange_dtype: str = setting("float32", OneOf(EXCHANGE_DTYPES))
    domain_guidance: float = setting(0.0, NON_NEGATIVE)
    warmup_rounds: int = setting(2, Int(0))
    segmentation_steps: int | None = setting(None, OrNone(Int(0)))
    num_synthetic: int = setting(0, Int(0))
    sample_batch: int = setting(32, Int(1))

    def check(self) -> None:
        if self.segmentation_steps == 0 and self.warmup_rounds == 0:
            raise ConfigError("'diffusion.segmentation_steps' 0 trains FedST-join's generator only in its warm-up rounds, and "
                              "'diffusion.warmup_rounds' is 0: the generator would never train")
        if self.sample_steps > self.train_timesteps:
            raise ConfigError(f"'diffusion.sample_steps' ({self.sample_steps}) cannot exceed 'diffusion.train_timesteps' "
                              f"({self.train_timesteps})")
        if self.beta_start >= self.beta_end:
            raise ConfigError(f"'diffusion.beta_start' ({self.beta_start}) must be below 'diffusion.beta_end' ({self.beta_end})")


@section("fedst")
class FedSTConfig(Section):
    """FedST's workflow (both variants; :mod:`medflare.fedst.controller`).

    Keys:
        rounds: segmentation rounds (FedST-join runs ``diffusion.warmup_rounds`` generator rounds before them); the
            workflow's ``num_rounds`` when that is null, as in the exported job folders. Default 10.
        cds_lambda: lambda of Eq. 3, the weight of the loss on cross-domain synthetic images; 0 = plain FedAvg on real
            images (the ``sample`` task is then skipped). Default 1.0.
        refresh_every: rounds between refreshes of the synthetic images (FedST-separate: also re-uploads of the
            generators; FedST-join: redraws with the current global generator); 0 = draw once and keep them; null = the
            variant's default, 0 for FedST-separate (the paper) and 2 for FedST-join. Default null.
        generator_weights: FedST-join: weight of each site in the generator's per-entry mean, "equal" (every domain
            counts the same in the shared layers) or "cases" (training cases, as the segmentation model). Default "equal".
    """

    rounds: int = setting(10, Int(1))
    cds_lambda: float = setting(1.0, NON_NEGATIVE)
    refresh_every: int | None = setting(None, OrNone(Int(0)))
    generator_weights: str = setting("equal", OneOf(GENERATOR_WEIGHTS))

    def refresh(self, variant: str) -> int:
        """``refresh_every``, or the default of ``variant`` ("separate" | "join") when it is null."""
        return REFRESH_EVERY[variant] if self.refresh_every is None else self.refresh_every
