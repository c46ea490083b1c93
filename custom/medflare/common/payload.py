"""Model weights on the wire: torch state dicts <-> flat dicts of numpy arrays, diffs and checks.

FLARE's privacy filters (PercentilePrivacy, SVTPrivacy, ExcludeVars) operate on flat dicts of numpy
arrays inside WEIGHTS / WEIGHT_DIFF DXOs, so everything that leaves a site goes through here. Jobs with
several models flatten them with a prefix per model (``global.``, ``person.``, ``select.``) so one
WEIGHT_DIFF DXO carries all of them and the stock filters still apply.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.shareable import Shareable

from medflare import PayloadError
from medflare.common.update_guard import nonfinite_paths


def state_to_numpy(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """Every entry of ``model.state_dict()`` (parameters and buffers) as a CPU float/int numpy array."""
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def load_numpy_state(model: torch.nn.Module, params: Mapping[str, np.ndarray], who: str = "server") -> None:
    """Load a flat dict of arrays into ``model``, raising MedflareError that names missing, extra or mis-shaped keys.

    ``who`` names the sender in the message (the usual cause is a server and client configured with
    different presets or model arguments).
    """
    own = model.state_dict()
    detail = state_mismatch(model, params)
    if detail:
        raise PayloadError(
            f"the model received from {who} does not match the local model ({detail}); "
            "the server's persistor and the clients' executor must use the same preset and model args"
        )
    model.load_state_dict(
        {k: torch.as_tensor(np.asarray(params[k])).to(own[k].dtype) for k in own}, strict=True
    )


def state_mismatch(model: torch.nn.Module, params: Mapping[str, Any]) -> str:
    """What differs between ``model``'s state dict and ``params`` (missing, unexpected, mis-shaped keys); "" if nothing.

    Reads shapes only, so it also checks a model built on the meta device before any weight is allocated.
    """
    own = model.state_dict()
    missing = sorted(set(own) - set(params))
    extra = sorted(set(params) - set(own))
    wrong = sorted(k for k in set(own) & set(params) if tuple(np.shape(params[k])) != tuple(own[k].shape))
    return "; ".join(f"{name}: {keys[:5]}{' ...' if len(keys) > 5 else ''}"
                     for name, keys in (("missing keys", missing), ("unexpected keys", extra), ("shape mismatch", wrong)) if keys)


def weight_diff(after: Mapping[str, np.ndarray], before: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``after - before`` key by key (integer buffers such as BatchNorm's num_batches_tracked included)."""
    return {k: np.asarray(after[k]) - np.asarray(before[k]) for k in after}


def check_finite(params: Mapping[str, np.ndarray], site: str) -> None:
    """Refuse to send a NaN/Inf update: it would poison the global model at every site (the site's side of what
    the server's update guard checks again on arrival, with the same :func:`nonfinite_paths`)."""
    bad = nonfinite_paths(params)
    if bad:
        raise PayloadError(f"site '{site}': the local update has NaN/Inf values in {bad[:5]}; lower the learning rate")


def flatten(models: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """``{"global": {...}, "select": {...}}`` -> ``{"global.w": ..., "select.w": ...}`` for one DXO."""
    for prefix in models:
        if "." in prefix:
            raise PayloadError(f"model prefix '{prefix}' must not contain '.'")
    return {f"{prefix}.{k}": v for prefix, params in models.items() for k, v in params.items()}


def unflatten(params: Mapping[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """Inverse of :func:`flatten`."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for key, value in params.items():
        prefix, sep, rest = key.partition(".")
        if not sep:
            raise PayloadError(f"payload key '{key}' has no model prefix (expected '<model>.<param>')")
        out.setdefault(prefix, {})[rest] = value
    return out


def nbytes(params: Mapping[str, np.ndarray]) -> int:
    """Bytes of the arrays in a payload (what a round costs on the wire, before serialisation overhead)."""
    return int(sum(np.asarray(v).nbytes for v in params.values()))


def payload_bytes(params: Any) -> int:
    """Bytes of the arrays in a payload: a flat dict of arrays, or a COLLECTION's named DXOs (recursively)."""
    if isinstance(params, DXO):
        return payload_bytes(params.data)
    if isinstance(params, Mapping):
        return sum(payload_bytes(v) for v in params.values())
    if isinstance(params, torch.Tensor):
        return params.numel() * params.element_size()
    return int(params.nbytes) if isinstance(params, np.ndarray) else 0


def ok_dxo(shareable: Shareable) -> DXO | None:
    """The DXO of a successful reply, None for an error reply or one that holds no DXO (what a result filter acts on)."""
    if shareable.get_return_code(ReturnCode.OK) != ReturnCode.OK:
        return None
    try:
        return from_shareable(shareable)
    except ValueError:
        return None


def collection(parts: Mapping[str, DXO], meta: Mapping[str, Any] | None = None) -> DXO:
    """A COLLECTION DXO of named DXOs, each with its own data kind, so each site filter sees each part."""
    return DXO(data_kind=DataKind.COLLECTION, data=dict(parts), meta=dict(meta or {}))
