"""Checks of config values (model builders, presets, workflows, executors), so every bad value reads the same way.

Each names its owner (a model or component name) and the key, and refuses bools where an int is meant. The module
sits in the bottom layer beside the errors (it imports nothing else of medflare), so data, nets and presets use it.
"""

from __future__ import annotations

from medflare import ConfigError


def check_int(owner: str, key: str, value: object, low: int = 1) -> int:
    """``value`` as an int >= ``low``; ConfigError naming ``owner`` and ``key`` otherwise (bools refused)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        what = "a positive int" if low == 1 else f"an int >= {low}"
        raise ConfigError(f"{owner}: '{key}' must be {what}, got {value!r}")
    return value


def check_positive_number(owner: str, key: str, value: object) -> float:
    """``value`` as a finite float > 0 (a learning rate, a scale); ConfigError naming ``owner`` and ``key`` otherwise."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
        raise ConfigError(f"{owner}: '{key}' must be a positive number, got {value!r}")
    return float(value)


def check_fraction(owner: str, key: str, value: object) -> float:
    """``value`` as a float in (0, 1] (a share of something: ``train.max_batch_fraction``); ConfigError otherwise."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 1:
        raise ConfigError(f"{owner}: '{key}' must be a number in (0, 1], got {value!r}")
    return float(value)


def check_positive_int(owner: str, key: str, value: object) -> int:
    """``value`` as an int >= 1 (bools refused)."""
    return check_int(owner, key, value, 1)


def check_bool(owner: str, key: str, value: object) -> bool:
    """``value`` unless it is not True or False."""
    if not isinstance(value, bool):
        raise ConfigError(f"{owner}: '{key}' must be true or false, got {value!r}")
    return value


def check_dropout(owner: str, value: object) -> float:
    """``value`` unless it is not a probability in [0, 1)."""
    if not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ConfigError(f"{owner}: 'dropout' must be in [0, 1), got {value!r}")
    return float(value)
