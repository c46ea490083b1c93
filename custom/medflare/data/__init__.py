"""Data layer: site-data resolution, datalist/NIfTI/PNG and MedMNIST-npz loaders, synthetic sites.

Every dataset item is a plain-tensor dict a default DataLoader batches:
``{"image": float32 (C, H, W) in [0, 1], "label": int64 (1, H, W) or int64 scalar, "name": str}``.
Hospital data and the embedded synthetic default travel through the same loaders.
"""

from medflare.data.loaders import load_npz_split, load_seg_split
from medflare.data.partition import dirichlet_label_skew
from medflare.data.site import SiteData, load_site, resolve_site_source
from medflare.data.synthetic_cls import make_cls_sites
from medflare.data.synthetic_seg import STYLE_TABLE, make_seg_site, segmentation_style

__all__ = [
    "STYLE_TABLE",
    "SiteData",
    "dirichlet_label_skew",
    "load_npz_split",
    "load_seg_split",
    "load_site",
    "make_cls_sites",
    "make_seg_site",
    "resolve_site_source",
    "segmentation_style",
]
