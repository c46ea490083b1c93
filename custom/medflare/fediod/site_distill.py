"""What a FedIOD site computes in stage 2 (Algorithm 1, the loop over k), on tensors, no FLARE.

The site holds its frozen teacher T_k and its discriminator D_k. Per window of M steps it

1. :meth:`SiteDistiller.outputs`: receives the generated inputs ``x`` (M, B, ...), draws M batches of its
   own real images, and returns the teacher logits ``z_k = T_k(x)`` and the discriminator factor of Eq. 8,
   ``r_k(x) = D_k(x) / E_{x'_k} D_k(x'_k)`` (the mean over this window's real images, with D_k as it is now);
2. :meth:`SiteDistiller.input_gradients`: receives the per-input gradients of the server's loss with
   respect to its outputs, ``g_z = dL/dz_k`` and ``g_r = dL/dr_k``, the weight ``c_k`` of its own GAN
   term (one number, or one per input ``c_k,i`` when the server's generator draws each input in one site's style)
   and the weight ``b_k`` of its teacher's batch-statistics prior, and returns the vector-Jacobian product
   ``v_k(x_i) = d/dx_i [ <g_z,i, T_k(x_i)> + g_r,i r_k(x_i) + c_k,i l_adv(D_k(x_i)) + B b_k R_k(x_1..B) ]``
   (per input, clipped and noised when the site's privacy settings say so), then trains D_k for M steps
   on (real batch m, generated batch m), as in Algorithm 1. ``R_k`` is the BatchNorm-statistics prior of
   :func:`medflare.nets.batchnorm.forward_with_bn_prior` on T_k (``lambda_bn``, not in the paper; b_k = 0
   leaves it out); it is a batch-level term of G's loss, hence the factor B against the server's 1/B.

D_k is used at the same state in both calls, so ``v_k`` is the exact gradient of the quantities sent in
call 1. T_k is in eval mode and D_k has instance norm, so every output of input i depends on input i
alone; the prior's gradient couples the inputs of a batch, which does not weaken the privacy argument
(:mod:`medflare.fediod.privacy`: the protected unit is a record of the site's data, and each released
vector is clipped to C whatever it depends on). Nothing here sends anything: the executor packs the
returned tensors into DXOs.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch

from medflare import ConfigError, PayloadError
from medflare.data.util import stable_seed
from medflare.fediod.config import FedIODConfig
from medflare.fediod.losses import discriminator_loss, discriminator_score, generator_adv_loss
from medflare.fediod.networks import data_shape, site_discriminator
from medflare.fediod.privacy import PrivacySettings, SiteAccountant, clip_and_noise, release_noise_multiplier
from medflare.nets.batchnorm import forward_with_bn_prior
from medflare.nets.gan import one_hot


def real_batches(dataset, batch_size: int, seed: int) -> Iterator[dict]:
    """Endless reshuffled batches of a site's training set (a fresh permutation each pass)."""
    from medflare.common.training import make_loader

    epoch = 0
    while True:
        for batch in make_loader(dataset, batch_size, True, seed=seed + epoch):
            yield batch
        epoch += 1


class SiteDistiller:
    """Site k's part of stage 2: frozen teacher, trained discriminator, DP on everything it returns.

    Args:
        teacher: the trained T_k (frozen here).
        discriminator: D_k (a :class:`~medflare.nets.gan.PatchCritic`).
        real: iterator of the site's real batches (``{"image", "label"}``).
        config: the job's distillation settings (D's learning rate).
        task: "classification" or "segmentation" (D on the one-hot label map and the image, unless
            ``config.conditional_critic`` is false).
        num_classes: classes of the labels.
        privacy: the site's own DP settings.
        device: torch device. seed: seed of the DP noise.
    """

    def __init__(self, teacher: torch.nn.Module, discriminator: torch.nn.Module, real: Iterator[dict], config: FedIODConfig,
                 task: str, num_classes: int, privacy: PrivacySettings | None = None, device="cpu", seed: int = 0):
        self.teacher = teacher.to(device).eval()
        for p in self.teacher.parameters():
            p.requires_grad_(False)
        self.disc = discriminator.to(device).train()
        self.opt = torch.optim.Adam(self.disc.parameters(), lr=config.lr_discriminator, betas=(0.5, 0.999))
        self.real_iter = real
        self.task, self.num_classes, self.device = task, num_classes, torch.device(device)
        self.conditional = config.critic_takes_labels(task)
        self.privacy = privacy or PrivacySettings()
        self.accountant = SiteAccountant(self.privacy.delta, self.privacy.epsilon_budget)
        self.noise = torch.Generator().manual_seed(int(seed))
        self._x = self._y = None
        self._real_batches: list[dict] = []
        self._real_mean = 1.0
        self._z_shape: tuple[int, ...] = ()
        self.last_d_loss = float("nan")
        self.last_prior = float("nan")  # R_k of the last generated batch (for the site's own log)

    # ---- privacy -------------------------------------------------------------------------------
    def releases(self, vectors: int) -> list[tuple[float, float]]:
        """The mechanisms one window of ``vectors`` generated inputs releases: [(noise multiplier, sample rate)]."""
        if not self.privacy.enabled:
            return []
        sigma = release_noise_multiplier(self.privacy.noise_multiplier, vectors)
        return [(sigma, 1.0)] * (2 if self.privacy.noise_outputs else 1)

    def check_budget(self, vectors: int) -> tuple[bool, float]:
        """(may the site take part in a window of ``vectors`` inputs, epsilon after it)."""
        return self.accountant.allows(self.releases(vectors))

    def epsilon(self) -> float:
        return self.accountant.epsilon()

    # ---- helpers -------------------------------------------------------------------------------
    def _critic_input(self, x: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
        return torch.cat([one_hot(y, self.num_classes), x], dim=1) if self.conditional else x

    def _check(self, x: torch.Tensor, y: torch.Tensor | None) -> None:
        if x.ndim < 4 or not torch.isfinite(x).all():
            raise PayloadError(f"generated inputs must be finite (M, B, C, H, W) tensors, got shape {tuple(x.shape)}")
        if self.task == "segmentation" and (y is None or y.shape[:2] != x.shape[:2]):
            raise PayloadError("segmentation windows need one conditioning label map per generated input")

    # ---- call 1 --------------------------------------------------------------------------------
    @torch.no_grad()
    def outputs(self, x: torch.Tensor, y: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher logits ``(M, B, C, *s)`` and discriminator factors ``(M, B)`` on the window ``x`` (M, B, C, H, W)."""
        self._check(x, y)
        M, B = x.shape[:2]
        self._x = x.to(self.device)
        self._y = y.to(self.device) if y is not None else None
        self._real_batches = [next(self.real_iter) for _ in range(M)]
        real_scores = [discriminator_score(self.disc(self._critic_input(*self._real(b)))) for b in self._real_batches]
        self._real_mean = float(torch.cat(real_scores).mean().clamp_min(1e-6))
        z, r = [], []
        for m in range(M):
            xm = self._x[m]
            z.append(self.teacher(xm))
            ym = self._y[m] if self._y is not None else None
            r.append(discriminator_score(self.disc(self._critic_input(xm, ym))) / self._real_mean)
        z, r = torch.stack(z), torch.stack(r)
        self._z_shape = tuple(z.shape[2:])
        if self.privacy.enabled and self.privacy.noise_outputs:
            flat = torch.cat([z.reshape(M * B, -1), r.reshape(M * B, 1)], dim=1)
            flat = clip_and_noise(flat, self.privacy.output_clip_norm, self.privacy.noise_multiplier, self.noise)
            z, r = flat[:, :-1].reshape(z.shape), flat[:, -1].reshape(r.shape)
            self.accountant.spend(release_noise_multiplier(self.privacy.noise_multiplier, M * B))
        return z, r

    # ---- call 2 --------------------------------------------------------------------------------
    def input_gradients(self, g_z: torch.Tensor, g_r: torch.Tensor, adv_weight: float | torch.Tensor, prior_weight: float) -> torch.Tensor:
        """Per-input VJP ``(M, B, C, H, W)`` of the window of call 1 (clipped and noised per the site's settings),
        then M discriminator steps. ``g_z``: like the logits; ``g_r``: ``(M, B)``; ``adv_weight``: c_k of the module
        docstring, a number or ``(M, B)``; ``prior_weight``: b_k."""
        if self._x is None:
            raise PayloadError("input gradients were asked for before any generated inputs arrived")
        M, B = self._x.shape[:2]
        expected_z = (M, B, *self._z_shape)
        if tuple(g_z.shape) != expected_z or tuple(g_r.shape) != (M, B):
            raise PayloadError(f"output gradients must have shapes {expected_z} and {(M, B)}, got {tuple(g_z.shape)} and {tuple(g_r.shape)}")
        g_z, g_r = g_z.to(self.device), g_r.to(self.device)
        adv = torch.as_tensor(adv_weight, dtype=torch.float32, device=self.device)
        if adv.numel() == 1:
            adv = adv.reshape(()).expand(M, B)
        if tuple(adv.shape) != (M, B) or not torch.isfinite(adv).all():
            raise PayloadError(f"the GAN weight must be a finite number or (M, B) = {(M, B)} per-input weights, got shape {tuple(adv.shape)}")
        grads = []
        for m in range(M):
            xm = self._x[m].detach().requires_grad_(True)
            ym = self._y[m] if self._y is not None else None
            logits = self.disc(self._critic_input(xm, ym))
            if prior_weight:
                z, prior = forward_with_bn_prior(self.teacher, xm)
                self.last_prior = float(prior.detach())
            else:
                z, prior = self.teacher(xm), 0.0
            objective = (g_z[m] * z).sum() + (g_r[m] * discriminator_score(logits) / self._real_mean).sum() + B * prior_weight * prior
            if bool(adv[m].any()):
                objective = objective + (adv[m] * generator_adv_loss(logits)).sum()
            grads.append(torch.autograd.grad(objective, xm)[0])
        v = torch.stack(grads)
        if self.privacy.clip_norm > 0 or self.privacy.enabled:
            v = clip_and_noise(v.reshape(M * B, *v.shape[2:]), self.privacy.clip_norm, self.privacy.noise_multiplier, self.noise).reshape(v.shape)
        if self.privacy.enabled:
            self.accountant.spend(release_noise_multiplier(self.privacy.noise_multiplier, M * B))
        self.train_discriminator()
        return v

    def _real(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(image, label map or None) of a real batch on the device (labels condition D for segmentation)."""
        return batch["image"].to(self.device), batch["label"].to(self.device) if self.task == "segmentation" else None

    def train_discriminator(self) -> float:
        """M steps of D_k (Eq. 2, D's side): real batch m against generated batch m of the window; mean loss."""
        losses = []
        for m, real in enumerate(self._real_batches):
            ym = self._y[m] if self._y is not None else None
            self.opt.zero_grad(set_to_none=True)
            loss = discriminator_loss(self.disc(self._critic_input(*self._real(real))),
                                      self.disc(self._critic_input(self._x[m].detach(), ym)))
            loss.backward()
            self.opt.step()
            losses.append(float(loss.detach()))
        self._x = self._y = None
        self._real_batches = []
        self.last_d_loss = sum(losses) / max(len(losses), 1)
        return self.last_d_loss


def site_distiller(cfg: Mapping[str, Any], fcfg: FedIODConfig, site: str, teacher: torch.nn.Module, train_set,
                   privacy: PrivacySettings | None, seed: int, device="cpu") -> SiteDistiller:
    """Site ``site``'s stage-2 state: its teacher, a fresh D_k, its real batches (seeded by (seed, site)), its DP; the
    ``fediod`` section ``fcfg`` as the caller built it once."""
    task, _, _, classes = data_shape(cfg, fcfg)
    disc = site_discriminator(cfg, fcfg, site, seed)
    site_seed = stable_seed("fediod-site", seed, site) % (2**31)
    return SiteDistiller(teacher, disc, real_batches(train_set, fcfg.batch_size, site_seed), fcfg, task, classes,
                         privacy=privacy, device=device, seed=site_seed)


def label_counts(dataset, task: str, num_classes: int) -> torch.Tensor:
    """Per-class label counts of a site's training set (pixels per class for segmentation): ``(C,)`` float64."""
    counts = torch.zeros(num_classes, dtype=torch.float64)
    for i in range(len(dataset)):
        label = torch.as_tensor(dataset[i]["label"]).long().reshape(-1)
        if label.numel() and (int(label.min()) < 0 or int(label.max()) >= num_classes):
            raise ConfigError(f"a training label lies outside 0..{num_classes - 1} (data.num_classes={num_classes})")
        counts += torch.bincount(label, minlength=num_classes).double()
    return counts
