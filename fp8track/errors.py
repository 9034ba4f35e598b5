"""Exceptions raised by fp8track.

Every user-facing configuration error is a :class:`ConfigError` (a ``ValueError``), raised at
construction time and naming the bad value together with the valid ones.
"""

from __future__ import annotations

from collections.abc import Iterable


class ConfigError(ValueError):
    """A bad argument or configuration value, detected before any training step."""


def invalid_choice(what: str, value: object, valid: Iterable[object], hint: str = "") -> ConfigError:
    """Build the standard "unknown X" error: names the value received and the valid ones."""
    choices = ", ".join(repr(v) for v in valid)
    message = f"unknown {what} {value!r}; valid values are: {choices}"
    if hint:
        message += f". {hint}"
    return ConfigError(message)
