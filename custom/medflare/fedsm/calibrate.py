"""The FedSM selector head, calibrated on the server from per-class feature statistics (CCVR-style).

Why not federated training of the selector (Eq. 2)? Each site only ever has its own label, so local
training collapses to "always my site", and averaging such updates stays at chance: measured with
benchmarks/fedsm_selector_sync.py (Adam with local or server-averaged moments, the reference's one
full-batch step per round, SGD, lr 1e-3..1, VGG-11 and the style selector: every FL-trained variant
stays at chance or "always site-1" within the job's rounds). This positive-only label skew is what
CCVR (Luo et al., NeurIPS 2021, "No Fear of Heterogeneity") calibrates away: sites send the mean and
covariance of their features per class, the server samples virtual features from the class-conditional
Gaussians and fits the classifier on them. For the selector the class *is* the site (or, in FedSM-extra,
the Eq. 1 label), so:

- the selector's feature extractor (:meth:`StyleSelector.features`) is fixed: random-init convolutions
  plus image statistics, seeded by the server, which sends its weights; it is never trained;
- each site sends ``{label: (n, mean, cov)}`` of its training images' features (:func:`feature_stats`);
- the server fits the linear head by cross-entropy on samples from ``N(mean, cov + eps I)``
  (:func:`fit_head`), standardising the features and folding the standardisation into the Linear
  layer's weight and bias, so the saved selector is a plain module.

Plain torch, no FLARE.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from medflare import MedflareError

#: ``{label: {"n": int array, "mean": (d,), "cov": (d, d)}}`` as numpy arrays: what a site sends.
Stats = Mapping[str, Mapping[str, np.ndarray]]


def head_of(selector: nn.Module) -> nn.Linear:
    """The selector's calibrated head: a ``classifier`` that is one ``nn.Linear`` on ``features()``."""
    head = getattr(selector, "classifier", None)
    if not isinstance(head, nn.Linear) or not callable(getattr(selector, "features", None)):
        raise MedflareError(
            f"selector {type(selector).__name__} cannot be calibrated: it needs a features() method and a "
            "'classifier' that is one nn.Linear (use style_selector)"
        )
    return head


@torch.no_grad()
def selector_features(selector: nn.Module, batches: Iterable[torch.Tensor]) -> torch.Tensor:
    """Features of every image: batches of (B, C, H, W) -> (N, d) float64 on the CPU."""
    head_of(selector)
    selector.eval()
    out = [selector.features(x).double().cpu() for x in batches]
    if not out:
        raise MedflareError("selector_features: no images")
    return torch.cat(out)


def feature_stats(features: torch.Tensor, labels: Sequence[int] | torch.Tensor) -> dict[str, dict[str, np.ndarray]]:
    """Per-label count, mean and covariance: features (N, d), labels (N,) -> ``{str(label): {"n", "mean", "cov"}}``.

    A label with one case gets a zero covariance (the server adds ``eps I``).
    """
    labels = torch.as_tensor(labels, dtype=torch.long)
    if features.ndim != 2 or labels.shape != (features.shape[0],):
        raise MedflareError(f"feature_stats: need features (N, d) and labels (N,), got {tuple(features.shape)} and {tuple(labels.shape)}")
    out = {}
    for label in labels.unique().tolist():
        f = features[labels == label].double()
        cov = torch.cov(f.T).reshape(f.shape[1], f.shape[1]) if f.shape[0] > 1 else torch.zeros(f.shape[1], f.shape[1], dtype=f.dtype)
        out[str(label)] = {"n": np.asarray(f.shape[0]), "mean": f.mean(0).numpy(), "cov": cov.numpy()}
    return out


def add_noise(stats: Stats, std: float, seed: int | None = None) -> dict[str, dict[str, np.ndarray]]:
    """Gaussian noise of standard deviation ``std`` on every mean and (symmetrically) covariance entry.

    ``seed`` None (a site's use) draws fresh entropy, so the server cannot regenerate the noise.
    """
    if std < 0:
        raise MedflareError(f"add_noise: 'std' must be >= 0, got {std}")
    rng = np.random.default_rng(seed)
    out = {}
    for label, s in stats.items():
        noise = rng.normal(0.0, std, s["cov"].shape)
        out[label] = {"n": s["n"], "mean": s["mean"] + rng.normal(0.0, std, s["mean"].shape),
                      "cov": s["cov"] + (noise + noise.T) / 2}
    return out


def _sampler(cov: torch.Tensor, eps: float) -> torch.Tensor:
    """Square root of ``cov + eps I`` after clipping negative eigenvalues (noise can make cov indefinite)."""
    vals, vecs = torch.linalg.eigh((cov + cov.T) / 2)
    return vecs * (vals.clamp(min=0) + eps).sqrt()


def fit_head(
    site_stats: Sequence[Stats],
    num_classes: int,
    *,
    samples_per_class: int = 500,
    steps: int = 300,
    lr: float = 0.05,
    eps: float = 1e-3,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fit a linear head on virtual features: -> weight (num_classes, d), bias (num_classes,) acting on raw features.

    Each label's ``samples_per_class`` virtual features are drawn from the Gaussians ``N(mean, cov + eps I)``
    of the sites that reported it, split in proportion to their counts. The head is fitted by full-batch
    Adam on standardised features from zero weights (convex, deterministic for a seed) and the
    standardisation is folded in: ``W' = W / sd``, ``b' = b - W' m``. The virtual classes are usually
    separable, so ``steps`` x ``lr`` (early stopping) sets how confident the head is, which matters for the
    gamma threshold of Algorithm 2: on 6 synthetic sites lr 0.01 gave 100% accuracy but only 47-100% of a
    site's test cases above 0.9; lr 0.05 (default) 93-100%. A label nobody reported gets zero
    weights and a bias 30 below the lowest fitted one, so it is never chosen.
    """
    groups: dict[int, list[tuple[int, np.ndarray, np.ndarray]]] = {}
    for stats in site_stats:
        for label, s in stats.items():
            c = int(label)
            if not 0 <= c < num_classes:
                raise MedflareError(f"fit_head: label {label} outside 0..{num_classes - 1}")
            if int(s["n"]) > 0:
                groups.setdefault(c, []).append((int(s["n"]), np.asarray(s["mean"]), np.asarray(s["cov"])))
    if len(groups) < 2:
        raise MedflareError(f"fit_head: need statistics of at least 2 labels, got {sorted(groups)}")
    gen = torch.Generator().manual_seed(seed)
    xs, ys = [], []
    for c, comps in sorted(groups.items()):
        total = sum(n for n, _, _ in comps)
        for n, mean, cov in comps:
            m = max(1, round(samples_per_class * n / total))
            mean_t = torch.as_tensor(mean, dtype=torch.float64)
            root = _sampler(torch.as_tensor(cov, dtype=torch.float64), eps)
            xs.append(mean_t + torch.randn(m, mean_t.shape[0], generator=gen, dtype=torch.float64) @ root.T)
            ys.append(torch.full((m,), c, dtype=torch.long))
    x, y = torch.cat(xs), torch.cat(ys)
    mu, sd = x.mean(0), x.std(0) + 1e-6
    z = ((x - mu) / sd).float()
    head = nn.Linear(x.shape[1], num_classes)
    nn.init.zeros_(head.weight), nn.init.zeros_(head.bias)
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    with torch.enable_grad():
        for _ in range(steps):
            opt.zero_grad()
            nn.functional.cross_entropy(head(z), y).backward()
            opt.step()
    w, b = fold_standardisation(head.weight.detach().double(), head.bias.detach().double(), mu, sd)
    absent = [c for c in range(num_classes) if c not in groups]
    if absent:
        present = [c for c in range(num_classes) if c in groups]
        w[absent] = 0
        b[absent] = b[present].min() - 30
    return w.float(), b.float()


def fold_standardisation(weight: torch.Tensor, bias: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear layer on ``(x - mean) / std`` as one on ``x``: weight (C, d), bias (C,), mean and std (d,)."""
    w = weight / std
    return w, bias - w @ mean


def set_head(selector: nn.Module, weight: torch.Tensor, bias: torch.Tensor) -> None:
    """Write a fitted head into the selector's ``classifier``."""
    head = head_of(selector)
    if tuple(weight.shape) != tuple(head.weight.shape):
        raise MedflareError(f"set_head: weight {tuple(weight.shape)} does not fit the selector head {tuple(head.weight.shape)}")
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.copy_(bias)
