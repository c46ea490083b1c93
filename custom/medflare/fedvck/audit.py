"""Are condensed images copies of real ones? Nearest-neighbour distances in pixel space (a memorisation audit).

A condensed image that copies (or nearly copies) a patient's image sits closer to that image than distinct
real images of the data set sit to each other. So for each condensed image we take the RMS pixel distance
to its nearest real training image, and compare it with the same distance for every real image to its
nearest *other* real image (the data set's own spacing). Quantisation to uint8 moves a pixel by at most
1/510, so an exact copy shows an RMS distance <= 0.002.
"""

from __future__ import annotations

import torch


def nearest_distances(queries: torch.Tensor, references: torch.Tensor, exclude_self: bool = False, chunk: int = 1024) -> torch.Tensor:
    """(Q, C, H, W), (R, C, H, W) -> (Q,) RMS pixel distance of each query to its nearest reference.

    ``exclude_self``: queries are the references (same order); an image's distance to itself is skipped.
    """
    q = queries.reshape(len(queries), -1).double()
    r = references.reshape(len(references), -1).double()
    out = []
    for start in range(0, len(q), chunk):
        d = torch.cdist(q[start : start + chunk], r)
        if exclude_self:
            rows = torch.arange(d.shape[0])
            d[rows, rows + start] = float("inf")
        out.append(d.min(1).values)
    return torch.cat(out) / q.shape[1] ** 0.5
