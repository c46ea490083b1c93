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
on WEIGHTS / WEIGHT_DIFF) lets every FedVCK reply pass.
"""

from nvflare.apis.dxo import DataKind

from medflare.common.egress import RESULT, Send, declare

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
