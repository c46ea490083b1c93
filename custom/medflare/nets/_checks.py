"""Argument checks shared by the model builders, so every bad config value reads the same way."""

from __future__ import annotations

from medflare import ConfigError, MedflareError


def check_positive_int(model: str, key: str, value: object) -> None:
    """Raise MedflareError unless ``value`` is an int >= 1 (bools are refused)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{model}: '{key}' must be a positive int, got {value!r}")


def check_bool(model: str, key: str, value: object) -> None:
    """Raise MedflareError unless ``value`` is True or False."""
    if not isinstance(value, bool):
        raise ConfigError(f"{model}: '{key}' must be true or false, got {value!r}")


def check_dropout(model: str, value: object) -> None:
    """Raise MedflareError unless ``value`` is a probability in [0, 1)."""
    if not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ConfigError(f"{model}: 'dropout' must be in [0, 1), got {value!r}")
