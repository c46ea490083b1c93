"""Partitioners that split one labelled pool over federated sites."""

from __future__ import annotations

import numpy as np

from medflare import ConfigError


def dirichlet_label_skew(
    labels: np.ndarray, num_sites: int, beta: float, seed: int = 0, min_per_site: int = 10
) -> list[np.ndarray]:
    """Split sample indices over ``num_sites`` by Dirichlet(``beta``) label skew (NIID-Bench scheme).

    For each class, its samples are dealt to sites in proportions drawn from Dir(beta); a site already
    holding more than its fair share N/K gets no more (keeps sizes within reason, as in NIID-Bench).
    Small beta (0.01-0.1) leaves each site dominated by one or two classes; beta=1 is mildly skewed.
    Sites left with fewer than ``min_per_site`` samples are topped up from the largest site's majority
    class, so every site is usable. Every index appears in exactly one returned (sorted) array.

    Args:
        labels: class labels, shape (N,) or (N, 1), integers.
        num_sites: number of sites K.
        beta: Dirichlet concentration (> 0).
        seed: seed of the draw.
        min_per_site: smallest number of samples a site may hold.
    """
    labels = np.asarray(labels).reshape(len(labels), -1)
    if labels.shape[1] != 1:
        raise ConfigError(f"dirichlet_label_skew: labels must have shape (N,) or (N, 1), got {labels.shape}")
    labels = labels[:, 0].astype(np.int64)
    if num_sites < 1:
        raise ConfigError(f"dirichlet_label_skew: num_sites must be >= 1, got {num_sites}")
    if not beta > 0:
        raise ConfigError(f"dirichlet_label_skew: beta must be > 0, got {beta}")
    n = len(labels)
    if n < num_sites * min_per_site:
        raise ConfigError(
            f"dirichlet_label_skew: {n} samples cannot give {num_sites} sites at least {min_per_site} each"
        )
    rng = np.random.default_rng(seed)
    parts: list[list[int]] = [[] for _ in range(num_sites)]
    for cls in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == cls))
        props = rng.dirichlet(np.full(num_sites, beta))
        props = props * np.array([len(p) < n / num_sites for p in parts])
        props = props / props.sum() if props.sum() > 0 else np.full(num_sites, 1.0 / num_sites)
        cuts = (np.cumsum(props) * len(idx)).astype(int)[:-1]
        for part, chunk in zip(parts, np.split(idx, cuts)):
            part.extend(chunk.tolist())

    for site in range(num_sites):  # top up starved sites from the largest site's majority class
        while len(parts[site]) < min_per_site:
            donor = max(range(num_sites), key=lambda s: len(parts[s]))
            donor_labels = labels[parts[donor]]
            majority = np.bincount(donor_labels).argmax()
            take = min(min_per_site - len(parts[site]), int((donor_labels == majority).sum()),
                       len(parts[donor]) - min_per_site)
            moved = [i for i in parts[donor] if labels[i] == majority][:take]
            parts[site].extend(moved)
            moved_set = set(moved)
            parts[donor] = [i for i in parts[donor] if i not in moved_set]
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
