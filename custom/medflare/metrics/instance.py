"""Instance segmentation metrics (nuclei, glands): AJI and object-level Dice on instance label maps.

An instance label map is a numpy int array (H, W) (or (H, W, D)): 0 = background, each object has
its own positive id (ids need not be consecutive). Both metrics are in [0, 1], higher is better;
both empty -> 1.0, exactly one empty -> 0.0.
"""

from __future__ import annotations

import numpy as np

from medflare import MedflareError

__all__ = ["to_instances", "aggregated_jaccard_index", "object_dice"]


def to_instances(binary_mask: np.ndarray, connectivity: int | None = None) -> np.ndarray:
    """Connected components of a binary (or multi-class: > 0 is foreground) mask -> int instance map, same shape.

    :func:`skimage.measure.label` with full connectivity by default (8-neighbourhood in 2D).
    """
    from skimage.measure import label

    mask = np.asarray(binary_mask) > 0
    return label(mask, background=0, connectivity=connectivity).astype(np.int64)


def _overlaps(pred_inst: np.ndarray, target_inst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Intersection matrix (n_target, n_pred) and the instance areas (n_target,), (n_pred,)."""
    pred_inst, target_inst = np.asarray(pred_inst), np.asarray(target_inst)
    if pred_inst.shape != target_inst.shape:
        raise MedflareError(f"'pred_inst' shape {pred_inst.shape} differs from 'target_inst' shape {target_inst.shape}")
    p_ids, p = np.unique(pred_inst.ravel(), return_inverse=True)
    t_ids, t = np.unique(target_inst.ravel(), return_inverse=True)
    joint = np.zeros((len(t_ids), len(p_ids)), dtype=np.int64)
    np.add.at(joint, (t.ravel(), p.ravel()), 1)
    t_area, p_area = joint.sum(axis=1), joint.sum(axis=0)
    t_keep, p_keep = t_ids != 0, p_ids != 0  # drop background
    return joint[t_keep][:, p_keep], t_area[t_keep], p_area[p_keep]


def aggregated_jaccard_index(pred_inst: np.ndarray, target_inst: np.ndarray) -> float:
    """Aggregated Jaccard Index (Kumar et al. 2017) of two instance maps (H, W) int -> float in [0, 1].

    For each ground-truth object G_i take the predicted object S_j with the largest IoU; add
    |G_i ∩ S_j| to C and |G_i ∪ S_j| to U (a G_i overlapping no prediction adds |G_i| to U). Then
    add the area of every predicted object never chosen to U. AJI = C / U. As in the original, one
    prediction may be chosen by several ground-truth objects (AJI, not the one-to-one AJI+).
    """
    inter, t_area, p_area = _overlaps(pred_inst, target_inst)
    if len(t_area) == 0 and len(p_area) == 0:
        return 1.0
    if len(t_area) == 0 or len(p_area) == 0:
        return 0.0
    union = t_area[:, None] + p_area[None, :] - inter
    iou = inter / union
    c = u = 0
    used = np.zeros(len(p_area), dtype=bool)
    for i in range(len(t_area)):
        j = int(np.argmax(iou[i]))
        if inter[i, j] == 0:
            u += t_area[i]
            continue
        c += inter[i, j]
        u += union[i, j]
        used[j] = True
    u += p_area[~used].sum()
    return float(c / u)


def object_dice(pred_inst: np.ndarray, target_inst: np.ndarray) -> float:
    """Object-level Dice (Sirinukunwattana et al. 2017, GlaS) of two instance maps (H, W) int -> float in [0, 1].

    ``0.5 * [sum_i w_i Dice(G_i, S*(G_i)) + sum_j v_j Dice(G*(S_j), S_j)]`` with w_i = |G_i| / sum|G|,
    v_j = |S_j| / sum|S|, and S*(G_i) the predicted object with the largest intersection with G_i
    (Dice 0 when none intersects), G*(S_j) likewise.
    """
    inter, t_area, p_area = _overlaps(pred_inst, target_inst)
    if len(t_area) == 0 and len(p_area) == 0:
        return 1.0
    if len(t_area) == 0 or len(p_area) == 0:
        return 0.0
    dice = 2 * inter / (t_area[:, None] + p_area[None, :])
    best_for_target = dice[np.arange(len(t_area)), np.argmax(inter, axis=1)]
    best_for_pred = dice[np.argmax(inter, axis=0), np.arange(len(p_area))]
    term_t = float((t_area / t_area.sum() * best_for_target).sum())
    term_p = float((p_area / p_area.sum() * best_for_pred).sum())
    return 0.5 * (term_t + term_p)
