"""Exceptions raised by fp8track.

Every user-facing configuration error is a :class:`ConfigError` (a ``ValueError``), raised at
construction time and naming the bad value together with the valid ones.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A bad argument or configuration value, detected before any training step."""


class RankFailure(RuntimeError):
    """Another rank failed, died or stopped answering during one of fp8track's collectives.

    Raised after a bounded wait instead of hanging forever: the run cannot go on consistently
    (the training's own collectives would hang next), so it stops with this message.
    """


def invalid_choice(what: str, value: object, valid: Iterable[object], hint: str = "") -> ConfigError:
    """Build the standard "unknown X" error: names the value received and the valid ones."""
    choices = ", ".join(repr(v) for v in valid)
    message = f"unknown {what} {value!r}; valid values are: {choices}"
    if hint:
        message += f". {hint}"
    return ConfigError(message)


def check_int(name: str, value: object, minimum: int) -> None:
    """Raise :class:`ConfigError` unless ``value`` is an int (not a bool) >= ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_float(name: str, value: object, low: float, *, strict: bool = False, allow_inf: bool = False) -> None:
    """Raise :class:`ConfigError` unless ``value`` is a real number >= ``low`` (> with ``strict``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    if ok:
        ok = (value > low if strict else value >= low) and (allow_inf or math.isfinite(value))
    if not ok:
        rel = ">" if strict else ">="
        raise ConfigError(f"{name} must be a number {rel} {low}, got {value!r}")


def dataclass_from_dict(cls: type[T], data: Mapping[str, Any]) -> T:
    """Build the dataclass ``cls`` from a mapping (YAML/CLI); an unknown key is an error naming the valid ones."""
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - known)
    if unknown:
        raise invalid_choice(f"{cls.__name__} key", unknown[0], sorted(known))
    return cls(**dict(data))
