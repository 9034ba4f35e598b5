"""How to run a sweep (:class:`SweepOptions`) and what one program run leaves (:class:`RunOutcome`):
the plain data every part of the executor reads."""

from __future__ import annotations

import math
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
        kill_grace_s: seconds between SIGTERM and SIGKILL when a trial is pruned.
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
        object.__setattr__(self, "out", Path(self.out).resolve())
        object.__setattr__(self, "cwd", Path(self.cwd).resolve())

    @property
    def mlflow_uri(self) -> str:
        return self.tracking_uri or f"sqlite:///{self.out / 'mlflow.db'}"

    @property
    def storage_url(self) -> str:
        return self.storage or f"sqlite:///{self.out / 'optuna.db'}"


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


__all__ = ["SweepOptions", "RunOutcome", "MetricNotLogged"]
