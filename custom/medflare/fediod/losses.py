"""FedIOD's objectives (Gong et al., AAAI 2024, Eq. 1-10) as plain torch functions on tensors, no FLARE.

Shapes: logits ``z`` are ``(B, C)`` for classification or ``(B, C, *spatial)`` for segmentation (one
distribution per pixel); every per-input quantity is then averaged over the pixels, so a segmentation
batch is scored like a classification batch of ``B * H * W`` inputs that share their input weights.

- :func:`softmax_t` is Eq. 1 (temperature ``tau``), :func:`entropy` the Shannon entropy ``H(q)``.
- :func:`conf_loss` is Eq. 3: ``E_x sum_k pi_k H(q_k)``; :func:`unique_loss` is Eq. 5, ``-JSD`` with the
  JSD of Eq. 4 ``H(sum_k pi_k q_k) - sum_k pi_k H(q_k)``. The paper's sign: minimising ``L_unique``
  *maximises* the teachers' disagreement (the reference code has the sign inverted; we follow the paper).
- :func:`label_ratio` is the first factor of Eq. 8, ``P_k(c) / P(c)`` from label counts;
  :func:`ensemble_weights` is Eq. 8 including the discriminator factor ``D_k(x) / E_{x'_k} D_k(x'_k)``
  (absent in the reference code), normalised per class across sites. :func:`confidence` is a teacher's top
  probability per input, the optional third factor of the weights (``ensemble_confidence``; not in the paper).
- :func:`aggregate` is Eq. 9, ``A = sum_k pi_k(x) (.) z_k`` (or, ``ensemble_tau`` > 0, tau times the log of the
  same weighted mixture of the teachers' probabilities at temperature tau); :func:`mimic_loss` is Eq. 10,
  ``E_w |S(G(w)) - A|^2`` (squared L2 over classes, mean over inputs and pixels).
- :func:`balance_loss`: the reference code's class-balance term (not in the paper; ``lambda_balance``).
- :func:`label_loss`: segmentation only, cross-entropy to the label map that conditioned G (not in the paper;
  ``lambda_label`` for G through A, ``student_label`` for the student).
- :func:`discriminator_loss` / :func:`generator_adv_loss`: the adversarial game of Eq. 2 in the classical
  (binary cross-entropy) form the paper says it follows; :func:`discriminator_score` is the ``D_k(x)`` of
  Eq. 8, the mean over patches of the PatchGAN's probability that ``x`` is the site's real data.

Eq. 2 puts ``pi_k`` on the real-data term, which does not depend on G, so as printed it would not change
G's update at all; Table 6 compares "Avg" against "Eq. 2" weighting of the sites' GAN terms for G. We
therefore weight each site's generator term by ``pi_k`` (:func:`site_weights`, ablation: uniform).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from medflare import PayloadError

EPS = 1e-12


def softmax_t(z: torch.Tensor, tau: float = 1.0) -> torch.Tensor:
    """Eq. 1: softmax over the class dimension (dim 1) of logits ``z / tau``; same shape as ``z``."""
    return torch.softmax(z / tau, dim=1)


def entropy(q: torch.Tensor) -> torch.Tensor:
    """Shannon entropy ``-sum_c q^c log q^c`` over dim 1 (natural log): ``(B, C, *s) -> (B, *s)``."""
    return -(q * torch.log(q.clamp_min(EPS))).sum(dim=1)


def _mean_per_input(v: torch.Tensor) -> torch.Tensor:
    """``(B, *s) -> (B,)``: mean over pixels (identity for classification)."""
    return v.reshape(v.shape[0], -1).mean(dim=1)


def _stack_weights(pi: Sequence[float] | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    w = torch.as_tensor(pi, dtype=like.dtype, device=like.device)
    return w.view(-1, *([1] * (like.ndim - 1)))


def conf_loss(z: Sequence[torch.Tensor], pi: Sequence[float] | torch.Tensor, tau: float = 1.0) -> torch.Tensor:
    """Eq. 3 per input: ``sum_k pi_k H(T_k(x; tau))`` -> ``(B,)`` (``z``: one logits tensor per site)."""
    q = torch.stack([softmax_t(zk, tau) for zk in z])  # (K, B, C, *s)
    h = entropy(q.flatten(0, 1)).view(q.shape[0], q.shape[1], *q.shape[3:])  # (K, B, *s)
    return _mean_per_input((_stack_weights(pi, h) * h).sum(dim=0))


def jsd(z: Sequence[torch.Tensor], pi: Sequence[float] | torch.Tensor, tau: float = 1.0) -> torch.Tensor:
    """Eq. 4 per input: ``H(sum_k pi_k q_k) - sum_k pi_k H(q_k)`` -> ``(B,)``; >= 0 when the pi_k sum to 1."""
    q = torch.stack([softmax_t(zk, tau) for zk in z])  # (K, B, C, *s)
    w = _stack_weights(pi, q)
    mixed = entropy((w * q).sum(dim=0))
    h = entropy(q.flatten(0, 1)).view(q.shape[0], q.shape[1], *q.shape[3:])
    return _mean_per_input(mixed - (_stack_weights(pi, h) * h).sum(dim=0))


def unique_loss(z: Sequence[torch.Tensor], pi: Sequence[float] | torch.Tensor, tau: float = 1.0) -> torch.Tensor:
    """Eq. 5 per input: ``-JSD(T_1(x), ..., T_K(x))`` -> ``(B,)``; G *minimises* it, i.e. seeks disagreement."""
    return -jsd(z, pi, tau)


def balance_loss(ensemble: torch.Tensor, tau: float = 1.0) -> torch.Tensor:
    """Class balance of a batch (a scalar): ``sum_c pbar^c log pbar^c`` with ``pbar`` the mean over the batch (and
    pixels) of ``p_tau(A)``; minimal when the ensemble's predictions use every class equally often.

    Not in the paper's Eq. 11: the reference code adds it (weight 10, per teacher) "to alleviate mode collapse
    of the unconditional GAN"; here it acts on the ensemble A of Eq. 9, which covers every class even when each
    teacher knows only a few (Dirichlet label skew).
    """
    p = softmax_t(ensemble, tau).movedim(1, -1).reshape(-1, ensemble.shape[1]).mean(dim=0)
    return (p * torch.log(p.clamp_min(EPS))).sum()


def site_weights(sizes: Sequence[float]) -> torch.Tensor:
    """``pi_k = |X'_k| / sum_k' |X'_k'|`` of Eq. 2 from the sites' training-set sizes: ``(K,)`` float64."""
    n = torch.as_tensor(sizes, dtype=torch.float64)
    if n.ndim != 1 or len(n) == 0 or bool((n < 0).any()) or float(n.sum()) <= 0:
        raise PayloadError(f"site data sizes must be >= 0 with a positive sum, got {list(map(float, n))}")
    return n / n.sum()


def label_ratio(counts: torch.Tensor) -> torch.Tensor:
    """First factor of Eq. 8, ``P_{Y'_k}(c) / P_{Y'}(c)``, from label counts ``(K, C)`` -> ``(K, C)``.

    ``P_{Y'_k}(c) = n_k^c / n_k`` is the share of class c among site k's labels and ``P_{Y'}(c) =
    sum_k n_k^c / sum_k n_k`` the global share. A class that no site holds gets ratio 1 at every site (its
    weights then come from the discriminator factor alone; no teacher knows the class, so none is preferred).
    """
    counts = torch.as_tensor(counts, dtype=torch.float64)
    if counts.ndim != 2 or bool((counts < 0).any()):
        raise PayloadError(f"label counts must be a (sites, classes) array of counts >= 0, got shape {tuple(counts.shape)}")
    n_k = counts.sum(dim=1, keepdim=True)
    if bool((n_k <= 0).any()):
        raise PayloadError("every site must report at least one label (a site with no labels has no teacher)")
    local = counts / n_k
    glob = counts.sum(dim=0, keepdim=True) / counts.sum()
    ratio = torch.where(glob > 0, local / glob.clamp_min(EPS), torch.ones_like(local))
    return ratio


def discriminator_score(logits: torch.Tensor) -> torch.Tensor:
    """``D_k(x)`` of Eq. 8 from a (Patch)GAN discriminator's logits ``(B, 1, *patches)`` -> ``(B,)`` in (0, 1):
    the mean over patches of the probability that ``x`` is real data of the site."""
    return torch.sigmoid(logits).reshape(logits.shape[0], -1).mean(dim=1)


def ensemble_weights(ratio: torch.Tensor, density: torch.Tensor | None) -> torch.Tensor:
    """Eq. 8: per-class per-input weights ``pi_k^c(x)``, normalised over sites for each class.

    ``ratio``: ``(K, C)`` label factor (:func:`label_ratio`); ``density``: ``(K, B)`` discriminator factor
    ``D_k(x) / E_{x'_k} D_k(x'_k)`` (None = without it: the label factor alone). Returns ``(K, B, C)``
    with ``sum_k pi_k^c(x) = 1`` for every input and class.
    """
    ratio = ratio.to(dtype=density.dtype if density is not None else torch.float32)
    K, C = ratio.shape
    if density is None:
        raw = ratio[:, None, :]  # (K, 1, C)
    else:
        if density.ndim != 2 or density.shape[0] != K:
            raise PayloadError(f"discriminator factors must be (sites={K}, inputs), got {tuple(density.shape)}")
        raw = ratio[:, None, :] * density.clamp_min(EPS)[:, :, None]  # (K, B, C)
    total = raw.sum(dim=0, keepdim=True)
    weights = raw / total.clamp_min(EPS)
    # a class every site gives zero weight (e.g. density underflow): share it equally
    return torch.where(total > 0, weights, torch.full_like(weights, 1.0 / K))


def confidence(z: torch.Tensor) -> torch.Tensor:
    """A teacher's top softmax probability per input (mean over pixels) ``(B, C, *s)`` -> ``(B,)``.

    With ``ensemble_confidence`` p > 0 the server multiplies Eq. 8's per-input factor by ``confidence(z_k) ** p``
    (not in the paper). Under strong label skew the label factor gives class c's vote to the teachers that hold c,
    but a teacher also answers inputs of the classes it lacks, confidently wrong; trained with outlier exposure
    (``teacher_outliers``) it answers them near-uniformly, and this factor then lets the teacher that knows the
    input outvote the one that does not. Measured (benchmarks/RESULTS_fediod.md, "A teacher's confidence"): on real
    images at Dir(0.1) it lifts the tau-1 ensemble from 0.785 to 0.826 (p 4), but the student, which learns on
    generated inputs, gains 0.35 points over five seeds (inside their scatter), so it is off in every preset.
    """
    top = torch.softmax(z.float(), dim=1).max(dim=1).values
    return top.reshape(top.shape[0], -1).mean(dim=1)


def aggregate(z: Sequence[torch.Tensor], weights: torch.Tensor, tau: float = 0.0) -> torch.Tensor:
    """Eq. 9: ``A = sum_k pi_k(x) (.) z_k``; ``weights`` ``(K, B, C)`` broadcast over pixels -> shape of ``z_k``.

    ``tau > 0`` (``ensemble_tau``; not Eq. 9): the same weights on the teachers' probabilities at temperature tau,
    ``A = tau log(qbar / sum_c qbar^c)`` with ``qbar = sum_k pi_k (.) softmax(z_k / tau)``, so ``softmax(A / tau)``
    is the weighted mixture of the teachers' distributions: the "conventional ensemble" the paper's Eq. 6 text names,
    of which Eq. 9 is the tau -> infinity limit (``tau = 0`` here, as ``mimic_tau``). Under strong label skew each
    teacher knows a few classes and Eq. 8's per-class weights compare one teacher's logit for class c with
    another's for class d, on scales that differ between networks (and shift with any constant added to a
    teacher's logits); in the mixture each teacher adds at most its weight to a class (measured,
    benchmarks/RESULTS_fediod.md, "An ensemble of probabilities").
    """
    stacked = torch.stack(list(z))  # (K, B, C, *s)
    if tau > 0:
        stacked = torch.softmax(stacked / tau, dim=2)
    w = weights.to(stacked.dtype)
    w = w.view(*w.shape, *([1] * (stacked.ndim - 3)))
    if w.shape[1] == 1:
        w = w.expand(-1, stacked.shape[1], *w.shape[2:])
    mixed = (w * stacked).sum(dim=0)
    if tau <= 0:
        return mixed
    return tau * (torch.log(mixed.clamp_min(EPS)) - torch.log(mixed.sum(dim=1, keepdim=True).clamp_min(EPS)))


def mimic_loss(student: torch.Tensor, ensemble: torch.Tensor, tau: float = 0.0) -> torch.Tensor:
    """Eq. 10 per input -> ``(B,)`` (mean over pixels).

    ``tau = 0`` (the paper's tau -> infinity): ``|S(x) - A(x)|^2``, the squared L2 distance of the logits summed
    over classes. ``tau > 0``: the KL divergence of Eq. 6 at temperature tau, ``tau^2 KL(p_tau(A) || p_tau(S))``
    (Table 6's tau = 1 column; tau^2 keeps the gradient scale of Hinton et al.).
    """
    if tau <= 0:
        return _mean_per_input(((student - ensemble) ** 2).sum(dim=1))
    log_s = torch.log_softmax(student / tau, dim=1)
    log_a = torch.log_softmax(ensemble / tau, dim=1)
    return _mean_per_input((log_a.exp() * (log_a - log_s)).sum(dim=1)) * tau**2


def label_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per input: the pixel-mean cross-entropy of segmentation logits ``(B, C, *s)`` to integer label maps ``(B, 1, *s)``
    -> ``(B,)``. Not in the paper: with ``lambda_label`` G is asked to draw images that the ensemble A segments as the
    label map that conditioned them, with ``student_label`` the student learns that label map too
    (jobs/fediod_seg/README.md measures both)."""
    per_pixel = F.cross_entropy(logits, labels[:, 0].long(), reduction="none")
    return _mean_per_input(per_pixel)


def discriminator_loss(real_logits: torch.Tensor, fake_logits: torch.Tensor) -> torch.Tensor:
    """D_k's side of Eq. 2 in the classical form: BCE(D(x'), real) + BCE(D(G(w)), fake), each a mean over patches."""
    return F.binary_cross_entropy_with_logits(real_logits, torch.ones_like(real_logits)) + F.binary_cross_entropy_with_logits(
        fake_logits, torch.zeros_like(fake_logits)
    )


def generator_adv_loss(fake_logits: torch.Tensor) -> torch.Tensor:
    """G's side of Eq. 2 per input (non-saturating form): ``BCE(D_k(G(w)), real)`` averaged over patches -> ``(B,)``."""
    per_patch = F.binary_cross_entropy_with_logits(fake_logits, torch.ones_like(fake_logits), reduction="none")
    return per_patch.reshape(per_patch.shape[0], -1).mean(dim=1)
