"""Metrics on label maps and instance maps, and the one ``evaluate()`` every job and the CLI use.

Segmentation metrics take integer label maps (B, 1, H, W[, D]) and return per-case values; the
conventions for empty masks are documented in :mod:`medflare.metrics.segmentation`, the reduction of per-class
values to a site's class mean (classes in no label of the site left out) in
:mod:`medflare.metrics.site_mean`.
"""

from medflare.metrics.classification import accuracy, to_class_labels
from medflare.metrics.evaluate import (
    CLASSIFICATION_METRICS,
    COSTLY_METRICS,
    SEGMENTATION_METRICS,
    TASKS,
    evaluate,
    logits_to_label_map,
    metrics_for_round,
)
from medflare.metrics.instance import aggregated_jaccard_index, object_dice, to_instances
from medflare.metrics.segmentation import (
    check_label_maps,
    dice,
    hd95,
    mean_pixel_accuracy,
    nanmean_with_count,
    sensitivity,
    specificity,
    surface_dice,
    variation_of_information,
)
from medflare.metrics.site_mean import SiteMean, label_classes, site_mean, unseen_classes_warning
from medflare.metrics.visualize import PALETTE, image_grid, overlay_image

__all__ = [
    "CLASSIFICATION_METRICS",
    "COSTLY_METRICS",
    "PALETTE",
    "SEGMENTATION_METRICS",
    "SiteMean",
    "TASKS",
    "accuracy",
    "aggregated_jaccard_index",
    "check_label_maps",
    "dice",
    "evaluate",
    "hd95",
    "image_grid",
    "label_classes",
    "logits_to_label_map",
    "mean_pixel_accuracy",
    "metrics_for_round",
    "nanmean_with_count",
    "object_dice",
    "overlay_image",
    "sensitivity",
    "site_mean",
    "specificity",
    "surface_dice",
    "to_class_labels",
    "to_instances",
    "unseen_classes_warning",
    "variation_of_information",
]
