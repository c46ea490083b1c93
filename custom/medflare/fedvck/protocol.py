"""What the FedVCK server and sites exchange: task names, reply parts and their DXO data kinds.

Server -> site, task ``condense`` (every round) and ``validate`` (once, after the last round): the global
model as FULL weights (a WEIGHTS DXO), round numbers in the task header. Nothing else: the algorithm's
settings come from the preset both sides resolve.

Site -> server: one COLLECTION DXO, each part a DXO of its own data kind, so a site's privacy filters see
every part and can act on one kind (FLARE's DXOFilter recurses into collections):

- ``condensed`` (:data:`CONDENSED_SET`): ``images`` uint8 (M, C, H, W), ``labels`` int64 (M,), the site's
  condensed set S after this round (M = 0 when the site shares no class);
- ``prototypes`` (:data:`LOGIT_PROTOTYPES`): ``logits`` float32 (K, K), row c the mean logit vector of the
  received model over the site's images of class c (Eq. 11), zero for a class it does not share;
  ``counts`` int64 (K,), the number of those images (0 = not shared);
- ``metrics`` (FLARE's METRICS): the received model's validation ``accuracy`` and ``val_cases``
  (``validate`` task: validation and test scores).

No weights, gradients or BN statistics leave a site, so the ``no_weights`` privacy scope (FLARE's DXOBlocker
on WEIGHTS / WEIGHT_DIFF) lets every FedVCK reply pass. A site packs its reply with :func:`pack_reply`, the server
reads it back, checked, with :func:`unpack_reply`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch
from nvflare.apis.dxo import DXO, DataKind

from medflare import PayloadError
from medflare.common.egress import RESULT, Send, declare
from medflare.common.payload import collection

TASK_CONDENSE = "condense"
TASK_VALIDATE = "validate"

#: DXO data kind of a condensed set (custom kind: FLARE's DXO accepts any string; filters select by it)
CONDENSED_SET = "CONDENSED_SET"
#: DXO data kind of logit prototypes with class counts
LOGIT_PROTOTYPES = "LOGIT_PROTOTYPES"

PART_CONDENSED = "condensed"
PART_PROTOTYPES = "prototypes"
PART_METRICS = "metrics"

#: reply part -> (data kind, the keys its data may hold; None = any metric name)
PARTS = {
    PART_CONDENSED: (CONDENSED_SET, ("images", "labels")),
    PART_PROTOTYPES: (LOGIT_PROTOTYPES, ("logits", "counts")),
    PART_METRICS: (DataKind.METRICS, None),
}


def manifest() -> dict:
    """What a FedVCK site sends per task (the parts above; :func:`medflare.common.egress.declare`). The condensed
    set's size follows the site's data (``fedvck.ipc_percent`` of its images per class, at least ``min_ipc``), so no
    byte bound is computed here; the site's ``condensed`` scope caps it (``max_per_class``)."""
    return declare({
        TASK_CONDENSE: [Send(PART_CONDENSED, CONDENSED_SET, "condensed synthetic images (uint8) and their labels"),
                        Send(PART_PROTOTYPES, LOGIT_PROTOTYPES, "per-class mean logits (K, K) of the received model and "
                                                                "per-class image counts (K,)"),
                        Send(PART_METRICS, "METRICS", "the received model's validation accuracy and case count")],
        TASK_VALIDATE: [Send(RESULT, "METRICS", "the final model's validation and test scores", cadence="last round")],
    })


def pack_reply(images: np.ndarray, labels: np.ndarray, logits: np.ndarray, counts: np.ndarray, metrics: Mapping[str, float]) -> DXO:
    """The COLLECTION a site returns: condensed set, logit prototypes with counts, validation metrics."""
    return collection({
        PART_CONDENSED: DXO(CONDENSED_SET, data={"images": np.asarray(images, dtype=np.uint8), "labels": np.asarray(labels, dtype=np.int64)}),
        PART_PROTOTYPES: DXO(LOGIT_PROTOTYPES, data={"logits": np.asarray(logits, dtype=np.float32), "counts": np.asarray(counts, dtype=np.int64)}),
        PART_METRICS: DXO(DataKind.METRICS, data={k: float(v) for k, v in metrics.items()}),
    })


@dataclass
class SiteUpload:
    """One site's checked reply: images float32 (M, C, H, W) in [0, 1], labels (M,), logits (K, K), counts (K,), metrics."""

    images: torch.Tensor
    labels: torch.Tensor
    logits: torch.Tensor
    counts: torch.Tensor
    metrics: dict[str, float]
    filters: list[str]


def _part(params: Mapping[str, Any], name: str, site: str) -> DXO:
    kind, keys = PARTS[name]
    part = params.get(name)
    if not isinstance(part, DXO) or part.data_kind != kind:
        got = part.data_kind if isinstance(part, DXO) else type(part).__name__
        raise PayloadError(f"site '{site}': reply part '{name}' must be a {kind} DXO, got {got}")
    if keys is not None and set(part.data) != set(keys):
        raise PayloadError(f"site '{site}': reply part '{name}' holds {sorted(part.data)}, expected {sorted(keys)}")
    return part


def unpack_reply(params: Any, site: str, num_classes: int, image_shape: tuple[int, ...] | None = None) -> SiteUpload:
    """Check a site's reply (the FLModel params of a COLLECTION: {part: DXO}) and convert it; PayloadError names the site.

    ``image_shape`` (C, H, W), when given, must match every condensed image. Images may arrive as uint8 (as
    sent) or, after a site filter that works in floats, as floats in [0, 1].
    """
    if not isinstance(params, Mapping):
        raise PayloadError(f"site '{site}': the reply is not a DXO collection (got {type(params).__name__})")
    extra = sorted(set(params) - set(PARTS))
    if extra:
        raise PayloadError(f"site '{site}': the reply holds unexpected parts {extra} (expected {sorted(PARTS)})")
    cond, proto, met = (_part(params, name, site) for name in (PART_CONDENSED, PART_PROTOTYPES, PART_METRICS))
    images, labels = np.asarray(cond.data["images"]), np.asarray(cond.data["labels"])
    if images.ndim != 4 or labels.shape != (len(images),):
        raise PayloadError(f"site '{site}': condensed images {images.shape} and labels {labels.shape} do not pair up as (M, C, H, W) and (M,)")
    if image_shape is not None and len(images) and tuple(images.shape[1:]) != tuple(image_shape):
        raise PayloadError(f"site '{site}': condensed images are {tuple(images.shape[1:])}, the job's images are {tuple(image_shape)}")
    if len(labels) and (not np.issubdtype(labels.dtype, np.integer) or labels.min() < 0 or labels.max() >= num_classes):
        raise PayloadError(f"site '{site}': condensed labels must be integers in [0, {num_classes})")
    if images.dtype == np.uint8:
        x = torch.from_numpy(images.astype(np.float32) / 255.0)
    elif np.issubdtype(images.dtype, np.floating) and np.isfinite(images).all():
        x = torch.from_numpy(np.clip(images, 0.0, 1.0).astype(np.float32))
    else:
        raise PayloadError(f"site '{site}': condensed images must be uint8 or finite floats, got {images.dtype}")
    logits, counts = np.asarray(proto.data["logits"]), np.asarray(proto.data["counts"])
    if logits.shape != (num_classes, num_classes) or counts.shape != (num_classes,):
        raise PayloadError(f"site '{site}': prototypes {logits.shape} and counts {counts.shape}, expected ({num_classes}, {num_classes}) and ({num_classes},)")
    if not np.isfinite(logits).all() or not np.issubdtype(counts.dtype, np.integer) or (counts < 0).any():
        raise PayloadError(f"site '{site}': prototypes must be finite and counts non-negative integers")
    filters = [f for part in (cond, proto, met) for f in (part.get_filter_history() or [])]
    return SiteUpload(x, torch.from_numpy(labels.astype(np.int64)), torch.from_numpy(logits.astype(np.float32)),
                      torch.from_numpy(counts.astype(np.int64)), {k: float(v) for k, v in met.data.items()}, sorted(set(filters)))
