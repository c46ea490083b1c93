"""Data layer: site-data resolution, datalist/NIfTI/PNG and MedMNIST-npz loaders, synthetic sites.

Every dataset item is a plain-tensor dict a default DataLoader batches:
``{"image": float32 (C, H, W) in [0, 1], "label": int64 (1, H, W) or int64 scalar, "name": str}``.
Hospital data and the embedded synthetic default travel through the same loaders.

The names below are imported on first use (PEP 562), so that a torch-free submodule (``medflare.data.limits``,
read by the presets) does not import torch and MONAI: ``medflare --help`` and ``medflare presets`` stay fast.
"""

from importlib import import_module

_WHERE = {
    "load_npz_split": "loaders",
    "load_seg_split": "loaders",
    "dirichlet_label_skew": "partition",
    "SiteData": "site",
    "load_site": "site",
    "resolve_site_source": "site",
    "make_cls_sites": "synthetic_cls",
    "STYLE_TABLE": "synthetic_seg",
    "make_seg_site": "synthetic_seg",
    "segmentation_style": "synthetic_seg",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'medflare.data' has no attribute '{name}'")
    value = getattr(import_module(f"medflare.data.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
