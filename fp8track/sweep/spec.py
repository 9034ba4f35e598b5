"""Load a W&B sweep YAML and refuse a bad one before any training.

The file is read with ``yaml.safe_load`` (a ``!!python/...`` tag is refused), checked against the
``sweeps`` package's JSON schema when it is installed (``pip install 'fp8track[sweep]'`` pins
``sweeps==0.2.0``: 0.3.0 requires numpy < 2; 0.2.0's schema predates ``run_cap``, which is
therefore removed before validating and read here as the default trial count), then by rules of
our own that hold with or without the schema:

* ``method`` is ``grid``, ``random`` or ``bayes`` (``custom`` needs a W&B server);
* ``metric`` has a ``name`` and a ``goal`` of ``minimize``/``maximize``;
* every parameter is flat (no nested ``parameters:``, which the sweeps engine drops silently), its
  name matches the schema's ``^[A-Za-z_][A-Za-z0-9_.-]*$`` and is an option of the program (a
  misspelt name would otherwise train on the program's default while the tracker shows the sweep's
  value), and it has exactly one of ``value``, a non-empty ``values`` list, or ``min``/``max``;
* every ``recipe`` value parses (:meth:`fp8track.execution.recipes.Recipe.parse`) and every
  ``bf16_layers`` value parses (:meth:`fp8track.execution.fallback.FallbackSpec.parse`);
* ``early_terminate`` is ``hyperband`` with ``min_iter`` (or ``max_iter`` and ``s``), ``eta`` >= 2;
* ``command`` (default W&B's ``${env} ${interpreter} ${program} ${args}``) uses only the macros
  ``wandb agent`` knows (:mod:`fp8track.sweep.command`); the program is any script or module: the
  executor runs it as a subprocess per trial. Only for the example program
  (``fp8track.examples.train``) are parameter names checked against its options.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8track.errors import ConfigError, invalid_choice, read_yaml_mapping, short_repr

METHODS = ("grid", "random", "bayes")
GOALS = ("minimize", "maximize")
EXAMPLE_PROGRAMS = ("fp8track.examples.train", "examples/sweep_train.py")
NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
DISTRIBUTIONS = ("constant", "categorical", "int_uniform", "uniform", "log_uniform_values")


@dataclass(frozen=True)
class Param:
    """One sweep parameter: ``kind`` is ``constant`` (``value``), ``categorical`` (``values``) or a
    numeric distribution over ``[low, high]``."""

    name: str
    kind: str
    value: Any = None
    values: tuple[Any, ...] = ()
    low: float = math.nan
    high: float = math.nan


@dataclass(frozen=True)
class Hyperband:
    """W&B hyperband: ``min_iter`` evaluations before the first cut, ``eta`` the reduction factor;
    ``max_iter`` is ``None`` when the trial's evaluation count decides."""

    min_iter: int
    eta: int = 3
    max_iter: int | None = None


@dataclass(frozen=True)
class SweepSpec:
    """A validated sweep.

    Attributes:
        name: sweep name (Optuna study, MLflow experiment and parent run, W&B group).
        method: one of :data:`METHODS`.
        metric: the metric's name; ``goal`` its direction.
        params: the parameters, in file order.
        hyperband: early termination, or ``None``.
        run_cap: the file's ``run_cap`` (default trial count), or ``None``.
        program: the program the YAML runs; ``command`` its command line with macros.
        raw: the file as loaded.
        schema_checked: True when the ``sweeps`` package's schema validated it.
    """

    name: str
    method: str
    metric: str
    goal: str
    params: tuple[Param, ...]
    hyperband: Hyperband | None = None
    run_cap: int | None = None
    program: str = EXAMPLE_PROGRAMS[0]
    command: tuple[str, ...] = ()
    raw: Mapping[str, Any] = field(default_factory=dict)
    schema_checked: bool = False

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)

    @property
    def constants(self) -> dict[str, Any]:
        return {p.name: p.value for p in self.params if p.kind == "constant"}

    @property
    def grid_size(self) -> int | None:
        """Number of grid points (``None`` when a parameter is not a list)."""
        n = 1
        for p in self.params:
            if p.kind == "categorical":
                n *= len(p.values)
            elif p.kind != "constant":
                return None
        return n


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Safe-load a YAML mapping; a missing or non-UTF-8 file, unsafe tags, syntax errors and
    non-mappings raise ConfigError (:func:`fp8track.errors.read_yaml_mapping`)."""
    return read_yaml_mapping(path, "sweep file")


def schema_violations(config: Mapping[str, Any]) -> list[str] | None:
    """Messages of the ``sweeps`` package's schema check, or ``None`` when it is not installed."""
    import warnings

    try:
        with warnings.catch_warnings():  # sweeps 0.2.0's pydantic v1 config keys warn under pydantic v2
            warnings.simplefilter("ignore", UserWarning)
            from sweeps import schema_violations_from_proposed_config
    except ImportError:
        return None
    cfg = {k: v for k, v in config.items() if k != "run_cap"}  # 0.2.0's schema predates run_cap
    return list(schema_violations_from_proposed_config(cfg))


def program_options() -> set[str]:
    """What a trial may vary: ``recipe``, ``bf16_layers`` and the example program's
    :class:`fp8track.examples.train.TrainConfig` fields (each a ``--name`` option)."""
    from fp8track.examples.trial_config import TrainConfig

    return {"recipe", "bf16_layers"} | {f.name for f in dataclasses.fields(TrainConfig)}


def load_sweep(
    source: str | os.PathLike[str] | Mapping[str, Any], *, require_schema: bool = False
) -> SweepSpec:
    """Load and validate a sweep (module docstring); every problem raises :class:`ConfigError`
    naming it, before any training."""
    raw = dict(source) if isinstance(source, Mapping) else read_yaml(source)
    where = "sweep" if isinstance(source, Mapping) else f"sweep file {source}"
    method = raw.get("method")
    if method not in METHODS:
        hint = "'custom' needs a W&B server (wandb sweep + wandb agent)" if method == "custom" else ""
        raise invalid_choice("method", method, METHODS, hint, where=where)
    metric = raw.get("metric")
    if not isinstance(metric, Mapping) or not metric.get("name"):
        raise ConfigError(
            f"{where}: metric must be a mapping with a name, e.g. {{name: fp8/val_loss_gap, goal: minimize}}"
        )
    goal = metric.get("goal", "minimize")
    if goal not in GOALS:
        raise invalid_choice("metric goal", goal, GOALS, where=where)
    if not raw.get("program"):
        raise ConfigError(f"{where}: program is missing: the script or module each trial runs, e.g. train.py")
    program = str(raw["program"])
    from fp8track.sweep.command import DEFAULT_COMMAND, check_command

    command = check_command(raw.get("command") or DEFAULT_COMMAND, where)
    params = _params(raw.get("parameters"), where, example=program in EXAMPLE_PROGRAMS)
    if method == "grid":
        loose = [p.name for p in params if p.kind not in ("constant", "categorical")]
        if loose:
            raise ConfigError(
                f"{where}: method 'grid' needs a values list for every parameter; not for: {', '.join(loose)}"
            )
    hyperband = _hyperband(raw.get("early_terminate"), where)
    # Our rules first (their messages name the parameter), then the W&B schema for the rest.
    violations = schema_violations(raw)
    if violations is None and require_schema:
        raise ConfigError("the sweeps schema check needs the sweeps package: pip install 'fp8track[sweep]'")
    if violations:
        raise ConfigError(f"{where} fails the W&B sweep schema: " + "; ".join(violations))
    run_cap = raw.get("run_cap")
    if run_cap is not None and (not isinstance(run_cap, int) or isinstance(run_cap, bool) or run_cap < 1):
        raise ConfigError(f"{where}: run_cap must be an integer >= 1, got {short_repr(run_cap)}")
    return SweepSpec(
        name=str(raw.get("name") or ("sweep" if isinstance(source, Mapping) else Path(source).stem)),
        method=method, metric=str(metric["name"]), goal=goal, params=params,
        hyperband=hyperband, run_cap=run_cap, program=program, command=command, raw=raw,
        schema_checked=violations is not None,
    )


def _params(section: Any, where: str, example: bool) -> tuple[Param, ...]:
    if not isinstance(section, Mapping) or not section:
        raise ConfigError(f"{where}: parameters must be a non-empty mapping of name -> {{values: [...]}}")
    options = program_options() if example else None
    out = []
    for name, body in section.items():
        name = str(name)
        if not NAME_RE.match(name):
            raise ConfigError(f"{where}: parameter name {name!r} must match {NAME_RE.pattern}")
        if not isinstance(body, Mapping):
            raise ConfigError(
                f"{where}: parameter {name!r} must be a mapping (value, values or min/max), "
                f"got {short_repr(body)}"
            )
        if "parameters" in body:
            raise ConfigError(
                f"{where}: parameter {name!r} is nested; the sweeps engine drops nested parameters "
                "silently, use flat names (recipe, bf16_layers)"
            )
        if options is not None and name not in options:
            raise invalid_choice(
                "parameter (not an option of the sweep program)", name, sorted(options), where=where
            )
        out.append(_param(name, body, where, example))
    names = {p.name for p in out}
    for required in ("recipe", "bf16_layers"):
        if required not in names:
            raise ConfigError(f"{where}: parameters must include {required!r}")
    return tuple(out)


def _param(name: str, body: Mapping[str, Any], where: str, example: bool) -> Param:
    has = [k for k in ("value", "values", "min") if k in body]
    if len(has) != 1:
        raise ConfigError(f"{where}: parameter {name!r} needs exactly one of value, values or min/max; got "
                          f"{', '.join(has) or 'none of them'}")
    if "value" in body:
        if body["value"] is None or isinstance(body["value"], (dict, list)):
            raise ConfigError(
                f"{where}: parameter {name!r} value must be a scalar, got {short_repr(body['value'])}"
            )
        p = Param(name, "constant", value=body["value"])
    elif "values" in body:
        values = body["values"]
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{where}: parameter {name!r} has no values (values must be a non-empty list)")
        if any(v is None or isinstance(v, (dict, list)) for v in values):
            raise ConfigError(f"{where}: parameter {name!r} values must be scalars, got {short_repr(values)}")
        if len(set(map(str, values))) != len(values):
            raise ConfigError(f"{where}: parameter {name!r} lists a value twice: {short_repr(values)}")
        p = Param(name, "categorical", values=tuple(values))
    else:
        low, high = body.get("min"), body.get("max")
        if (
            not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high))
            or not low < high
        ):
            raise ConfigError(
                f"{where}: parameter {name!r} needs numbers min < max, got min={low!r} max={high!r}"
            )
        default = "int_uniform" if isinstance(low, int) and isinstance(high, int) else "uniform"
        dist = body.get("distribution", default)
        if dist not in DISTRIBUTIONS[2:]:
            raise invalid_choice(f"distribution of {name!r}", dist, DISTRIBUTIONS[2:], where=where)
        if dist == "log_uniform_values" and low <= 0:
            raise ConfigError(f"{where}: parameter {name!r}: log_uniform_values needs min > 0, got {low!r}")
        p = Param(name, dist, low=low, high=high)
    _check_values(p, where, example)
    return p


def _check_values(p: Param, where: str, example: bool) -> None:
    from fp8track.execution.fallback import FallbackSpec
    from fp8track.execution.recipes import Recipe

    values = (p.value,) if p.kind == "constant" else p.values
    for v in values:
        if p.name in ("recipe", "bf16_layers") and isinstance(v, bool):
            raise ConfigError(
                f"{where}: parameter {p.name!r} value {v!r} is a YAML boolean (off/no/on/yes unquoted), "
                "not a name: quote it, or write none for no BF16 layers"
            )
        try:
            if p.name == "recipe":
                Recipe.parse(str(v))
            elif p.name == "bf16_layers":
                FallbackSpec.parse(str(v))
        except ConfigError as err:
            raise ConfigError(f"{where}: parameter {p.name!r} value {v!r} does not parse: {err}") from None
    if example and p.kind == "constant" and p.name not in ("recipe", "bf16_layers"):
        _check_program_value(p.name, p.value, where)


def _check_program_value(name: str, value: Any, where: str) -> None:
    """A constant for a :class:`fp8track.examples.train.TrainConfig` field must build one."""
    from fp8track.examples.trial_config import TrainConfig

    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    if name in fields:
        try:
            TrainConfig(**{name: value})
        except (ConfigError, TypeError) as err:
            raise ConfigError(f"{where}: parameter {name!r} value {value!r} is invalid: {err}") from None


def _hyperband(section: Any, where: str) -> Hyperband | None:
    if section is None:
        return None
    if not isinstance(section, Mapping) or section.get("type") != "hyperband":
        kind = section.get("type") if isinstance(section, Mapping) else section
        raise invalid_choice("early_terminate type", kind, ("hyperband",), where=where)
    eta = section.get("eta", 3)
    min_iter, max_iter, s = section.get("min_iter"), section.get("max_iter"), section.get("s")
    for key, v in (("eta", eta), ("min_iter", min_iter), ("max_iter", max_iter), ("s", s)):
        if v is not None and (
            not isinstance(v, int) or isinstance(v, bool) or v < (2 if key == "eta" else 1)
        ):
            raise ConfigError(
                f"{where}: early_terminate {key} must be an integer >= {2 if key == 'eta' else 1}, got {v!r}"
            )
    if min_iter is None:
        if max_iter is None or s is None:
            raise ConfigError(f"{where}: hyperband needs min_iter, or max_iter together with s")
        min_iter = max(1, max_iter // eta**s)
    return Hyperband(min_iter=min_iter, eta=eta, max_iter=max_iter)


__all__ = [
    "METHODS",
    "EXAMPLE_PROGRAMS",
    "Param",
    "Hyperband",
    "SweepSpec",
    "load_sweep",
    "read_yaml",
    "schema_violations",
]
