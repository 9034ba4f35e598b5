"""Exceptions raised by fp8track, the shared validators, and the one way state is checkpointed.

Every user-facing configuration error is a :class:`ConfigError` (a ``ValueError``), raised at
construction time and naming the bad value together with the valid ones.

Stateful parts (detectors, scalers) save their state as versioned plain data with
:func:`save_state` and restore it with :func:`restore_state`; both live here, at the bottom of the
package, so every layer can use them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A bad argument or configuration value, detected before any training step."""


class RankFailure(RuntimeError):
    """Another rank failed, died or stopped answering during one of fp8track's collectives.

    Raised after a bounded wait instead of hanging forever: the run cannot go on consistently
    (the training's own collectives would hang next), so it stops with this message.
    """


class TrainingHalted(RuntimeError):
    """fp8track stopped training: a non-finite loss, gradient or parameter (or, when asked, a
    divergence or a spike) was seen before a checkpoint of that step was written. The message says
    why and at which step; the run directory's ``halt`` event records it too."""


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


def check_float(
    name: str, value: object, low: float, *, strict: bool = False, allow_inf: bool = False
) -> None:
    """Raise :class:`ConfigError` unless ``value`` is a real number >= ``low`` (> with ``strict``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    if ok:
        ok = (value > low if strict else value >= low) and (allow_inf or math.isfinite(value))
    if not ok:
        rel = ">" if strict else ">="
        raise ConfigError(f"{name} must be a number {rel} {low}, got {value!r}")


def dataclass_from_dict(cls: type[T], data: Mapping[str, Any], strict: bool = True) -> T:
    """Build the dataclass ``cls`` from a mapping (YAML/CLI, or a stored record).

    With ``strict`` an unknown key is an error naming the valid ones; without it unknown keys are
    dropped (a record written by another version)."""
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - known)
    if unknown and strict:
        raise invalid_choice(f"{cls.__name__} key", unknown[0], sorted(known))
    return cls(**{k: v for k, v in data.items() if k in known})


class FromDict:
    """Mixin of the frozen config dataclasses read from YAML/CLI mappings:
    ``Config.from_dict(mapping)`` is :func:`dataclass_from_dict` (an unknown key is a
    :class:`ConfigError` naming the valid ones)."""

    @classmethod
    def from_dict(cls: type[T], data: Mapping[str, Any]) -> T:
        return dataclass_from_dict(cls, data)


def read_yaml_mapping(path: object, what: str) -> dict[str, Any]:
    """Safe-load the YAML mapping in the file ``path`` (UTF-8).

    Every way the file can be unusable is a :class:`ConfigError` naming ``what`` and the file: it
    does not exist or cannot be read, is not UTF-8 text, is not valid YAML, uses an unsafe or
    unknown tag (``!!python/...``: ``yaml.safe_load`` refuses it), or holds something other than a
    mapping. An empty file is an empty mapping.
    """
    import io
    import os

    import yaml

    name = os.fspath(path)  # type: ignore[arg-type]
    if not os.path.isfile(name):
        raise ConfigError(f"{what} {name!r} does not exist (or is not a file)")
    try:
        with open(name, "rb") as f:
            raw = f.read()
    except OSError as err:
        raise ConfigError(f"cannot read {what} {name!r}: {err}") from err
    try:
        stream = io.StringIO(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{what} {name!r} is not UTF-8 text (byte {err.start}: {err.reason}); save it as UTF-8 YAML"
        ) from err
    stream.name = name  # type: ignore[attr-defined]  # YAML's error marks name the file
    try:
        data = yaml.safe_load(stream)
    except yaml.constructor.ConstructorError as err:
        raise ConfigError(
            f"{what} {name!r} uses an unsafe or unknown YAML tag ({err.problem}); only plain YAML is accepted"
        ) from err
    except yaml.YAMLError as err:
        raise ConfigError(f"{what} {name!r} is not valid YAML: {' '.join(str(err).split())}") from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {name!r} must hold a mapping, got {type(data).__name__}")
    return data


def save_state(version: int = 1, **fields: Any) -> dict[str, Any]:
    """A checkpointable state: ``{"version": version, **fields}``; the fields must be plain data
    (numbers, strings, ``None``, lists and dicts of them) so the state survives JSON and pickling."""
    check_int("state version", version, 1)
    return {"version": version, **fields}


Setter = Callable[[Any], None] | tuple[str, Callable[[Any], Any]]


def restore_state(
    obj: object, state: Mapping[str, Any], fields: Mapping[str, Setter], version: int = 1
) -> int:
    """Restore :func:`save_state` output into ``obj``, field by field.

    Args:
        obj: the object restored (its class names it in errors).
        state: the saved state.
        fields: per field, a setter called with the stored value, or ``(attribute, convert)``:
            ``setattr(obj, attribute, convert(value))`` (``None`` stays ``None``).
        version: the newest version ``obj`` reads.

    Every field present is restored; a missing field keeps its current value and an unknown one is
    ignored, so a state of the same version from an older or newer release loads. A state without
    ``"version"`` is read as version 1.

    Returns:
        the state's version (for an owner whose layout changed between versions).

    Raises:
        ConfigError: ``state`` is not a mapping, or its version is not an integer in
            ``1..version`` (a state from a newer fp8track).
    """
    owner = type(obj).__name__
    if not isinstance(state, Mapping):
        raise ConfigError(f"{owner} state must be a mapping, got {type(state).__name__}")
    found = state.get("version", 1)
    if isinstance(found, bool) or not isinstance(found, int) or not 1 <= found <= version:
        raise ConfigError(
            f"{owner} state has version {found!r}; this fp8track reads versions 1..{version}. "
            "It was saved by a newer fp8track: upgrade fp8track, or resume without the fp8track state"
        )
    for key, setter in fields.items():
        if key not in state:
            continue
        value = state[key]
        if callable(setter):
            setter(value)
        else:
            attr, convert = setter
            setattr(obj, attr, None if value is None else convert(value))
    return found
