"""Reading the models a job saved, whatever algorithm wrote them, for ``medflare evaluate``.

FLARE's PT persistor writes ``{"model": state_dict, "train_conf": {..., "medflare": description}}``; the
description (see :func:`medflare.common.persistence.describe`) names the preset and network so the
checkpoint is self-contained. Plain state dicts load too when a preset is given.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from medflare import MedflareError
from medflare.common.payload import load_numpy_state
from medflare.nets import build_model
from medflare.presets import get_preset


_NUMPY_GLOBALS = [np._core.multiarray._reconstruct, np.ndarray, np.dtype] + [type(np.dtype(t)) for t in np.typecodes["All"]]


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint's dict, loaded with ``weights_only=True`` (no arbitrary code from a downloaded file)."""
    if not os.path.isfile(path):
        raise MedflareError(f"model file '{path}' does not exist")
    try:
        # numpy arrays are plain data too: FLARE's SCAFFOLD workflow stores its control variates as numpy
        # arrays in the checkpoint's meta_props.
        with torch.serialization.safe_globals(_NUMPY_GLOBALS):
            data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for corrupt/unsafe files
        raise MedflareError(f"model file '{path}' cannot be read as a torch checkpoint: {e}") from e
    if not isinstance(data, dict):
        raise MedflareError(f"model file '{path}' holds a {type(data).__name__}, expected a dict")
    return data


def describe_checkpoint(data: dict[str, Any], path: str, preset: str | None = None) -> dict[str, Any]:
    """The medflare description stored in a checkpoint, or one made from ``preset`` for plain state dicts."""
    desc = (data.get("train_conf") or {}).get("medflare")
    if desc is None:
        if preset is None:
            raise MedflareError(f"model file '{path}' does not say which network it holds; pass --preset")
        cfg = get_preset(preset)
        desc = {"kind": "model", "preset": preset, "overrides": {}, "model": cfg["model"], "data": cfg["data"]}
    return desc


def load_model(path: str | os.PathLike, preset: str | None = None) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Rebuild the single network saved at ``path``; returns (model in eval mode, its description)."""
    return model_from_checkpoint(read_checkpoint(path), path, preset)


def model_from_checkpoint(
    data: dict[str, Any], path: str | os.PathLike, preset: str | None = None
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """:func:`load_model` on a dict already read by :func:`read_checkpoint` (``path`` names it in errors)."""
    desc = describe_checkpoint(data, str(path), preset)
    if desc.get("kind", "model") != "model":
        raise MedflareError(f"model file '{path}' holds a '{desc['kind']}', not a single model")
    state = data.get("model", data)
    spec = desc["model"]
    model = build_model(spec["name"], **spec.get("args", {}))
    load_numpy_state(model, state, who=f"file '{path}'")
    return model.eval(), desc
