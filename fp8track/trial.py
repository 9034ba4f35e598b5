"""What one sweep trial is, for any training program: its settings and its cached references.

* :func:`trial_settings` reads a trial's ``recipe``, ``bf16_layers`` and control reference from the
  command line (``${args}`` of a W&B sweep: ``--recipe=current --bf16_layers=auto:2``) or, on ranks
  that have no ``wandb.config`` (DDP ranks > 0), from the YAML the W&B agent writes at
  ``WANDB_SWEEP_PARAM_PATH``; the command line wins.
* :class:`JsonCache` keeps results that every trial of a sweep shares and no trial should recompute
  (the BF16 control's held-out losses, the ``auto:K`` probe's ranking), keyed by everything they
  depend on, safe for several worker processes on one machine (a lock per key).
* :func:`ranking_table` turns :func:`fp8track.analysis.ranking.rank_layers` into table rows, so a
  person can see why ``auto:K`` kept a layer in BF16.

This module sits below ``examples`` and ``sweep`` so that both the sweep program and users' own
programs can use it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8track.analysis.ranking import SIGNALS, LayerRisk
from fp8track.errors import ConfigError
from fp8track.execution.fallback import FallbackSpec
from fp8track.execution.recipes import Recipe

PARAM_PATH_ENV = "WANDB_SWEEP_PARAM_PATH"
"""Environment variable the W&B agent sets to the YAML file holding the trial's parameters."""


@dataclass(frozen=True)
class TrialSettings:
    """A trial's FP8 settings, validated at construction.

    Attributes:
        recipe: the recipe (:meth:`Recipe.parse` of the ``recipe`` parameter).
        bf16_layers: the fallback spec as parsed.
        control: the control reference (a run directory, ``mlflow:<run_id>``, a W&B offline run),
            or ``None`` when the program computes or caches its own control.
        params: every parameter the trial received (name -> value), for logging.
    """

    recipe: Recipe
    bf16_layers: FallbackSpec
    control: str | None = None
    params: Mapping[str, Any] = field(default_factory=dict)

    @property
    def spec(self) -> str:
        """The fallback spec as written (``"none"``, ``"first_last"`` -> ``"first:1,last:1,head"``)."""
        return str(self.bf16_layers)


def add_trial_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--recipe``, ``--bf16_layers`` (alias ``--bf16-layers``) and ``--control`` to ``parser``.

    Defaults are ``None`` so :func:`trial_settings` can tell "not given" from a value.
    """
    parser.add_argument("--recipe", default=None, help="FP8 recipe string, e.g. delayed:hybrid:h16:max (default delayed)")
    parser.add_argument("--bf16_layers", "--bf16-layers", dest="bf16_layers", default=None,
                        help="layers kept in BF16: none, first:N, last:N, first_last, re:REGEX, auto:K (default none)")
    parser.add_argument("--control", default=None, help="control run: run directory, mlflow:<run_id> or W&B offline run")
    return parser


def read_param_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parameters of a W&B agent's YAML (``{name: {"value": v}}``, ``wandb_version`` skipped).

    Raises:
        ConfigError: the file is missing, not safe YAML, or not a mapping.
    """
    import yaml

    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as err:
        raise ConfigError(f"cannot read the sweep parameter file {p} ({PARAM_PATH_ENV}): {err}") from err
    except yaml.YAMLError as err:
        raise ConfigError(f"sweep parameter file {p} is not safe YAML: {err}") from err
    if not isinstance(data, Mapping):
        raise ConfigError(f"sweep parameter file {p} must hold a mapping, got {type(data).__name__}")
    out: dict[str, Any] = {}
    for k, v in data.items():
        if k == "wandb_version" or str(k).startswith("_"):
            continue
        out[str(k)] = v.get("value") if isinstance(v, Mapping) and "value" in v else v
    return out


def trial_settings(
    argv: Sequence[str] | None = None,
    *,
    param_path: str | os.PathLike[str] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> TrialSettings:
    """Read a trial's settings; the command line wins over the W&B parameter file, which wins over
    ``defaults`` (``recipe="delayed"``, ``bf16_layers="none"`` unless given).

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``); unknown options are ignored, so
            the program's own options can sit beside them.
        param_path: the W&B parameter YAML (default: ``$WANDB_SWEEP_PARAM_PATH`` when set).
        defaults: fallback values for ``recipe``, ``bf16_layers``, ``control``.

    Raises:
        ConfigError: a recipe or fallback spec that does not parse (before any training).

    Example:
        >>> s = trial_settings(["--recipe=current", "--bf16_layers=first_last", "--lr=1e-3"], param_path="")
        >>> s.recipe.name, s.spec
        ('current', 'first:1,last:1')
    """
    cli, _unknown = add_trial_arguments(argparse.ArgumentParser(add_help=False)).parse_known_args(argv)
    path = os.environ.get(PARAM_PATH_ENV) if param_path is None else (param_path or None)
    from_file = read_param_file(path) if path else {}
    values: dict[str, Any] = {"recipe": "delayed", "bf16_layers": "none", "control": None, **dict(defaults or {})}
    values.update({k: v for k, v in from_file.items() if v is not None})
    values.update({k: v for k, v in vars(cli).items() if v is not None})
    return TrialSettings(
        recipe=Recipe.parse(values["recipe"]),
        bf16_layers=FallbackSpec.parse(values["bf16_layers"]),
        control=values["control"] or None,
        params=values,
    )


# --- shared, cached results ----------------------------------------------------------------------


def cache_key(parts: Mapping[str, Any]) -> str:
    """A short stable hash of ``parts`` (JSON with sorted keys): 16 hex digits."""
    text = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class JsonCache:
    """JSON results in ``root/<kind>-<key>.json``, computed once per key.

    :meth:`get_or_compute` holds an exclusive ``flock`` on ``<kind>-<key>.lock`` while it computes,
    so two worker processes on one machine wait for each other instead of computing twice; the
    result is written to a temporary file and renamed, so a killed writer leaves no torn entry.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def path(self, kind: str, parts: Mapping[str, Any]) -> Path:
        return self.root / f"{kind}-{cache_key(parts)}.json"

    def get(self, kind: str, parts: Mapping[str, Any]) -> dict[str, Any] | None:
        p = self.path(kind, parts)
        return json.loads(p.read_text()) if p.is_file() else None

    def get_or_compute(
        self, kind: str, parts: Mapping[str, Any], compute: Callable[[], Mapping[str, Any]]
    ) -> tuple[dict[str, Any], bool]:
        """``(result, cached)``: the stored result for ``parts``, or ``compute()`` stored now."""
        p = self.path(kind, parts)
        self.root.mkdir(parents=True, exist_ok=True)
        with file_lock(p.with_suffix(".lock")):
            if p.is_file():
                return json.loads(p.read_text()), True
            result = {"key": dict(parts), **dict(compute())}
            tmp = p.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(result, indent=1, default=str))
            os.replace(tmp, p)
            return result, False


@contextlib.contextmanager
def file_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing): one process at a time on
    this machine."""
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# --- the auto:K ranking as a table ------------------------------------------------------------------


def ranking_table(ranking: Sequence[LayerRisk]) -> list[dict[str, Any]]:
    """One row per layer, riskiest first: ``rank``, ``layer``, ``score``, the ``tensor`` giving it,
    the five z-scores (``z_<signal>``) and that tensor's summarised ``sqnr_db``, ``underflow_pct``,
    ``overflow_pct``, ``abs_drift_log2`` (NaN written as ``None``)."""

    def num(v: Any) -> float | None:
        return float(v) if isinstance(v, (int, float)) and math.isfinite(float(v)) else None

    rows = []
    for i, r in enumerate(ranking):
        st = r.stats.get(r.tensor, {})
        row: dict[str, Any] = {"rank": i + 1, "layer": r.layer, "score": num(r.score), "tensor": r.tensor}
        row.update({f"z_{s}": num(r.z.get(s)) for s in SIGNALS})
        row.update({k: num(st.get(k)) for k in ("sqnr_db", "underflow_pct", "overflow_pct", "abs_drift_log2")})
        rows.append(row)
    return rows


__all__ = [
    "PARAM_PATH_ENV",
    "TrialSettings",
    "add_trial_arguments",
    "read_param_file",
    "trial_settings",
    "cache_key",
    "JsonCache",
    "file_lock",
    "ranking_table",
]
