"""Saved results that describe themselves, and the one registry that turns a file back into something to run.

Every file a medflare job saves is a ``torch.save`` of a plain dict (tensors, numbers, strings, lists) whose
``train_conf["medflare"]`` entry says what it is (FLARE's PT persistor already writes ``train_conf``, so
its ``FL_global_model.pt`` carries the entry as well)::

    {"kind": "model", "version": 1, "preset": "seg_synthetic", "overrides": {...},
     "model": {"name", "args"}, "data": {...}, ...kind-specific keys}

A *kind* maps that entry to a loader and to what the ``medflare`` command can do with the result:
predict a batch (``evaluate``, ``predict``), ``sample`` (generators), list its ``parts``. The generic
single-network kind ``model`` lives here; each algorithm defines its own kinds in its sub-package's
``results`` module (``medflare/<algo>/results.py``) and registers each as a ``medflare.result_kinds`` entry point in
pyproject.toml (the ecosystem's plug-in convention; an installed plug-in package can add kinds the same way).
:func:`kind` imports a kind's module only when a file of that kind is read, so neither this module nor the CLI
imports or names an algorithm.

Files load with ``torch.load(weights_only=True)``: no code from a downloaded file runs. The numpy types a
checkpoint may hold (FLARE's SCAFFOLD keeps its controls as numpy arrays) are allowed by name after
:func:`torch.serialization.get_unsafe_globals_in_checkpoint` lists them, nothing else.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np
import torch

from medflare import ConfigError, MedflareError, ResultFileError
from medflare.common.options import Option
from medflare.presets import get_preset

#: where a file's description lives (FLARE's PT persistor writes ``train_conf``)
CONF_KEY = "train_conf"
DESC_KEY = "medflare"


def describe(preset: str, overrides: Mapping[str, Any] | None = None, kind: str = "model", version: int = 1, **extra: Any) -> dict[str, Any]:
    """What a saved file says about itself: kind, version, preset, overrides, the model spec and data settings."""
    cfg = get_preset(preset, overrides)
    return {"kind": kind, "version": int(version), "preset": preset, "overrides": dict(overrides or {}),
            "model": cfg["model"], "data": cfg["data"], **extra}


# ---- reading files safely --------------------------------------------------------------------
def _numpy_global(name: str):
    """The numpy object a checkpoint names (``module.attr``), if it is plain data: arrays, dtypes, scalars."""
    module, _, attr = name.rpartition(".")
    if module.split(".")[0] != "numpy":
        return None
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None
    plain = obj in (np.ndarray, np.dtype) or (isinstance(obj, type) and issubclass(obj, np.dtype))
    # array and scalar reconstructors of numpy's pickle protocol
    return obj if plain or attr in ("_reconstruct", "scalar") else None


def _unpickling_reason(error: BaseException) -> str:
    """What torch's multi-line weights-only refusal refused (``unsupported GLOBAL posix.system``), without its advice."""
    found = re.search(r"GLOBAL ([\w.]+)", str(error))
    if found:
        return f"unsupported GLOBAL {found.group(1)}"
    named = [line.strip() for line in str(error).splitlines() if "unsupported" in line.lower()]  # "Unsupported operand 149"
    return named[0].rstrip(".") if named else "not a weights-only torch file"


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The dict saved at ``path``, loaded with ``weights_only=True``; ResultFileError (one line) names the file."""
    path = Path(path)
    if not path.is_file():
        raise ResultFileError(f"result file '{path}' does not exist")
    with open(path, "rb") as f:
        head = f.read(4)
    if not (head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"):  # torch's zip format, or a legacy pickle
        raise ResultFileError(f"'{path}' is not a medflare result file: not a torch checkpoint (it starts with {head!r}); "
                              "give a file a job saved, e.g. <workspace>/server/simulate_job/app_server/FL_global_model.pt")
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception:  # noqa: BLE001 - not a zip checkpoint: torch.load below says why
        names = []
    allowed = [obj for obj in map(_numpy_global, names) if obj is not None]
    if allowed:  # a pickled dtype is rebuilt through its concrete class (Float32DType, ...), which the scan does not list
        allowed += [type(np.dtype(code)) for code in np.typecodes["All"]]
    refused = [n for n in names if _numpy_global(n) is None]
    if refused:
        raise ResultFileError(f"result file '{path}' holds code or objects that are not plain data ({', '.join(refused[:3])}); refusing to load it")
    try:
        with torch.serialization.safe_globals(allowed):
            data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # the weights-only unpickler met something that is not plain data
        raise ResultFileError(f"result file '{path}' is refused: it holds pickled code or objects, not only weights "
                              f"({_unpickling_reason(e)}); medflare loads checkpoints weights-only") from e
    except Exception as e:  # noqa: BLE001 - torch raises many types for corrupt/unsafe files
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ResultFileError(f"result file '{path}' cannot be read as a torch checkpoint: {first}") from e
    if not isinstance(data, dict):
        raise ResultFileError(f"result file '{path}' holds a {type(data).__name__}, expected a dict")
    return data


def save_checkpoint(data: Mapping[str, Any], path: str | os.PathLike) -> None:
    """``torch.save`` of a dict, atomically (written beside ``path``, then renamed: a reader never sees half a file);
    the folder is created when missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(dict(data), tmp)
    os.replace(tmp, path)


def description_of(data: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``train_conf["medflare"]`` entry of a checkpoint dict, or None."""
    conf = data.get(CONF_KEY)
    return conf.get(DESC_KEY) if isinstance(conf, Mapping) and isinstance(conf.get(DESC_KEY), Mapping) else None


# ---- what a loaded result offers -------------------------------------------------------------
class Predictor(Protocol):
    """``images (B, C, *spatial) -> logits (B, num_classes[, *spatial])`` or a (B, 1, *spatial) label map.

    Optional: ``reset()`` before a data set and ``report() -> {name: float}`` after it (e.g. how often a
    FedSM super model routed to each of its models).
    """

    def __call__(self, images: torch.Tensor) -> torch.Tensor: ...


class Result:
    """A loaded result file: its networks on a device and what the CLI can do with them.

    Subclasses set ``networks`` (name -> module) and override :meth:`predictors` (and :meth:`sample` if
    they generate images). ``description`` is the file's ``train_conf["medflare"]`` entry.
    """

    def __init__(self, path: Path, description: Mapping[str, Any], networks: Mapping[str, torch.nn.Module], info: Mapping[str, Any] | None = None):
        self.path = Path(path)
        self.description = dict(description)
        self.kind = self.description["kind"]
        self.networks = dict(networks)
        self.info = dict(info or {})
        for net in self.networks.values():
            net.eval()

    @property
    def preset(self) -> dict[str, Any]:
        """The preset the result was trained with (overrides applied)."""
        return get_preset(self.description["preset"], self.description.get("overrides") or {})

    def to(self, device: torch.device | str) -> "Result":
        for net in self.networks.values():
            net.to(device)
        return self

    def parts(self) -> dict[str, str]:
        """One line per network (name -> architecture and size) plus the kind's own entries in ``info``."""
        from medflare.nets import count_parameters

        return {name: f"{type(net).__name__}, {count_parameters(net):,} parameters" for name, net in self.networks.items()}

    def predictors(self, options: Mapping[str, Any]) -> list[tuple[str, Predictor]]:
        """``[(label, predictor)]``: one per value of a swept option, else one."""
        raise MedflareError(f"result kind '{self.kind}' ({self.path}) has nothing that predicts")

    def compared_with(self) -> list[tuple[str, Predictor]]:
        """``[(label, predictor)]`` that ``medflare evaluate`` scores beside :meth:`predictors` in one table (e.g. a super
        model's own global model); ``predict`` never uses them. Default none."""
        return []

    def sample(self, label_maps: Sequence[torch.Tensor], options: Mapping[str, Any]) -> list[torch.Tensor]:
        """Images generated from (1, *spatial) label maps (or unconditioned when empty); generators override."""
        raise MedflareError(f"result kind '{self.kind}' ({self.path}) cannot sample images; it holds {sorted(self.networks)}")


@dataclass(frozen=True)
class ResultKind:
    """A registered kind: its name, the newest file version it reads, a one-line summary, its loader and CLI options."""

    name: str
    version: int
    summary: str
    load: Callable[[Mapping[str, Any], Path], Result]
    options: tuple[Option, ...] = field(default=())


#: the entry-point group every result kind is registered in: pyproject.toml's
#: ``[project.entry-points."medflare.result_kinds"]``, ``<kind name> = "<module>:<ResultKind object>"``; a kind's module
#: is imported only when that kind is needed
ENTRY_POINTS = "medflare.result_kinds"
_LOADED: dict[str, ResultKind] = {}


def _entry_points() -> dict[str, Any]:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINTS)}


def kind_names() -> list[str]:
    """The names of every registered kind, read from the installed package's entry points (nothing is imported)."""
    return sorted(_entry_points())


def kind(name: str) -> ResultKind:
    """The registered kind ``name``, its module imported on first use; ResultFileError names the known kinds."""
    if name not in _LOADED:
        points = _entry_points()
        if name not in points:
            raise ResultFileError(f"unknown result kind '{name}' (known: {sorted(points)}; kinds are the "
                                  f"'{ENTRY_POINTS}' entry points of the installed medflare)")
        found = points[name].load()
        if not isinstance(found, ResultKind) or found.name != name:
            raise ConfigError(f"entry point '{name}' of '{ENTRY_POINTS}' ({points[name].value}) is not the ResultKind '{name}'")
        _LOADED[name] = found
    return _LOADED[name]


def kinds() -> dict[str, ResultKind]:
    """Every registered kind (imports each kind's module: the CLI's per-kind options and ``medflare show`` need them)."""
    return {name: kind(name) for name in kind_names()}


def load_result(path: str | os.PathLike, preset: str | None = None) -> Result:
    """Rebuild whatever ``path`` holds; a plain state dict needs ``preset``. ResultFileError names the file and known kinds."""
    path = Path(path)
    data = read_checkpoint(path)
    desc = description_of(data)
    if desc is not None and preset is not None and preset != desc.get("preset"):
        raise ResultFileError(f"--preset '{preset}' is for a plain state dict; result file '{path}' says it was trained "
                              f"with preset '{desc.get('preset')}' and is read with that one (leave --preset out)")
    if desc is None:
        if preset is None:
            raise ResultFileError(f"result file '{path}' does not say what it holds; pass --preset for a plain state dict")
        desc = describe(preset)
    name, version = desc.get("kind"), int(desc.get("version", 1))
    if name not in kind_names():
        raise ResultFileError(f"result file '{path}' holds kind '{name}', which this medflare does not know (known: {kind_names()})")
    found = kind(name)
    if version > found.version:
        raise ResultFileError(
            f"result file '{path}' is kind '{name}' version {version}, newer than this medflare reads ({found.version}); upgrade medflare"
        )
    data = {**data, CONF_KEY: {**(data.get(CONF_KEY) or {}), DESC_KEY: desc}}
    return found.load(data, path)


# ---- the generic kind: one network --------------------------------------------------------------
def network_from(spec: Mapping[str, Any], state: Mapping[str, Any], what: str, build: Callable[[Mapping[str, Any]], torch.nn.Module] | None = None) -> torch.nn.Module:
    """Build ``spec`` (``{"name", "args"}``) and load ``state`` into it; ResultFileError names ``what`` when they disagree.

    Nothing is allocated before the file is known to be usable: NaN/Inf weights are refused (they evaluated to
    Dice 0.00 with no warning), and ``spec`` is first built on torch's meta device (shapes only, no memory) and
    matched against the stored weights, so stored settings that ask for a network the file does not hold
    (``channels [65536]x3`` asked for 154 GB) are refused instead of allocated. A file's weights are as large
    as the file itself, which bounds what a matching spec can allocate.
    """
    from medflare.common.payload import load_numpy_state, nonfinite_paths, state_mismatch
    from medflare.nets import build_from_spec

    build = build or build_from_spec
    bad = nonfinite_paths(dict(state))
    if bad:
        raise ResultFileError(f"{what}: {len(bad)} weight tensor(s) hold NaN or Inf values ({', '.join(bad[:3])}"
                              f"{' ...' if len(bad) > 3 else ''}); refusing to use them")
    with torch.device("meta"):
        detail = state_mismatch(build(spec), state)
    if detail:
        raise ResultFileError(f"{what}: its stored model settings {_brief(spec)} do not describe its stored weights ({detail}); "
                              "nothing was built")
    net = build(spec)
    load_numpy_state(net, state, who=what)
    return net.eval()


def _brief(spec: Mapping[str, Any]) -> str:
    """A model spec as one short line for an error message (a hostile file's settings may be long)."""
    text = json.dumps(spec, default=str, separators=(",", ":"))
    return text if len(text) <= 160 else text[:157] + "..."


class ModelResult(Result):
    """One network (FLARE's ``FL_global_model.pt``, a local or centralised baseline model)."""

    @property
    def model(self) -> torch.nn.Module:
        return self.networks["model"]

    def predictors(self, options: Mapping[str, Any]) -> list[tuple[str, Predictor]]:
        return [("model", self.model)]


def _load_model(data: Mapping[str, Any], path: Path) -> ModelResult:
    desc = description_of(data)
    state = data["model"] if "model" in data else {k: v for k, v in data.items() if k != CONF_KEY}
    if not isinstance(state, Mapping):
        raise ResultFileError(f"result file '{path}': its 'model' entry is a {type(state).__name__}, expected a state dict")
    return ModelResult(path, desc, {"model": network_from(desc["model"], state, f"file '{path}'")})


MODEL = ResultKind("model", 1, "one network (a global, local or centralised model)", _load_model)
