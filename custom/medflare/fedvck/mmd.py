"""Maximum mean discrepancy between real and condensed features in an RKHS (FedVCK Eq. 2, 3 and 9).

Eq. 3 is the biased (V-statistic) empirical MMD^2 with kernel K on encoder features::

    MMD^2(X, Y) = mean_ij K(x_i, x_j) + mean_ij K(y_i, y_j) - 2 mean_ij K(x_i, y_j)

- ``linear``: K(a, b) = a . b, for which MMD^2 = ||mean(X) - mean(Y)||^2 (Eq. 2, distribution matching; the
  reference code's default); computed in that closed form, O((n + m) d) instead of O((n + m)^2 d).
- ``gaussian``: a sum of RBF kernels exp(-||a - b||^2 / (s * sigma^2)) over s in ``MULTIPLIERS`` (M3D, Zhang et
  al. AAAI 2024, as the reference code), sigma^2 = the mean squared distance between distinct points of the
  stacked set [X; Y], treated as a constant (no gradient through the bandwidth).

Eq. 9 sums MMD^2 over the classes of the condensed set (real batches drawn per class by P_w).
"""

from __future__ import annotations

from typing import Sequence

import torch

from medflare import ConfigError
from medflare.fedvck.config import KERNELS

#: bandwidth multipliers of the Gaussian kernel (5 kernels, factor 2 apart, centred on the data's scale)
MULTIPLIERS = (0.25, 0.5, 1.0, 2.0, 4.0)


def check_kernel(kernel: str) -> str:
    if kernel not in KERNELS:
        raise ConfigError(f"unknown MMD kernel '{kernel}' (known: {list(KERNELS)})")
    return kernel


def gaussian_kernel(x: torch.Tensor, y: torch.Tensor, sigma2: torch.Tensor | float, multipliers: Sequence[float] = MULTIPLIERS) -> torch.Tensor:
    """(n, d), (m, d) -> (n, m): sum over s of exp(-||x_i - y_j||^2 / (s * sigma2))."""
    d2 = torch.cdist(x, y).pow(2)
    return sum(torch.exp(-d2 / (s * sigma2)) for s in multipliers)


def bandwidth(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """sigma^2 = mean squared distance between distinct points of [X; Y] (detached); 1 if all points coincide."""
    z = torch.cat([x, y]).detach()
    n = z.shape[0]
    if n < 2:
        return torch.ones((), dtype=z.dtype, device=z.device)
    total = torch.cdist(z, z).pow(2).sum() / (n * n - n)
    return total if total > 0 else torch.ones_like(total)


def mmd2(x: torch.Tensor, y: torch.Tensor, kernel: str = "linear") -> torch.Tensor:
    """Eq. 3 between features ``x`` (n, d) and ``y`` (m, d); a scalar >= 0 (up to rounding)."""
    check_kernel(kernel)
    if x.ndim != 2 or y.ndim != 2 or x.shape[1] != y.shape[1] or not len(x) or not len(y):
        raise ConfigError(f"mmd2 needs non-empty (n, d) and (m, d) features, got {tuple(x.shape)} and {tuple(y.shape)}")
    if kernel == "linear":
        return (x.mean(0) - y.mean(0)).pow(2).sum()
    s2 = bandwidth(x, y)
    return gaussian_kernel(x, x, s2).mean() + gaussian_kernel(y, y, s2).mean() - 2 * gaussian_kernel(x, y, s2).mean()


def classwise_mmd(
    real: torch.Tensor, real_labels: torch.Tensor, syn: torch.Tensor, syn_labels: torch.Tensor, kernel: str = "linear"
) -> tuple[torch.Tensor, dict[int, float]]:
    """Eq. 9: sum over the classes of ``syn_labels`` of MMD^2(real features of c, synthetic features of c).

    ``real`` (N, d) with ``real_labels`` (N,), ``syn`` (M, d) with ``syn_labels`` (M,). Every class of the
    synthetic set must have real features. Returns the loss and the per-class values (for the logs).
    """
    total = syn.new_zeros(())
    per_class: dict[int, float] = {}
    for c in torch.unique(syn_labels).tolist():
        r = real[real_labels == c]
        if not len(r):
            raise ConfigError(f"classwise_mmd: class {c} has condensed images but no real features in the batch")
        term = mmd2(r, syn[syn_labels == c], kernel)
        per_class[int(c)] = float(term.detach())
        total = total + term
    return total, per_class
