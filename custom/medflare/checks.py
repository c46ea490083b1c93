"""Checks of config values (model builders, presets, workflows, executors), so every bad value reads the same way.

Each names its owner (a model or component name) and the key, and refuses bools where an int is meant. The module
sits in the bottom layer beside the errors (it imports nothing else of medflare), so data, nets and presets use it.
"""

from __future__ import annotations

import math

from medflare import ConfigError


def _named(owner: str, key: str) -> str:
    """``owner: 'key'`` (or ``'key'`` alone when ``owner`` is "", e.g. a settings section, whose key names it)."""
    return f"{owner}: '{key}'" if owner else f"'{key}'"


def check_int(owner: str, key: str, value: object, low: int = 1) -> int:
    """``value`` as an int >= ``low``; ConfigError naming ``owner`` and ``key`` otherwise (bools refused)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        what = "a positive int" if low == 1 else f"an int >= {low}"
        raise ConfigError(f"{_named(owner, key)} must be {what}, got {value!r}")
    return value


def check_number(owner: str, key: str, value: object, low: float = -math.inf, high: float = math.inf,
                 low_open: bool = False, high_open: bool = False) -> float:
    """``value`` as a finite float between ``low`` and ``high`` (each end open or closed; bools refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{_named(owner, key)} must be a finite number, got {value!r}")
    if value < low or value > high or (low_open and value == low) or (high_open and value == high):
        if (low, high, low_open) == (0.0, math.inf, True):
            what = "a positive number"
        elif high == math.inf:
            what = f"a number {'>' if low_open else '>='} {low:g}"
        elif low == -math.inf:
            what = f"a number {'<' if high_open else '<='} {high:g}"
        else:
            what = f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ConfigError(f"{_named(owner, key)} must be {what}, got {value!r}")
    return float(value)


def check_positive_number(owner: str, key: str, value: object) -> float:
    """``value`` as a finite float > 0 (a learning rate, a scale); ConfigError naming ``owner`` and ``key`` otherwise."""
    return check_number(owner, key, value, 0.0, low_open=True)


def check_fraction(owner: str, key: str, value: object) -> float:
    """``value`` as a float in (0, 1] (a share of something: ``train.max_batch_fraction``); ConfigError otherwise."""
    return check_number(owner, key, value, 0.0, 1.0, low_open=True)


def check_positive_int(owner: str, key: str, value: object) -> int:
    """``value`` as an int >= 1 (bools refused)."""
    return check_int(owner, key, value, 1)


def check_bool(owner: str, key: str, value: object) -> bool:
    """``value`` unless it is not True or False."""
    if not isinstance(value, bool):
        raise ConfigError(f"{_named(owner, key)} must be true or false, got {value!r}")
    return value


def check_dropout(owner: str, value: object) -> float:
    """``value`` unless it is not a probability in [0, 1)."""
    if not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ConfigError(f"{owner}: 'dropout' must be in [0, 1), got {value!r}")
    return float(value)
