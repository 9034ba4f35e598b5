"""How to run a sweep (:class:`SweepOptions`) and what one program run leaves (:class:`RunOutcome`):
the plain data every part of the executor reads."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from fp8track.errors import ConfigError, check_int, invalid_choice
from fp8track.trial import AUTO_FROM


@dataclass(frozen=True)
class SweepOptions:
    """How to run a sweep.

    Attributes:
        trials: COMPLETE or PRUNED trials the sweep needs (>= 1).
        out: folder for the default stores, logs and the result cache.
        tracking_uri: MLflow tracking URI (default ``sqlite:///<out>/mlflow.db``).
        storage: Optuna RDB URL (default ``sqlite:///<out>/optuna.db``).
        wandb: programs that use W&B log offline into ``<out>/wandb``, grouped by the sweep name.
        seed: sampler seed (module docstring).
        progress: show the live display.
        tolerance_factor, tolerance_floor: the noise band (:mod:`fp8track.sweep.summary`).
        control_seeds: seeds of the control and of the finalists' reruns (from the trials' seed up).
        finalists: trials rerun on every control seed before the recommendation.
        seed_param: the sweep parameter holding the program's seed (absent: one seed, not varied).
        heartbeat_s, grace_s: Optuna heartbeat interval and the silence after which a RUNNING
            trial counts as dead (seconds).
        max_retry: how often a dead trial is queued again.
        threads: ``OMP_NUM_THREADS`` of each program.
        kill_grace_s: seconds between SIGTERM and SIGKILL when a trial is pruned, timed out or
            interrupted.
        trial_timeout_s: seconds one program run (a trial, a control, a finalist's rerun) may take;
            a run past it is stopped and FAILED, and the sweep goes on (``None``: no limit).
        poll_s: how often the running program's metric is read, seconds.
        cwd: the programs' working directory (relative ``program`` paths start here).
        auto_from: where ``auto:K`` rankings come from (:data:`AUTO_FROM`): ``"probe"``, an
            all-FP8 run of the trial's recipe; ``"whatif"``, that recipe's what-if rows in the
            BF16 control (no FP8 run; recipes mxfp8, block, nvfp4).
    """

    trials: int
    out: Path = Path("fp8track-sweep")
    tracking_uri: str | None = None
    storage: str | None = None
    wandb: bool = False
    seed: int = 0
    progress: bool = True
    tolerance_factor: float = 1.0
    tolerance_floor: float = 0.01
    control_seeds: int = 2
    finalists: int = 2
    seed_param: str = "seed"
    heartbeat_s: int = 5
    grace_s: int = 20
    max_retry: int = 2
    threads: int = 1
    kill_grace_s: float = 10.0
    poll_s: float = 0.5
    cwd: Path = field(default_factory=Path.cwd)
    auto_from: str = "probe"
    trial_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.auto_from not in AUTO_FROM:
            raise invalid_choice("auto_from (where auto:K rankings come from)", self.auto_from, AUTO_FROM)
        check_int("trials", self.trials, 1)
        check_int("control_seeds", self.control_seeds, 1)
        check_int("finalists", self.finalists, 0)
        check_int("heartbeat_s", self.heartbeat_s, 1)
        check_int("grace_s", self.grace_s, self.heartbeat_s + 1)
        check_int("max_retry", self.max_retry, 0)
        check_int("threads", self.threads, 1)
        _check_seconds("kill_grace_s", self.kill_grace_s, allow_zero=True)
        _check_seconds("poll_s", self.poll_s)
        if self.trial_timeout_s is not None:
            _check_seconds("trial_timeout_s", self.trial_timeout_s)
        object.__setattr__(self, "out", Path(self.out).resolve())
        object.__setattr__(self, "cwd", Path(self.cwd).resolve())

    @property
    def mlflow_uri(self) -> str:
        return self.tracking_uri or f"sqlite:///{self.out / 'mlflow.db'}"

    @property
    def storage_url(self) -> str:
        return self.storage or f"sqlite:///{self.out / 'optuna.db'}"


def _check_seconds(name: str, value: float, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{name} must be a finite number of seconds {bound}, got {value!r}")


SWEEPS_ROOT = Path("fp8track-sweep")
"""Where a sweep writes when no ``--out`` is given: ``<SWEEPS_ROOT>/<folder_name(name)>``."""


def folder_name(name: str) -> str:
    """The sweep name as one safe folder name: characters other than letters, digits, ``.``,
    ``_`` and ``-`` become ``-``, leading dots and dashes go (so ``..`` and ``/`` cannot climb out
    of :data:`SWEEPS_ROOT`); the name itself stays the experiment's and the study's.

    Example:
        >>> folder_name("../../../escape"), folder_name("my fp8/v2"), folder_name("..")
        ('escape', 'my-fp8-v2', 'sweep')
    """
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", name).lstrip(".-")
    safe = re.sub(r"-*\.\.+-*", "-", safe).strip("-")  # no '..' left anywhere
    return safe[:120] or "sweep"


def default_out(name: str) -> Path:
    """``./fp8track-sweep/<folder_name(name)>``, always inside ``./fp8track-sweep``."""
    return SWEEPS_ROOT / folder_name(name)


@dataclass
class RunOutcome:
    """One program run: its MLflow run, state (``COMPLETE``, ``PRUNED``, ``FAIL``), metric values
    in order, wall seconds, and the run it copied when it trained nothing."""

    run_id: str
    state: str
    values: list[float]
    seconds: float = 0.0
    reused_from: str | None = None
    error: str = ""

    @property
    def final(self) -> float:
        return self.values[-1] if self.values else math.nan


class MetricNotLogged(ConfigError):
    """The program finished without logging the sweep's metric."""


class ProgramRefused(ConfigError):
    """A program run stopped on fp8track's :class:`~fp8track.errors.ConfigError` about input every
    run shares (the sweep's control, its settings): the next runs would be refused the same way."""


__all__ = ["SweepOptions", "RunOutcome", "MetricNotLogged", "ProgramRefused", "SWEEPS_ROOT", "folder_name",
           "default_out"]
