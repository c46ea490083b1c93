"""The server's part of FedIOD stage 2 (Algorithm 1) and the gradient it assembles from the sites, no FLARE.

The server holds the generator G and the student S. Write the generator's loss for one step (Algorithm 1,
last lines) as a mean over the B generated inputs ``x_i = G(w_i)``::

    L_G = 1/B sum_i l_i + lb sum_k w_k R_k(x_1..B),
    l_i = lc H_conf(z(x_i)) + lu (-JSD(z(x_i))) - lm |S(x_i) - A(z(x_i), r(x_i))|^2 + lg sum_k w_k l_adv(D_k(x_i))

with ``z_k = T_k(x)`` (teacher logits) and ``r_k = D_k(x) / E D_k(x'_k)`` (Eq. 8's discriminator factor)
computed at site k, and ``w_k = pi_k`` (or 1/K). By the chain rule, for each input

    dL_G/dx_i = 1/B [ dl_i/dx_i |_S  +  sum_k ( J_{z_k}(x_i)^T dl_i/dz_k,i + J_{r_k}(x_i)^T dl_i/dr_k,i
                                               + lg w_k d l_adv(D_k(x_i))/dx_i + B lb w_k dR_k/dx_i ) ]

The first term passes through S only (server). ``dl/dz_k`` and ``dl/dr_k`` need every site's outputs
(Eq. 4's mixture, Eq. 8's per-class normalisation across sites, Eq. 9's ensemble), so they exist only once
the server has combined them: that is :meth:`Distiller.combine`. Each site can then form the bracket for
its own k from ``(dl/dz_k, dl/dr_k, lg w_k, lb w_k)`` alone, because only it has T_k and D_k: that is
:meth:`medflare.fediod.site_distill.SiteDistiller.input_gradients`, a vector-Jacobian product per input. The server
adds the site vectors to its own term and backpropagates ``dL_G/dx`` through G (:meth:`Distiller.apply`).
With noise and clipping off this is exactly the gradient of the single-process loss (tests/unit).

``R_k`` is the optional realism prior ``lambda_bn`` (lb; 0 = the paper's loss): the distance of a generated
batch's feature statistics from T_k's BatchNorm running statistics (DeepInversion's R_feature,
:func:`medflare.nets.batchnorm.forward_with_bn_prior`), computed at site k, whose statistics never leave it.
The paper does not use it: its discriminators make G realistic over 300 epochs, which a CPU run of a few
hundred steps does not reach (benchmarks/RESULTS_fediod.md measures both). It is weighted like the GAN term
(``w_k``) and is a function of the whole batch, so it enters dL_G/dx_i without the 1/B.

The student takes Algorithm 1's step on each generated batch and, with ``student_steps`` > 1, further steps on
batches drawn from a bank of past generated inputs and the ensemble logits the server formed for them
(:mod:`medflare.fediod.replay`, not in the paper): server-side only, no message added, nothing the sites did not
already release. G's loss and its federated gradient are as above, evaluated at S as its steps so far left it.

Messages are grouped in windows of M steps (``steps_per_window``): G generates the M batches of a window
at once, the sites answer for all M, the student and D_k take their M steps in order, and G takes M Adam
steps with the M gradients, all evaluated at G's parameters at the start of the window. G's gradients are
therefore up to M-1 steps stale (M = 1: Algorithm 1 exactly); S and D_k see the window's batches in order.

A site whose outputs or gradients hold NaN/Inf is dropped for that window (the weights pi_k renormalise
over the others) and named in the window's report; G and S stay finite.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol, Sequence

import torch

from medflare import MedflareError, PayloadError
from medflare.fediod.config import FedIODConfig
from medflare.fediod.losses import (aggregate, balance_loss, conf_loss, confidence, ensemble_weights, label_loss, label_ratio, mimic_loss, site_weights,
                                    unique_loss)
from medflare.fediod.augment import IntensityAugment
from medflare.fediod.replay import ReplayBank


@dataclass
class SiteInfo:
    """What a site sent once, after stage 1: label counts per class (pixels for segmentation) and data size."""

    counts: torch.Tensor
    size: int


@dataclass
class Window:
    """M steps' generated inputs: G's inputs, outputs (with G's graph), for segmentation the label maps, and with a
    styled generator the site each input was drawn for (index into the sorted registered sites)."""

    w: list[torch.Tensor]
    x: list[torch.Tensor]
    y: list[torch.Tensor] | None = None
    site: list[torch.Tensor] | None = None

    def inputs(self) -> torch.Tensor:
        """``(M, B, C, H, W)``, detached: what the sites receive."""
        return torch.stack([x.detach() for x in self.x])

    def labels(self) -> torch.Tensor | None:
        """``(M, B, 1, H, W)`` conditioning label maps (segmentation) or None."""
        return torch.stack(self.y) if self.y is not None else None


@dataclass
class Requests:
    """What :meth:`Distiller.combine` asks each site: gradients w.r.t. its outputs, its GAN weight (a number, or one
    per input ``(M, B)`` with a styled generator) and its prior's weight (``grads[site] = (g_z, g_r, lg w_k, lb w_k)``)."""

    grads: dict[str, tuple[torch.Tensor, torch.Tensor, float | torch.Tensor, float]] = field(default_factory=dict)
    direct: list[torch.Tensor] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)


class Federation(Protocol):
    """How the server reaches its sites (in one process: :class:`LocalFederation`; in FLARE: the controller)."""

    def outputs(self, x: torch.Tensor, y: torch.Tensor | None) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, str]]:
        """({site: (logits, discriminator factors)}, {site: why it did not answer})."""

    def input_gradients(self, requests: Mapping[str, tuple[torch.Tensor, torch.Tensor, float | torch.Tensor, float]]) -> dict[str, torch.Tensor]:
        """{site: per-input gradient (M, B, C, H, W)}."""


def _finite(*tensors: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


class Distiller:
    """Server side of stage 2: G, S, their optimisers, and the window loop of the module docstring.

    Args:
        generator: G (:mod:`medflare.fediod.networks`).
        student: S (any network with the teachers' output shape).
        config: distillation settings.
        task: "classification" or "segmentation".
        num_classes: classes of the task (the student's outputs).
        total_steps: steps of the whole run (cosine schedule length; 0 = constant learning rates).
        label_maps: segmentation only: ``(N, 1, H, W)`` auxiliary label maps that condition G.
        device: torch device. seed: seed of the noise / label sampling.
        log: ``log(message)`` for warnings (dropped sites). Default: none.
    """

    def __init__(self, generator: torch.nn.Module, student: torch.nn.Module, config: FedIODConfig, task: str, num_classes: int,
                 total_steps: int = 0, label_maps: torch.Tensor | None = None, device="cpu", seed: int = 0,
                 log: Callable[[str], None] | None = None):
        self.G, self.S = generator.to(device).train(), student.to(device).train()
        self.cfg, self.task, self.num_classes = config, task, int(num_classes)
        self.device = torch.device(device)
        betas = (0.5, 0.999)
        self.opt_g = torch.optim.Adam(self.G.parameters(), lr=config.lr_generator, betas=betas)
        self.opt_s = torch.optim.Adam(self.S.parameters(), lr=config.lr_student)
        self.sched = []
        if config.cosine and total_steps > 0:
            self.sched = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=total_steps) for o in (self.opt_g, self.opt_s)]
        if task == "segmentation" and (label_maps is None or len(label_maps) == 0):
            raise MedflareError("segmentation FedIOD needs auxiliary label maps to condition the generator (config 'fediod.label_source')")
        self.label_maps = label_maps
        self.styles = int(getattr(self.G, "styles", 0) or 0)
        self.rng = torch.Generator().manual_seed(int(seed))
        # past generated inputs + ensemble logits for the student's extra steps (own stream: G's noise is untouched)
        self.bank = ReplayBank(config.replay_size, seed=int(seed) + 1) if config.replay_size else None
        # intensity perturbations of the replayed images (student_augment; own random states, G's noise untouched)
        self.augment = IntensityAugment(config.student_augment, seed=int(seed) + 2)
        self.log = log or (lambda message: None)
        self.sites: dict[str, SiteInfo] = {}
        self.codes: dict[str, int] = {}
        self.steps = 0

    # ---- set-up ------------------------------------------------------------------------------
    def set_sites(self, infos: Mapping[str, SiteInfo]) -> None:
        """Register the sites' stage-1 statistics; MedflareError when their class counts disagree with the student."""
        if not infos:
            raise PayloadError("no site registered a teacher")
        bad = {s: len(i.counts) for s, i in infos.items() if len(i.counts) != self.num_classes}
        if bad:
            raise PayloadError(f"sites {sorted(bad)} report label counts over {sorted(set(bad.values()))} classes, the student has "
                               f"{self.num_classes}: every teacher must predict the same classes")
        self.sites = {s: SiteInfo(torch.as_tensor(i.counts, dtype=torch.float64), int(i.size)) for s, i in infos.items()}
        self.codes = {s: k for k, s in enumerate(sorted(self.sites))}  # styled G: the index an input drawn for site s carries
        site_weights([i.size for i in self.sites.values()])  # checks the sizes
        label_ratio(torch.stack([i.counts for i in self.sites.values()]))  # checks the counts
        held = torch.stack([i.counts for i in self.sites.values()]).sum(0)
        missing = [c for c in range(self.num_classes) if held[c] == 0]
        if missing:
            self.log(f"no site holds classes {missing}: the student cannot learn them")
        if self.styles and len(self.sites) > self.styles:
            self.log(f"{len(self.sites)} sites share the generator's {self.styles} style codes (site i draws in code i mod "
                     f"{self.styles}): raise the generator's 'styles' to give each site its own")

    # ---- one window --------------------------------------------------------------------------
    def sample(self, steps: int | None = None, batch: int | None = None, rng: torch.Generator | None = None) -> Window:
        """Generate a window of ``steps`` (default M) batches of ``batch`` (default B) inputs with G as it is now
        (graphs kept for :meth:`apply`); ``rng`` defaults to the run's own noise stream."""
        M, B, rng = steps or self.cfg.steps_per_window, batch or self.cfg.batch_size, rng or self.rng
        w, x, y = [], [], [] if self.task == "segmentation" else None
        site = [] if self.styles else None
        for _ in range(M):
            if self.task == "segmentation":
                idx = torch.randint(len(self.label_maps), (B,), generator=rng)
                ym = self.label_maps[idx]
                if self.styles:
                    # one site per input, uniformly (each site's style equally often), drawn in that site's code
                    site.append(torch.randint(len(self.sites) or self.styles, (B,), generator=rng))
                    wm = self.G.condition(ym, generator=rng, style=site[-1] % self.styles).to(self.device)
                else:
                    wm = self.G.condition(ym, generator=rng).to(self.device)
                y.append(ym.to(self.device))
            else:
                wm = self.G.latent(B, generator=rng).to(self.device)
            w.append(wm)
            x.append(self.G(wm))
        return Window(w, x, y, site)

    @torch.no_grad()
    def preview(self, n: int, seed: int = 0) -> Window:
        """``n`` samples of G in eval mode from a fixed noise seed (for TensorBoard; the training stream is untouched)."""
        self.G.eval()
        try:
            return self.sample(1, n, torch.Generator().manual_seed(seed))
        finally:
            self.G.train()

    def _weights(self, sites: Sequence[str], density: torch.Tensor | None, z: Sequence[torch.Tensor]) -> torch.Tensor:
        """Eq. 8's ``(K, B, C)`` weights from the sites' discriminator factors ``density`` ``(K, B)`` and, with
        ``ensemble_confidence`` p > 0, each teacher's confidence on the input to the power p (detached: a routing of
        the votes; G is not asked to move it)."""
        K, batch = len(sites), z[0].shape[0]
        if self.cfg.ensemble == "mean":
            return torch.full((K, batch, self.num_classes), 1.0 / K, device=self.device)
        ratio = label_ratio(torch.stack([self.sites[s].counts for s in sites])).to(self.device)
        factor = density if self.cfg.ensemble == "eq8" else None
        if self.cfg.ensemble_confidence:
            sure = torch.stack([confidence(zk.detach()) for zk in z]) ** self.cfg.ensemble_confidence
            factor = sure if factor is None else factor * sure
        return ensemble_weights(ratio, factor).expand(K, batch, self.num_classes)

    def combine(self, window: Window, outputs: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> Requests:
        """Losses of the window from the sites' outputs; the student's M steps; the gradients each site is asked for."""
        req = Requests()
        sites = []
        for s in sorted(outputs):
            z, r = outputs[s]
            if s not in self.sites:
                req.dropped[s] = "not registered in stage 1"
            elif not _finite(z, r):
                req.dropped[s] = "sent NaN/Inf logits or discriminator scores"
            else:
                sites.append(s)
        if not sites:
            return req
        pi = site_weights([self.sites[s].size for s in sites]).to(self.device, torch.float32)
        gan_w = pi if self.cfg.gan_weighting == "data_size" else torch.full_like(pi, 1.0 / len(sites))
        c = self.cfg
        g_z = {s: [] for s in sites}
        g_r = {s: [] for s in sites}
        totals = {"conf": 0.0, "jsd": 0.0, "mimic": 0.0}
        if c.lambda_label:
            totals["label"] = 0.0
        for m, xm_graph in enumerate(window.x):
            xm = xm_graph.detach().requires_grad_(True)
            z = [outputs[s][0][m].to(self.device, torch.float32).requires_grad_(True) for s in sites]
            r = [outputs[s][1][m].to(self.device, torch.float32).clamp_min(0).requires_grad_(True) for s in sites]
            student = self.S(xm)
            A = aggregate(z, self._weights(sites, torch.stack(r), z), c.ensemble_tau)
            conf, uniq, mimic = conf_loss(z, pi, c.tau), unique_loss(z, pi, c.tau), mimic_loss(student, A, c.mimic_tau)
            per_input = c.lambda_conf * conf + c.lambda_unique * uniq - c.lambda_mimic * mimic
            ym = window.y[m] if window.y is not None else None
            if c.lambda_label and ym is not None:
                label = label_loss(self._label_logits(window, m, sites, z, A), ym)
                per_input = per_input + c.lambda_label * label
                totals["label"] += float(label.mean().detach())
            total = per_input.sum()
            if c.lambda_balance:
                total = total + xm.shape[0] * c.lambda_balance * balance_loss(A, c.tau)
            grads = torch.autograd.grad(total, [xm, *z, *r], retain_graph=True, allow_unused=True)
            req.direct.append(grads[0] if grads[0] is not None else torch.zeros_like(xm))
            for i, s in enumerate(sites):
                gz, gr = grads[1 + i], grads[1 + len(sites) + i]
                g_z[s].append(gz if gz is not None else torch.zeros_like(z[i]))
                g_r[s].append(gr if gr is not None else torch.zeros_like(r[i]))
            # the student's steps: min_S L_mimic with the ensemble fixed (Eq. 10)
            s_loss = self._student_steps(xm.detach(), A.detach(), student, ym)
            totals["conf"] += float(conf.mean().detach())
            totals["jsd"] += float(-uniq.mean().detach())
            totals["mimic"] += float(s_loss.detach())
        M = len(window.x)
        req.stats = {k: v / M for k, v in totals.items()}
        req.grads = {s: (torch.stack(g_z[s]).detach(), torch.stack(g_r[s]).detach(), self._adv_weight(window, s, float(gan_w[i])),
                         float(c.lambda_bn * gan_w[i])) for i, s in enumerate(sites)}
        return req

    def _label_logits(self, window: Window, m: int, sites: Sequence[str], z: Sequence[torch.Tensor], A: torch.Tensor) -> torch.Tensor:
        """What G's label term scores against the conditioning label maps at step ``m``: the ensemble A, or with a
        styled generator each input's own site's teacher logits (the one expert on the style it was drawn in; an input
        drawn for a site not in ``sites`` this window falls back to A)."""
        if window.site is None:
            return A
        out = A
        for k, s in enumerate(sites):
            mine = (window.site[m].to(A.device) == self.codes[s]).view(-1, *([1] * (A.ndim - 1)))
            out = torch.where(mine, z[k], out)
        return out

    def _adv_weight(self, window: Window, site: str, weight: float) -> float | torch.Tensor:
        """Site ``site``'s GAN weight: ``lambda_gan pi_k`` for every input (Eq. 2), or with a styled generator
        ``lambda_gan`` on the inputs drawn for this site and 0 on the others, ``(M, B)``."""
        if window.site is None:
            return float(self.cfg.lambda_gan * weight)
        return self.cfg.lambda_gan * torch.stack([(sm == self.codes[site]).float() for sm in window.site]).to(self.device)

    def _student_steps(self, x: torch.Tensor, target: torch.Tensor, first: torch.Tensor, label: torch.Tensor | None = None) -> torch.Tensor:
        """The student's steps for one generated batch ``x`` with ensemble logits ``target`` (and, segmentation, the
        label maps ``label`` that conditioned G); returns the first loss.

        Step 1 is Algorithm 1's, on this batch (``first`` = S(x), already computed). With ``student_steps`` > 1
        each further step trains S on a batch drawn from the replay bank (:mod:`medflare.fediod.replay`), which
        this batch has joined, or on this batch again when ``replay_size`` is 0, its images perturbed in intensity
        with ``student_augment`` (:mod:`medflare.fediod.augment`). No message is added.
        """
        label = label if self.cfg.student_label else None
        if self.bank is not None:
            self.bank.add(x, target, label)
        loss = self._student_step(first, target, label)
        for _ in range(self.cfg.student_steps - 1):
            xs, ts, ls = self.bank.draw(len(x)) if self.bank is not None else (x, target, label)
            self._student_step(self.S(self.augment(xs)), ts, ls)
        return loss

    def _student_step(self, out: torch.Tensor, target: torch.Tensor, label: torch.Tensor | None = None) -> torch.Tensor:
        """One Adam step of S on L_mimic(S(x) = ``out``, ``target``) (Eq. 10, the ensemble fixed), plus ``student_label``
        x the cross-entropy to the conditioning label maps ``label`` when given; the loss."""
        loss = mimic_loss(out, target, self.cfg.mimic_tau).mean()
        if label is not None:
            loss = loss + self.cfg.student_label * label_loss(out, label).mean()
        self.opt_s.zero_grad(set_to_none=True)
        loss.backward()
        self.opt_s.step()
        return loss.detach()

    def generator_gradients(self, window: Window, requests: Requests, vjps: Mapping[str, torch.Tensor]) -> list[list[torch.Tensor]]:
        """dL_G/dtheta_G for each of the window's M steps, from the server's own term and the sites' vectors
        (a site whose vector is NaN/Inf or mis-shaped is dropped and named in ``requests.dropped``)."""
        used = []
        for s in sorted(vjps):
            v = vjps[s]
            if s not in requests.grads:
                continue
            if tuple(v.shape) != tuple(window.inputs().shape):
                requests.dropped[s] = f"sent input gradients of shape {tuple(v.shape)}, expected {tuple(window.inputs().shape)}"
            elif not _finite(v):
                requests.dropped[s] = "sent NaN/Inf input gradients"
            else:
                used.append(s)
        out = []
        for m, xm in enumerate(window.x):
            dx = requests.direct[m].clone()
            for s in used:
                dx = dx + vjps[s][m].to(self.device, dx.dtype)
            dx = dx / xm.shape[0]
            out.append(list(torch.autograd.grad(xm, list(self.G.parameters()), dx, allow_unused=True, retain_graph=True)))
        return out

    def step_generator(self, grads: list[list[torch.Tensor]]) -> None:
        """M Adam steps of G with the window's gradients, in order (and the cosine schedules)."""
        params = list(self.G.parameters())
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = torch.zeros_like(p) if g is None else g
            self.opt_g.step()
            for sched in self.sched:
                sched.step()
            self.steps += 1
        if not all(_finite(p) for p in (*params, *self.S.parameters())):
            raise MedflareError("the generator or the student became non-finite; lower fediod.lr_generator / lr_student")

    def run_window(self, federation: Federation, on_gradients: Callable[[Window, list], None] | None = None) -> Requests:
        """One window: generate, ask the sites for outputs, combine + student steps, ask for input gradients, G steps.
        ``on_gradients(window, grads)`` sees G's gradients before they are applied (tests trace them)."""
        window = self.sample()
        outputs, stopped = federation.outputs(window.inputs(), window.labels())
        req = self.combine(window, outputs)
        req.dropped.update(stopped)
        if req.grads:
            vjps = federation.input_gradients(req.grads)
            grads = self.generator_gradients(window, req, vjps)
            if on_gradients is not None:
                on_gradients(window, grads)
            self.step_generator(grads)
        for s, why in req.dropped.items():
            self.log(f"site '{s}' dropped from window {self.steps // max(len(window.x), 1)}: {why}")
        return req


class LocalFederation:
    """Every site in this process (benchmarks, tests): the same site code the FLARE executor runs, no messaging."""

    def __init__(self, sites: Mapping[str, "SiteDistiller"]):  # noqa: F821 - medflare.fediod.site_distill
        self.sites = dict(sites)
        self.stopped: dict[str, str] = {}

    def outputs(self, x, y):
        out = {}
        for name, site in self.sites.items():
            if name in self.stopped:
                continue
            ok, eps = site.check_budget(int(x.shape[0] * x.shape[1]))
            if not ok:
                self.stopped[name] = f"its epsilon budget {site.privacy.epsilon_budget} would be exceeded ({eps:.3f})"
                continue
            out[name] = site.outputs(x, y)
        return out, {s: why for s, why in self.stopped.items()}

    def input_gradients(self, requests):
        return {name: self.sites[name].input_gradients(*req) for name, req in requests.items()}


def steps_total(rounds: int, config: FedIODConfig) -> int:
    """Generator/student steps of a run of ``rounds`` rounds."""
    return int(rounds) * config.windows_per_round * config.steps_per_window


def lr_now(optimizer: torch.optim.Optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


__all__ = ["Distiller", "Federation", "LocalFederation", "Requests", "SiteInfo", "Window", "steps_total", "lr_now"]
