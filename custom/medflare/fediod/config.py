"""The ``fediod`` section of a preset: every distillation knob, checked once, read by the server and the sites alike.

Overrides set any key (``{"fediod": {"ensemble": "mean"}}``, ``medflare run fediod --set fediod.ensemble=mean``); the
defaults below fill the keys a preset leaves out.

    "fediod": {
      "generator": {"name": "latent_generator", "args": {"latent_dim": 100, "width": 64}},
      "discriminator": {"name": "patch_critic", "args": {"width": 32, "layers": 2}},
      "batch_size": 64,            # B: generated inputs per step (and real inputs per discriminator step)
      "steps_per_window": 8,       # M: steps whose messages travel together (see controller docstring)
      "windows_per_round": 4,      # windows per FLARE round ("epoch" of the paper: rounds x windows x M steps)
      "tau": 1.0,                  # temperature of Eq. 1 for L_conf and L_unique
      "mimic_tau": 0.0,            # L_mimic: 0 = squared logit distance (Eq. 10, tau -> inf); > 0 = tau^2 KL at tau
      "lambda_conf": 1.0, "lambda_unique": 1.0, "lambda_mimic": 1.0, "lambda_gan": 1.0,
      "lambda_balance": 0.0,       # class balance of the ensemble's predictions (reference code, not the paper)
      "lambda_bn": 0.0,            # realism prior: generated batches' features vs each teacher's BatchNorm running
                                   # statistics (DeepInversion; not the paper; computed at the site; 0 = off)
      "lambda_label": 0.0,         # segmentation: G's cross-entropy of the ensemble A to the conditioning label map
                                   # (not the paper; 0 = off)
      "student_label": 0.0,        # segmentation: the student's cross-entropy to the conditioning label map, added to
                                   # L_mimic (not the paper; 0 = off)
      "conditional_critic": true,  # segmentation: D_k judges (label map, image) pairs (pix2pix); false = the image alone
                                   # (the server's label maps are not the site's, so a conditional D_k could tell them
                                   # apart by their shapes, which G cannot change; measured no better at fediod_seg,
                                   # jobs/fediod_seg/README.md)
      "ensemble": "eq8",           # Eq. 8 weights | "labels" (label factor only) | "mean" (1/K); Table 6/7 ablation
      "ensemble_tau": 0.0,         # A: 0 = Eq. 9, the weighted mean of the teachers' logits (tau -> inf); > 0 = tau log of
                                   # the weighted mixture of their softmax(z / tau) (the paper's "conventional ensemble";
                                   # not Eq. 9; better under strong label skew, benchmarks/RESULTS_fediod.md)
      "ensemble_confidence": 0.0,  # p: Eq. 8's per-input factor times each teacher's top probability on the input to
                                   # the power p (medflare.fediod.losses.confidence; not the paper; 0 = off; measured
                                   # no better for the student at Dir(0.1), benchmarks/RESULTS_fediod.md)
      "gan_weighting": "data_size",  # G's GAN terms weighted by pi_k (Eq. 2) | "uniform" (Table 6 "Avg")
      "student_steps": 1,          # student steps per generated batch: 1 = Algorithm 1; each further step trains S on
                                   # a batch drawn from the replay bank (not the paper; no extra messages)
      "replay_size": 0,            # past generated inputs (+ their ensemble logits) the server keeps for those steps
                                   # (medflare.fediod.replay; 0 = the extra steps repeat the current batch)
      "student_augment": 0.0,      # probability of each intensity perturbation (blur, gamma, bias field, noise) of a
                                   # replayed image before the student's step (not the paper; medflare.fediod.augment;
                                   # 0 = off)
      "teacher_outliers": 0.0,     # classification: weight of outlier exposure in stage 1, each teacher trained to answer
                                   # uniformly on shuffled-patch mosaics of its own images (medflare.fediod.outliers; not
                                   # the paper; a site's local/medflare_site.json fediod.teacher_train "outliers" overrides
                                   # it for its teacher; 0 = off; 0.5 in the fediod_cls preset, whose comment
                                   # gives the measured effect)
      "lr_generator": 1e-3, "lr_student": 1e-3, "lr_discriminator": 1e-3, "cosine": true,
      "label_source": "auxiliary-labels",  # segmentation: whose label maps condition G (server-side auxiliary labels)
      "calibrate_offsets": [],     # segmentation: background-logit offsets the sites score the student at on their
                                   # validation splits; the best mean is folded into the saved student (not the paper;
                                   # medflare.fediod.calibration; [] = off)
      "image_size": 0              # side of G's output; 0 = the preset's data.image_size (set it for a site's own data)
    }
"""

from __future__ import annotations

from medflare.settings import NON_NEGATIVE, POSITIVE, Bool, Int, Items, NetSpec, Number, OneOf, Section, Text, section, setting

ENSEMBLES = ("eq8", "labels", "mean")
GAN_WEIGHTINGS = ("data_size", "uniform")


@section("fediod")
class FedIODConfig(Section):
    """Distillation settings; each key's meaning in the module docstring. Defaults: generator
    ``latent_generator`` (latent_dim 100, width 64), discriminator ``patch_critic`` (width 32, 2 layers), batch_size 64,
    steps_per_window 8, windows_per_round 4, tau 1, mimic_tau 0, lambda_conf / lambda_unique / lambda_mimic / lambda_gan 1,
    lambda_balance 0, lambda_bn 0, lambda_label 0, student_label 0, conditional_critic true, ensemble "eq8", ensemble_tau 0, ensemble_confidence 0, gan_weighting "data_size", student_steps 1, replay_size 0, student_augment 0,
    teacher_outliers 0, lr_generator / lr_student / lr_discriminator 1e-3, cosine true, label_source "auxiliary-labels", calibrate_offsets [],
    image_size 0."""

    generator: dict = setting({"name": "latent_generator", "args": {"latent_dim": 100, "width": 64}},
                              NetSpec(("latent_generator", "label_generator")))
    discriminator: dict = setting({"name": "patch_critic", "args": {"width": 32, "layers": 2}}, NetSpec(("patch_critic",)))
    batch_size: int = setting(64, Int(1))
    steps_per_window: int = setting(8, Int(1))
    windows_per_round: int = setting(4, Int(1))
    tau: float = setting(1.0, POSITIVE)
    mimic_tau: float = setting(0.0, NON_NEGATIVE)
    lambda_conf: float = setting(1.0, NON_NEGATIVE)
    lambda_unique: float = setting(1.0, NON_NEGATIVE)
    lambda_mimic: float = setting(1.0, NON_NEGATIVE)
    lambda_gan: float = setting(1.0, NON_NEGATIVE)
    lambda_balance: float = setting(0.0, NON_NEGATIVE)
    lambda_bn: float = setting(0.0, NON_NEGATIVE)
    lambda_label: float = setting(0.0, NON_NEGATIVE)
    student_label: float = setting(0.0, NON_NEGATIVE)
    conditional_critic: bool = setting(True, Bool())
    ensemble: str = setting("eq8", OneOf(ENSEMBLES))
    ensemble_tau: float = setting(0.0, NON_NEGATIVE)
    ensemble_confidence: float = setting(0.0, NON_NEGATIVE)
    gan_weighting: str = setting("data_size", OneOf(GAN_WEIGHTINGS))
    student_steps: int = setting(1, Int(1))
    replay_size: int = setting(0, Int(0))
    student_augment: float = setting(0.0, Number(0.0, 1.0))
    teacher_outliers: float = setting(0.0, NON_NEGATIVE)
    lr_generator: float = setting(1e-3, POSITIVE)
    lr_student: float = setting(1e-3, POSITIVE)
    lr_discriminator: float = setting(1e-3, POSITIVE)
    cosine: bool = setting(True, Bool())
    label_source: str = setting("auxiliary-labels", Text(empty=False))
    calibrate_offsets: list = setting([], Items(Number()))
    image_size: int = setting(0, Int(0))

    def critic_takes_labels(self, task: str) -> bool:
        """Whether D_k judges (label map, image) pairs: segmentation with ``conditional_critic``; the image alone otherwise
        (the one place the sites' critics and their input width read it)."""
        return task == "segmentation" and self.conditional_critic
