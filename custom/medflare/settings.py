"""Typed settings sections: the one way a preset's sections (``train``, ``fediod``, ``diffusion``, ...) are declared,
defaulted, validated and read.

A section is a frozen dataclass whose fields declare their default and their rule once::

    @section("fediod")
    class FedIODConfig(Section):
        batch_size: int = setting(64, Int(1))
        ensemble: str = setting("eq8", OneOf(("eq8", "labels", "mean")))

``FedIODConfig.from_dict(d)`` fills missing keys with the defaults, refuses an unknown key with a ConfigError naming the
section and listing its valid keys, and checks every value by its rule (the error names ``<section>.<key>``);
``as_dict()`` gives the plain dict back (what a saved result records). Why dataclasses: no new dependency, frozen
objects a component builds once and passes down, and the field list is the documentation's key list.

Sections are registered by plain data (:data:`SECTIONS`, ``"name": "module:Class"``), imported only when a preset
that holds the section is read: :func:`medflare.presets.get_preset` validates every registered section a preset holds
and lets overrides set any key of it, without importing an algorithm at import time (DESIGN.md "Layers").
This module sits in the bottom layer with the errors and :mod:`medflare.checks`.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import math
from typing import Any, Callable, ClassVar, Mapping, Sequence, TypeVar

from medflare import ConfigError
from medflare.checks import check_bool, check_int, check_number

#: every typed section a preset may hold: ``name -> "module:Class"`` (imported lazily by :func:`section_class`)
SECTIONS: dict[str, str] = {
    "train": "medflare.presets:TrainSettings",
    "eval": "medflare.presets:EvalSettings",
    "fedprox": "medflare.baselines.config:FedProxConfig",
    "fedsm": "medflare.fedsm.config:FedSMConfig",
    "fedvck": "medflare.fedvck.config:FedVCKConfig",
    "fediod": "medflare.fediod.config:FedIODConfig",
    "fedst": "medflare.fedst.config:FedSTConfig",
    "diffusion": "medflare.fedst.config:DiffusionConfig",
}


# ---- rules: how one value is checked ---------------------------------------------------------------------------
class Rule:
    """How one setting is checked: ``rule(key, value)`` returns the value to keep or raises ConfigError naming ``key``."""

    def __call__(self, key: str, value: Any) -> Any:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Int(Rule):
    """An int >= ``low`` (bools refused)."""

    low: int = 1

    def __call__(self, key: str, value: Any) -> int:
        return check_int("", key, value, self.low)


@dataclasses.dataclass(frozen=True)
class Number(Rule):
    """A finite number in the interval from ``low`` to ``high`` (each end open or closed), kept as a float."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def __call__(self, key: str, value: Any) -> float:
        return check_number("", key, value, self.low, self.high, self.low_open, self.high_open)


#: a number > 0 (a learning rate, a temperature)
POSITIVE = Number(0.0, low_open=True)
#: a number >= 0 (a loss weight)
NON_NEGATIVE = Number(0.0)


@dataclasses.dataclass(frozen=True)
class OneOf(Rule):
    """One of ``choices``."""

    choices: tuple

    def __call__(self, key: str, value: Any) -> Any:
        if isinstance(value, bool) or value not in self.choices:
            raise ConfigError(f"'{key}' must be one of {list(self.choices)}, got {value!r}")
        return value


@dataclasses.dataclass(frozen=True)
class Bool(Rule):
    """true or false."""

    def __call__(self, key: str, value: Any) -> bool:
        return check_bool("", key, value)


@dataclasses.dataclass(frozen=True)
class Text(Rule):
    """A string (``empty`` False: a non-empty one)."""

    empty: bool = True

    def __call__(self, key: str, value: Any) -> str:
        if not isinstance(value, str) or (not self.empty and not value):
            raise ConfigError(f"'{key}' must be a {'' if self.empty else 'non-empty '}string, got {value!r}")
        return value


@dataclasses.dataclass(frozen=True)
class OrNone(Rule):
    """null, or a value that passes ``rule``."""

    rule: Rule

    def __call__(self, key: str, value: Any) -> Any:
        return None if value is None else self.rule(key, value)


@dataclasses.dataclass(frozen=True)
class Items(Rule):
    """A list whose every item passes ``rule`` (kept as a list)."""

    rule: Rule
    min_items: int = 0

    def __call__(self, key: str, value: Any) -> list:
        if not isinstance(value, (list, tuple)) or len(value) < self.min_items:
            raise ConfigError(f"'{key}' must be a list of at least {self.min_items} item(s), got {value!r}")
        return [self.rule(f"{key}[{i}]", v) for i, v in enumerate(value)]


@dataclasses.dataclass(frozen=True)
class AnyDict(Rule):
    """A dict of free keys (e.g. a network's constructor arguments, checked where the network is built)."""

    def __call__(self, key: str, value: Any) -> dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"'{key}' must be a dict, got {value!r}")
        return copy.deepcopy(dict(value))


ANY_DICT = AnyDict()


@dataclasses.dataclass(frozen=True)
class NetSpec(Rule):
    """A network spec ``{"name": ..., "args": {...}}`` (``args`` optional, checked where the network is built); ``names``:
    the names allowed (empty: any)."""

    names: tuple = ()

    def __call__(self, key: str, value: Any) -> dict:
        if not isinstance(value, Mapping) or not isinstance(value.get("name"), str) or set(value) - {"name", "args"}:
            raise ConfigError(f"'{key}' must be a dict {{'name': ..., 'args': {{...}}}}, got {value!r}")
        if self.names and value["name"] not in self.names:
            raise ConfigError(f"'{key}.name' must be one of {list(self.names)}, got {value['name']!r}")
        return {"name": value["name"], "args": ANY_DICT(f"{key}.args", value.get("args", {}))}


@dataclasses.dataclass(frozen=True)
class Nested(Rule):
    """A dict with the keys of section class ``of`` (its defaults filled, its rules applied), kept as a plain dict."""

    of: type

    def __call__(self, key: str, value: Any) -> dict:
        return self.of.from_dict(value).as_dict()


@dataclasses.dataclass(frozen=True)
class Check(Rule):
    """A rule written as a function ``check(key, value) -> value`` (raising ConfigError naming ``key``)."""

    check: Callable[[str, Any], Any]

    def __call__(self, key: str, value: Any) -> Any:
        return self.check(key, value)


# ---- sections --------------------------------------------------------------------------------------------------
def setting(default: Any = dataclasses.MISSING, rule: Rule | None = None) -> Any:
    """A section field: its ``default`` (deep-copied for dicts and lists; none = the key is required) and ``rule``."""
    meta = {"rule": rule}
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata=meta)
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


S = TypeVar("S", bound="Section")


class Section:
    """Base of every settings section (declare one with :func:`section`): validation, ``from_dict`` and ``as_dict``."""

    SECTION: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            rule = f.metadata.get("rule")
            if rule is not None:
                object.__setattr__(self, f.name, rule(f"{self.SECTION}.{f.name}", getattr(self, f.name)))
        self.check()

    def check(self) -> None:
        """Checks across keys (a subclass's; each field's own rule has run). Raise ConfigError naming the keys."""

    @classmethod
    def keys(cls) -> list[str]:
        """The section's keys, in declaration order."""
        return [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls: type[S], values: Mapping[str, Any] | None) -> S:
        """The section from a preset's dict: defaults for missing keys; ConfigError for an unknown key (naming the
        section and listing the valid keys), a missing required one, or a bad value (naming ``<section>.<key>``)."""
        if values is None:
            values = {}
        if not isinstance(values, Mapping):
            raise ConfigError(f"section '{cls.SECTION}' must be a dict of settings, got {values!r}")
        known = cls.keys()
        unknown = [k for k in values if k not in known]
        if unknown:
            raise ConfigError(f"unknown key(s) {[f'{cls.SECTION}.{k}' for k in unknown]} in section '{cls.SECTION}' "
                              f"(valid keys: {', '.join(known)})")
        required = [f.name for f in dataclasses.fields(cls)  # type: ignore[arg-type]
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [k for k in required if k not in values]
        if missing:
            raise ConfigError(f"section '{cls.SECTION}' lacks required key(s) {[f'{cls.SECTION}.{k}' for k in missing]}")
        return cls(**copy.deepcopy(dict(values)))

    @classmethod
    def from_preset(cls: type[S], cfg: Mapping[str, Any]) -> S:
        """The section of a resolved preset (:func:`medflare.presets.get_preset`); the defaults when it has none.

        A component calls this once (at construction or START_RUN) and passes the object down, so the section is
        checked once per component rather than rebuilt from the raw dict at every use."""
        return cls.from_dict(cfg.get(cls.SECTION))

    def as_dict(self) -> dict[str, Any]:
        """Every key with its value, as plain JSON-like data (what a saved result and a log record)."""
        return {name: copy.deepcopy(getattr(self, name)) for name in self.keys()}

    def replace(self: S, **changes: Any) -> S:
        """A copy with ``changes`` (checked like the original)."""
        return type(self).from_dict({**self.as_dict(), **changes})


def section(name: str) -> Callable[[type[S]], type[S]]:
    """Class decorator: a :class:`Section` subclass as the frozen, keyword-only dataclass of section ``name``."""

    def wrap(cls: type[S]) -> type[S]:
        cls.SECTION = name
        return dataclasses.dataclass(frozen=True, kw_only=True)(cls)

    return wrap


# ---- the registry ----------------------------------------------------------------------------------------------
def section_class(name: str) -> type[Section]:
    """The class of registered section ``name`` (its module imported now); ConfigError for an unknown name."""
    if name not in SECTIONS:
        raise ConfigError(f"unknown settings section '{name}' (known: {sorted(SECTIONS)})")
    module, _, attr = SECTIONS[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def validate(cfg: Mapping[str, Any], names: Sequence[str] | None = None) -> None:
    """Check every registered section ``cfg`` holds (or those of ``names``); ConfigError names the key at fault."""
    for name in names if names is not None else [n for n in SECTIONS if n in cfg]:
        section_class(name).from_dict(cfg.get(name))
