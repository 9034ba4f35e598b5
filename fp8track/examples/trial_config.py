"""What one sweep trial of the example program is configured by and returns, without importing
Lightning or torch (``fp8track sweep`` checks a YAML's constants against :class:`TrainConfig`
before any trial runs): the metric names, :class:`TrainConfig`, :class:`Evaluation` and
:class:`TrialResult`. The program itself: :mod:`fp8track.examples.train`."""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8track.errors import ConfigError, check_float, check_int
from fp8track.monitoring.naming import run_metric

GAP_METRIC = run_metric("val_loss_gap")
"""``fp8/val_loss_gap``: held-out loss minus the control's at the same step, nats (the sweep metric)."""
GAP_BEST_METRIC = run_metric("val_loss_gap_best")
"""``fp8/val_loss_gap_best``: running minimum of :data:`GAP_METRIC` (MLflow keeps only a run's last value)."""
VAL_LOSS_METRIC = run_metric("val_loss")
"""``fp8/val_loss``: held-out loss, nats."""


@dataclass(frozen=True)
class TrainConfig:
    """Everything a trial shares with its BF16 control (the control's cache key), validated.

    Attributes:
        steps: optimizer steps.
        eval_every: held-out evaluation every N steps (and at the last step); 0 = none.
        eval_batches: held-out batches per evaluation (the first ones of the validation split).
        seed: model initialisation and data order.
        n_layer, n_embd, n_head, block_size, batch_size, lr, max_bytes, data: the example GPT
            and its data (:func:`fp8track.examples.gpt_lightning.build_example`).
        every_n_steps: monitor sampling interval.
        precision: Lightning precision (``"bf16-mixed"`` or ``"32-true"``).
        plant_outlier: a linear's qualified name to make fragile (module docstring), or ``""``.
        control_seeds: seeds of the BF16 control (``seed``, ``seed + 1``, ...); >= 2 measures
            the spread the recommendation's tolerance is based on.
        probe_steps: steps of the ``auto:K`` probe.
    """

    steps: int = 120
    eval_every: int = 20
    eval_batches: int = 8
    seed: int = 0
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    block_size: int = 64
    batch_size: int = 16
    lr: float = 3e-3
    max_bytes: int = 1_000_000
    data: str = ""
    every_n_steps: int = 10
    precision: str = "bf16-mixed"
    plant_outlier: str = ""
    control_seeds: int = 2
    probe_steps: int = 30

    def __post_init__(self) -> None:
        for name, low in (
            ("steps", 1),
            ("eval_every", 0),
            ("eval_batches", 1),
            ("seed", 0),
            ("n_layer", 1),
            ("n_embd", 16),
            ("n_head", 1),
            ("block_size", 1),
            ("batch_size", 1),
            ("max_bytes", 1),
            ("every_n_steps", 1),
            ("control_seeds", 1),
            ("probe_steps", 1),
        ):
            check_int(name, getattr(self, name), low)
        check_float("lr", self.lr, 0.0, strict=True)
        if self.precision not in ("bf16-mixed", "32-true"):
            raise ConfigError(
                f"unknown precision {self.precision!r}; valid values are: 'bf16-mixed', '32-true'"
            )

    def control_key(self) -> dict[str, Any]:
        """What the control depends on: model, data, seed(s), steps, evaluation schedule."""
        key = dataclasses.asdict(self)
        key.pop("probe_steps")
        key["data_bytes"] = Path(self.data).stat().st_size if self.data else f"stdlib-{sys.version_info[:2]}"
        return key


@dataclass(frozen=True)
class Evaluation:
    """One held-out evaluation: optimizer step, held-out loss (nats), gap to the control (nats or NaN)."""

    index: int
    step: int
    val_loss: float
    gap: float


@dataclass
class TrialResult:
    """What :func:`train` returns.

    Attributes:
        evals: the evaluations, in order.
        pruned: the ``on_eval`` hook stopped training early.
        run_dir: the monitor's run directory.
        seconds_per_step: training wall time per optimizer step (evaluations excluded), seconds.
        fp8_layers, bf16_layers: the layer split :func:`fp8track.apply_fp8` made.
        metrics: run-level metrics (:func:`run_metrics`).
        ranking: the ``auto:K`` table when the spec needed one.
    """

    evals: list[Evaluation]
    pruned: bool
    run_dir: Path
    seconds_per_step: float
    fp8_layers: tuple[str, ...]
    bf16_layers: tuple[str, ...]
    metrics: dict[str, float] = field(default_factory=dict)
    ranking: list[dict[str, Any]] | None = None

    @property
    def final_gap(self) -> float:
        return self.evals[-1].gap if self.evals else math.nan

    @property
    def best_gap(self) -> float:
        gaps = [e.gap for e in self.evals if math.isfinite(e.gap)]
        return min(gaps) if gaps else math.nan
