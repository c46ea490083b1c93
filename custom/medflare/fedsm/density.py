"""The selector's density model: one Gaussian of encoder features per site, calibrated on the site's own validation cases.

Algorithm 2 routes a case to a personalised model when the selector is confident and to the global model
otherwise, "because maybe none of the personalised models is suitable" (paper, Sec. 3.3). With per-site
Gaussians that confidence has a meaning a user can set without an unseen site to tune on:

- site k's training features give a mean and covariance; the covariance is shrunk towards its diagonal
  (:func:`shrunk_precision`; a site has tens of cases and the features have tens of dimensions);
- the squared Mahalanobis distance ``d2_k(x)`` of a case to site k is, on site k's *own held-out
  validation cases*, close to a scaled chi-square; its two moments there fix scale and degrees of freedom
  (:func:`calibration`; the degrees of freedom are capped at the feature dimension, their value for a
  Gaussian, so that a handful of validation cases cannot make the fit over-tight);
- the selector's confidence for site k is the tail probability ``typicality_k(x) = P(chi2 > d2_k(x))``
  (:func:`typicality`): about uniform on [0, 1] for site k's own cases, near 0 far from site k.

So ``max_k typicality_k(x) > gamma`` keeps about ``1 - gamma`` of a seen site's cases on personalised
models, and a case atypical of every site (an unseen scanner) goes to the global model. A site computes its
Gaussian and the validation moments locally (:func:`site_gaussian`), all in one pass, so nothing needs an
extra round trip. Plain torch, no FLARE.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch

from medflare import ConfigError, DataError, PayloadError

#: what a site sends for its Gaussian (float64 numpy arrays): count, mean (d,), covariance (d, d), and the
#: count, mean and variance of its validation cases' squared Mahalanobis distances under that Gaussian
Stats = Mapping[str, np.ndarray]


def feature_moments(features: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Count, mean (d,) and covariance (d, d) of features (N, d), in float64 (covariance 0 for N = 1)."""
    if features.ndim != 2 or features.shape[0] < 1:
        raise DataError(f"feature_moments: need features (N >= 1, d), got shape {tuple(features.shape)}")
    f = features.double()
    n, d = f.shape
    cov = torch.cov(f.T).reshape(d, d) if n > 1 else torch.zeros(d, d, dtype=f.dtype)
    return n, f.mean(0), cov


def add_relative_noise(mean: torch.Tensor, cov: torch.Tensor, rel_std: float, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian noise on a mean and (symmetrically) a covariance, in units of each feature's standard deviation.

    ``mean_j += N(0, (rel_std s_j)^2)`` and ``cov_ij += N(0, (rel_std s_i s_j)^2)`` (symmetrised), with
    ``s = sqrt(diag(cov))``, so ``rel_std`` means the same whatever a feature's scale. The noised covariance
    may be indefinite; :func:`shrunk_precision` clips it.
    """
    if rel_std < 0:
        raise ConfigError(f"add_relative_noise: 'rel_std' must be >= 0, got {rel_std}")
    if rel_std == 0:
        return mean.clone(), cov.clone()
    s = torch.diagonal(cov).clamp(min=0).sqrt()
    noise = torch.randn(cov.shape, generator=generator, dtype=cov.dtype)
    noise = (noise + noise.T) / 2 ** 0.5
    return (mean + rel_std * s * torch.randn(mean.shape, generator=generator, dtype=mean.dtype),
            cov + rel_std * torch.outer(s, s) * noise)


def shrunk_precision(cov: torch.Tensor, shrinkage: float) -> torch.Tensor:
    """Inverse of ``(1 - a) cov + a diag(cov)`` (a = ``shrinkage``), eigenvalues floored at 1e-6 of the mean variance.

    Shrinking towards the diagonal keeps every feature's variance and is equivariant to rescaling a feature,
    so the distance does not depend on feature units. The floor keeps a noised or rank-deficient
    covariance invertible.
    """
    if not 0 <= shrinkage <= 1:
        raise ConfigError(f"shrunk_precision: 'shrinkage' must lie in [0, 1], got {shrinkage}")
    c = (cov.double() + cov.double().T) / 2
    c = (1 - shrinkage) * c + shrinkage * torch.diag(torch.diagonal(c))
    vals, vecs = torch.linalg.eigh(c)
    floor = max(float(torch.diagonal(c).clamp(min=0).mean()), 1e-12) * 1e-6
    return (vecs / vals.clamp(min=floor)) @ vecs.T


def mahalanobis_sq(features: torch.Tensor, mean: torch.Tensor, precision: torch.Tensor) -> torch.Tensor:
    """Squared Mahalanobis distance of each row: features (B, d), mean (d,), precision (d, d) -> (B,)."""
    v = features.to(precision.dtype) - mean.to(precision.dtype)
    return ((v @ precision) * v).sum(1).clamp(min=0)


def calibration(n: int, d2_mean: float, d2_var: float, dim: int) -> tuple[float, float]:
    """(scale, dof) of the scaled chi-square ``scale * chi2(dof)`` matching the validation distances' moments.

    Method of moments: ``dof = 2 m^2 / v``, ``scale = m / dof``; dof is capped at ``dim`` (the value for
    Gaussian features, and a guard against an over-tight fit from a few similar cases); with fewer than 3
    validation cases the variance is not trusted and dof = ``dim``.
    """
    if n < 1 or not d2_mean > 0:
        raise PayloadError(f"calibration: need >= 1 validation case with a positive mean distance, got n={n}, mean={d2_mean}")
    dof = float(dim) if n < 3 or not d2_var > 0 else min(max(2 * d2_mean**2 / d2_var, 1.0), float(dim))
    return d2_mean / dof, dof


def typicality(d2: torch.Tensor, scale: torch.Tensor | float, dof: torch.Tensor | float) -> torch.Tensor:
    """Tail probability ``P(scale * chi2(dof) > d2)`` elementwise, in [0, 1]: 1 at the site's centre, -> 0 far away."""
    d2 = torch.as_tensor(d2, dtype=torch.float64)
    scale = torch.as_tensor(scale, dtype=torch.float64)
    dof = torch.as_tensor(dof, dtype=torch.float64)
    return torch.special.gammaincc(dof / 2, d2 / (2 * scale))


def site_gaussian(
    train: torch.Tensor,
    val: torch.Tensor,
    shrinkage: float,
    noise: float = 0.0,
    generator: torch.Generator | None = None,
) -> dict[str, np.ndarray]:
    """What a site sends for the selector: its (noised) feature Gaussian and its validation distances' moments.

    train (N, d) and val (M, d) features. The validation distances are taken under the Gaussian the
    server will use (noised, shrunk), so the server's typicality is calibrated for exactly what it gets.
    Without validation cases the training distances stand in (they are optimistic: the fit has seen them).
    """
    n, mean, cov = feature_moments(train)
    mean, cov = add_relative_noise(mean, cov, noise, generator)
    held_out = val if val.shape[0] else train
    d2 = mahalanobis_sq(held_out.double(), mean, shrunk_precision(cov, shrinkage))
    var = float(d2.var()) if d2.numel() > 1 else 0.0
    return {"n": np.asarray(n), "mean": mean.numpy(), "cov": cov.numpy(), "val_n": np.asarray(int(val.shape[0])),
            "val_d2_mean": np.asarray(float(d2.mean())), "val_d2_var": np.asarray(var)}


def check_stats(stats: Stats, dim: int, who: str) -> None:
    """PayloadError naming ``who`` unless ``stats`` holds a finite Gaussian of dimension ``dim``."""
    missing = [k for k in ("n", "mean", "cov", "val_n", "val_d2_mean", "val_d2_var") if k not in stats]
    if missing:
        raise PayloadError(f"feature statistics from {who} lack {missing}")
    mean, cov = np.asarray(stats["mean"]), np.asarray(stats["cov"])
    if mean.shape != (dim,) or cov.shape != (dim, dim):
        raise PayloadError(f"feature statistics from {who}: mean {mean.shape} / cov {cov.shape}, expected ({dim},) / ({dim}, {dim})")
    if not (np.isfinite(mean).all() and np.isfinite(cov).all()) or int(stats["n"]) < 1:
        raise PayloadError(f"feature statistics from {who} are not finite or count no case")


def pooled_moments(stats: Sequence[Stats]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean (d,) and standard deviation (d,) of all sites' training features together (within + between sites)."""
    ns = torch.tensor([float(s["n"]) for s in stats], dtype=torch.float64)
    means = torch.stack([torch.as_tensor(np.asarray(s["mean"]), dtype=torch.float64) for s in stats])
    variances = torch.stack([torch.as_tensor(np.diagonal(np.asarray(s["cov"])).copy(), dtype=torch.float64) for s in stats])
    w = ns / ns.sum()
    mean = (w[:, None] * means).sum(0)
    var = (w[:, None] * (variances.clamp(min=0) + (means - mean) ** 2)).sum(0)
    return mean, var.sqrt().clamp(min=1e-6)
