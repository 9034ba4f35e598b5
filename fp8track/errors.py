"""Exceptions raised by fp8track, the shared validators, and the one way state is checkpointed.

Every user-facing configuration error is a :class:`ConfigError` (a ``ValueError``), raised at
construction time and naming the bad value together with the valid ones.

Stateful parts (detectors, scalers) save their state as versioned plain data with
:func:`save_state` and restore it with :func:`restore_state`; both live here, at the bottom of the
package, so every layer can use them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import reprlib
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TextIO, TypeVar

T = TypeVar("T")

SECRET_ENV_VARS = (
    "WANDB_API_KEY",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
    "MLFLOW_TRACKING_CLIENT_CERT_PATH",
    "DATABRICKS_TOKEN",
    "HF_TOKEN",
    "AWS_SECRET_ACCESS_KEY",
)
"""Environment variables whose values never appear in anything fp8track writes."""

_URI_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/\s@'\"]+@")


def redact(text: str) -> str:
    """``text`` with credentials removed: ``scheme://user:password@host`` becomes
    ``scheme://***@host``, and the value of each :data:`SECRET_ENV_VARS` set in the environment
    (4 characters or more) becomes ``***``. The one redactor: applied to every record line,
    ``meta.json``, tracker params/tags/config, failure messages, every :class:`ConfigError` and
    what the command line prints (:func:`redacted_output`).

    Example:
        >>> redact("https://alice:pw@mlflow.example.com/api")
        'https://***@mlflow.example.com/api'
    """
    if "@" in text:
        text = _URI_CREDENTIALS.sub(r"\g<scheme>***@", text)
    for name in SECRET_ENV_VARS:
        value = os.environ.get(name)
        if value and len(value) >= 4 and value in text:
            text = text.replace(value, "***")
    return text


class _RedactingStream:
    """A text stream that writes through :func:`redact` to the stream it wraps."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        return self._stream.write(redact(text))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def redacted_output() -> Iterator[None]:
    """Inside the block, what is written to ``sys.stdout`` / ``sys.stderr`` passes through
    :func:`redact`: for third-party lines fp8track cannot word itself (MLflow prints "View run
    <name> at: <tracking URI>/..." with the URI's password when a run ends)."""
    with contextlib.redirect_stdout(_RedactingStream(sys.stdout)):  # type: ignore[type-var]
        with contextlib.redirect_stderr(_RedactingStream(sys.stderr)):  # type: ignore[type-var]
            yield


class ConfigError(ValueError):
    """A bad argument or configuration value, detected before any training step. Its message is
    redacted (:func:`redact`): a tracking URI's password never reaches a log or a terminal."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args))


class RankFailure(RuntimeError):
    """Another rank failed, died or stopped answering during one of fp8track's collectives.

    Raised after a bounded wait instead of hanging forever: the run cannot go on consistently
    (the training's own collectives would hang next), so it stops with this message.
    """


class TrainingHalted(RuntimeError):
    """fp8track stopped training: a non-finite loss, gradient or parameter (or, when asked, a
    divergence or a spike) was seen before a checkpoint of that step was written. The message says
    why and at which step; the run directory's ``halt`` event records it too."""


_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 80
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 6
_SHORT.maxlevel = 2
SHORT_REPR_CHARS = 160


def short_repr(value: object) -> str:
    """``repr(value)`` bounded in depth and to :data:`SHORT_REPR_CHARS` characters, for error
    messages: a value read from a file may be huge (YAML aliases expand a few lines into billions
    of items, whose full repr alone exhausts memory)."""
    text = _SHORT.repr(value)
    return text if len(text) <= SHORT_REPR_CHARS else text[: SHORT_REPR_CHARS - 3] + "..."


def invalid_choice(
    what: str, value: object, valid: Iterable[object], hint: str = "", where: str = ""
) -> ConfigError:
    """Build the standard "unknown X" error: names the value received (``no X given`` for None)
    and the valid ones; ``where`` (e.g. ``"sweep file s.yaml"``) comes first.

    Example:
        >>> str(invalid_choice("method", "gird", ("grid", "random"), where="sweep file s.yaml"))
        "sweep file s.yaml: unknown method 'gird'; valid values are: 'grid', 'random'"
    """
    choices = ", ".join(short_repr(v) for v in valid)
    found = f"no {what} given" if value is None else f"unknown {what} {short_repr(value)}"
    message = f"{where + ': ' if where else ''}{found}; valid values are: {choices}"
    if hint:
        message += f". {hint}"
    return ConfigError(message)


def as_names(value: Any) -> tuple[Any, ...]:
    """A list setting as a tuple; a bare string is a one-element list (``tensors: activation`` in
    YAML means ``[activation]``, never its letters)."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Mapping) or not isinstance(value, Iterable):
        raise ConfigError(f"expected a list of names, got {type(value).__name__} {short_repr(value)}")
    return tuple(value)


def check_int(name: str, value: object, minimum: int) -> None:
    """Raise :class:`ConfigError` unless ``value`` is an int (not a bool) >= ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {short_repr(value)}")


def check_float(
    name: str, value: object, low: float, *, strict: bool = False, allow_inf: bool = False
) -> None:
    """Raise :class:`ConfigError` unless ``value`` is a real number >= ``low`` (> with ``strict``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    if ok:
        ok = (value > low if strict else value >= low) and (allow_inf or math.isfinite(value))
    if not ok:
        rel = ">" if strict else ">="
        raise ConfigError(f"{name} must be a number {rel} {low}, got {short_repr(value)}")


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
    :class:`ConfigError` naming the valid ones), and ``Config(unknown=...)`` from Python is the
    same :class:`ConfigError` (Python's own is a ``TypeError`` that names no valid keyword)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # __new__ sees the keywords before the dataclass's generated __init__ does.
        if kwargs and dataclasses.is_dataclass(cls):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(kwargs) - known)
            if unknown:
                raise invalid_choice(f"{cls.__name__} keyword", unknown[0], sorted(known))
        return super().__new__(cls)

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
    if _expanded_size(data, MAX_YAML_VALUES) > MAX_YAML_VALUES:
        raise ConfigError(
            f"{what} {name!r} expands to more than {MAX_YAML_VALUES:,} values through YAML aliases "
            "(&anchor / *alias): refused; write the values out"
        )
    return data


MAX_YAML_VALUES = 100_000
"""The most values (scalars, lists, mappings, each alias counted at every use) a YAML file fp8track
reads may expand to: a "billion laughs" file of ten lines expands to 10^9 strings."""


def _expanded_size(data: Any, limit: int) -> int:
    """How many values ``data`` holds with shared (aliased) parts counted at every use; stops
    counting past ``limit``."""
    count, stack = 0, [data]
    while stack and count <= limit:
        item = stack.pop()
        count += 1
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count


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


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the first frame outside fp8track: the
    user's line that called into it (``monitor.step(...)`` in their loop), whatever path inside the
    package led there. A fixed ``stacklevel`` points into the package when the path changes (the
    FP8-share warning named ``monitor.py``); Python 3.12's ``skip_file_prefixes`` does this, and the
    package supports 3.10."""
    frame, level = sys._getframe(1), 2  # stacklevel 2 is this function's caller
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
