"""What the FedIOD server and sites exchange: task names, DXO parts and data kinds, meta keys.

Every payload is a DXO whose data FLARE's filters see; each kind of site output has its own data kind, so a
site's privacy scope can block any one of them (FLARE's ``DXOBlocker`` takes kind names). Replies are
COLLECTIONs of named parts. Nothing a site sends is a WEIGHTS / WEIGHT_DIFF DXO, so the ``no_weights``
scope (DXOBlocker on those kinds) passes every FedIOD reply and would refuse any that held weights.

==========================  =====================  ==============================================================
task                        server -> site         site -> server (COLLECTION parts)
==========================  =====================  ==============================================================
``fediod_teacher``          ``FEDIOD_REQUEST`` {}  ``label_counts`` STATISTICS {counts (C,), size (1,)} (noised under DP);
                                                   ``teacher`` METRICS {own-data accuracy/Dice, num_outputs}
``fediod_outputs``          ``FEDIOD_INPUTS``      ``logits`` FEDIOD_LOGITS {z (M, B, C, *s)};
                            {x (M,B,C,H,W),        ``scores`` FEDIOD_SCORES {r (M, B)};
                            y (M,B,1,H,W) seg}     ``privacy`` METRICS {epsilon, delta, ...}
``fediod_gradients``        ``FEDIOD_OUTPUT_GRA    ``input_gradients`` FEDIOD_INPUT_GRADIENTS {v (M, B, C, H, W)};
                            DIENTS`` {g_z, g_r,    ``privacy`` METRICS
                            adv_weight (1,) or
                            (M, B),
                            prior_weight (1,)}
``fediod_validate``         WEIGHTS (the student)  ``metrics`` METRICS {val_* of the student}; with ``CALIBRATE``
                            (meta ``CALIBRATE``)   in the request's meta: {val_<key>_offset_<d>}, the key metric at each
                                                   of the preset's ``calibrate_offsets`` (:mod:`.calibration`)
==========================  =====================  ==============================================================

A site that will not answer a window (its epsilon budget would be exceeded) replies with only the
``privacy`` part and ``STATUS = "stopped"`` plus ``REASON`` in the collection's meta.
"""

from medflare.common.egress import Send, declare

TASK_TEACHER = "fediod_teacher"
TASK_OUTPUTS = "fediod_outputs"
TASK_GRADIENTS = "fediod_gradients"
TASK_VALIDATE = "fediod_validate"
TASKS = (TASK_TEACHER, TASK_OUTPUTS, TASK_GRADIENTS, TASK_VALIDATE)

# data kinds (DXOBlocker and every DXOFilter select on these)
KIND_REQUEST = "FEDIOD_REQUEST"
KIND_INPUTS = "FEDIOD_INPUTS"
KIND_OUTPUT_GRADIENTS = "FEDIOD_OUTPUT_GRADIENTS"
KIND_LOGITS = "FEDIOD_LOGITS"
KIND_SCORES = "FEDIOD_SCORES"
KIND_INPUT_GRADIENTS = "FEDIOD_INPUT_GRADIENTS"

# parts of a reply
PART_COUNTS = "label_counts"
PART_TEACHER = "teacher"
PART_LOGITS = "logits"
PART_SCORES = "scores"
PART_PRIVACY = "privacy"
PART_GRADIENTS = "input_gradients"
PART_METRICS = "metrics"

# meta keys
STATUS = "fediod_status"  # "ok" | "stopped"
REASON = "fediod_reason"  # why a site stopped
WINDOW = "fediod_window"  # window index of a request (a reply must answer the window it was asked for)
CALIBRATE = "fediod_calibrate"  # a validation request for the key metric at each decision offset (segmentation)


def manifest() -> dict:
    """What a FedIOD site sends, per task (:func:`medflare.common.egress.declare`): the table above; shapes scale with
    the preset's ``fediod`` window settings (M batches of B generated inputs), so no byte bound is computed here."""
    privacy = Send(PART_PRIVACY, "METRICS", "the site's DP state: epsilon, delta, noise multiplier, clip, windows",
                   cadence="every window")
    return declare({
        TASK_TEACHER: [Send(PART_COUNTS, "STATISTICS", "per-class label counts (C,) and the training-set size (noised under DP)",
                            cadence="once"),
                       Send(PART_TEACHER, "METRICS", "the teacher's scores on its own validation split, its output count",
                            cadence="once")],
        TASK_OUTPUTS: [Send(PART_LOGITS, KIND_LOGITS, "teacher logits on the server's generated inputs (M, B, C, *s)",
                            cadence="every window"),
                       Send(PART_SCORES, KIND_SCORES, "discriminator scores of the generated inputs (M, B)", cadence="every window"),
                       privacy],
        TASK_GRADIENTS: [Send(PART_GRADIENTS, KIND_INPUT_GRADIENTS, "clipped (+ noised under DP) input gradients (M, B, C, H, W)",
                              cadence="every window"),
                         privacy],
        TASK_VALIDATE: [Send(PART_METRICS, "METRICS", "the student's scores on the site's validation split (segmentation with "
                                                      "calibrate_offsets: also its key metric at each decision offset)")],
    }, meta={TASK_TEACHER: [STATUS], TASK_OUTPUTS: [STATUS, REASON, WINDOW], TASK_GRADIENTS: [STATUS, WINDOW, "round"],
             TASK_VALIDATE: [STATUS]})
