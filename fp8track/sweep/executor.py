"""Run a sweep YAML with Optuna, without a W&B server: the YAML's program, one subprocess per trial,
logging into MLflow parent/child runs.

The parts, each in its module:

* :mod:`~fp8track.sweep.sampling`: the Optuna study, samplers re-seeded per trial, the hyperband
  pruner;
* :mod:`~fp8track.sweep.mlflow_runs`: the experiment, the parent run and the child runs;
* :mod:`~fp8track.sweep.launch`: one program run (``wandb agent``'s argv, its metric read while it
  runs, pruning), or the cached result of the same parameters reused;
* :mod:`~fp8track.sweep.controls`: the cached BF16 control per seed and the ``auto:K`` rankings
  handed to each run (``FP8TRACK_SWEEP_CONTROL``, ``FP8TRACK_SWEEP_RANKING``);
* :mod:`~fp8track.sweep.finish`: the finalists rerun on the control's seeds and the summary.

This module is the loop over them. The program reads its trial with
:func:`fp8track.trial.trial_settings`; the executor imports no model. The run's last value of the
YAML's ``metric.name`` is its result; ``goal`` sets the study's direction.

* **Storage**: an Optuna RDB (default ``sqlite:///<out>/optuna.db``; PostgreSQL for many machines)
  with heartbeats; several ``fp8track sweep --storage <same URL>`` processes share one study; a
  killed worker's trial is failed after ``grace_s`` and retried with the same parameters. Trials
  beyond the budget (two workers asked at once) are failed before running, user attribute
  ``surplus``.
* **Finish**: the last worker reruns the finalists on the control's seeds and writes the summary
  to the parent.
"""

from __future__ import annotations

import math
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from fp8track.optional import require
from fp8track.sweep.command import program_hash
from fp8track.sweep.controls import Controls, control_whatif
from fp8track.sweep.finish import finish_sweep, read_summary
from fp8track.sweep.launch import Launcher
from fp8track.sweep.mlflow_runs import GAP_METRIC, SweepRuns
from fp8track.sweep.options import SweepOptions
from fp8track.sweep.progress import SweepProgress
from fp8track.sweep.sampling import (
    PARENT_ATTR,
    Surplus,
    counts,
    experimental_ok,
    failed_trials,
    last_trial_of,
    open_study,
    suggest,
    summary_writer,
    wait_for_parent,
)
from fp8track.sweep.spec import SweepSpec
from fp8track.sweep.summary import Recommendation, TrialRow, signed_gap
from fp8track.trackers.mlflow import RetryingClient
from fp8track.trial import file_lock


@dataclass
class SweepOutcome:
    """What :func:`run_sweep` leaves: the parent run, every trial row, the recommendation
    (``None`` until every trial finished, and in the workers that did not write it), the trials
    this process ran, and the summary another worker wrote."""

    parent_run_id: str
    rows: list[TrialRow] = field(default_factory=list)
    recommendation: Recommendation | None = None
    ran: list[int] = field(default_factory=list)
    summary_text: str | None = None


class _Sweep:
    """One executor process: the study, the MLflow runs, the program runs."""

    def __init__(self, spec: SweepSpec, options: SweepOptions) -> None:
        self.optuna = require("optuna", "fp8track sweep")
        require("mlflow", "fp8track sweep's MLflow runs")
        from mlflow.tracking import MlflowClient

        self.spec, self.options = spec, options
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self.progress: SweepProgress | None = None
        self.ran: list[int] = []
        whatif = control_whatif(spec, options.auto_from)  # refused before any store exists
        hashed = program_hash(spec.program, spec.command, options.cwd)
        options.out.mkdir(parents=True, exist_ok=True)
        # Creating the stores and the study/parent is one critical section for the workers of this
        # machine; workers on other machines wait for the parent id instead.
        with file_lock(options.out / ".sweep-init.lock"):
            client = RetryingClient(MlflowClient(options.mlflow_uri))
            self.runs = SweepRuns(client, spec, options, self.worker)
            self.launcher = Launcher(spec, options, self.runs, hashed)
            self.controls = Controls(self.launcher, self._status, whatif)
            self.study, created = open_study(spec, options)
            if created:
                self.study.set_user_attr(PARENT_ATTR, self.runs.create_parent(hashed))
            else:
                self.study, self.runs.parent_run_id = wait_for_parent(self.study)
        self.parent_run_id = self.runs.parent_run_id

    def run(self) -> SweepOutcome:
        done, _ = counts(self.study)
        self.progress = SweepProgress(self.options.trials, enabled=self.options.progress, done=done)
        try:
            self._loop()
        finally:
            self.progress.close()
        outcome = SweepOutcome(self.parent_run_id, ran=list(self.ran))
        done, running = counts(self.study)
        if done >= self.options.trials and running == 0:
            # One worker writes the summary (reruns the finalists, writes the parent's artifacts):
            # the one that ran the highest-numbered finished trial. Every worker computes the same
            # answer from the shared study, on any machine. A process that ran no trial here (a
            # resume after that worker died) writes it if nobody has; same-machine resumes take turns
            # under a file lock.
            with file_lock(self.options.out / ".sweep-finish.lock"):
                if self.runs.summary_written():
                    outcome.summary_text = read_summary(self.runs.client, self.parent_run_id)
                elif summary_writer(self.study) in (self.worker, None) or not self.ran:
                    outcome.rows, outcome.recommendation = finish_sweep(self.controls, self._status)
        return outcome

    def _loop(self) -> None:
        """Run trials until the study holds ``options.trials`` finished ones."""
        failures = 0
        while True:
            with experimental_ok():
                self.optuna.storages.fail_stale_trials(self.study)
            self.runs.close_dead_children(failed_trials(self.study))
            done, running = counts(self.study)
            if done >= self.options.trials:
                break
            if done + running >= self.options.trials:
                self._status(f"waiting for {running} running trial(s)")
                time.sleep(self.options.heartbeat_s)
                continue
            # A failed program fails its trial (RuntimeError); refused input (ConfigError, e.g. the
            # metric never logged) stops the sweep.
            self.study.optimize(
                self.objective, n_trials=1, catch=(RuntimeError, OSError), gc_after_trial=True
            )
            last = last_trial_of(self.study, self.worker)
            if last is None or last.user_attrs.get("surplus"):
                continue
            failures = failures + 1 if last.state.name == "FAIL" else 0
            if failures >= 3:
                raise RuntimeError(
                    "three trials in a row failed; see the child runs' fp8track.error tags and "
                    f"{self.launcher.logs}"
                )

    def _status(self, text: str) -> None:
        if self.progress is not None:
            self.progress.status(text)

    def objective(self, trial: Any) -> float:
        TrialState = self.optuna.trial.TrialState
        ahead = [
            t
            for t in self.study.get_trials(
                deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
            )
            if t.number < trial.number
        ]
        trial.set_user_attr("worker", self.worker)
        if len(ahead) >= self.options.trials:
            trial.set_user_attr("surplus", True)
            raise Surplus(f"trial {trial.number} is beyond the sweep's {self.options.trials} trials")
        params = suggest(trial, self.spec)
        self.ran.append(trial.number)
        t0 = time.perf_counter()
        control = self.controls.control(params)
        self._status(f"trial {trial.number}: {params['recipe']} / {params['bf16_layers']}")
        name = f"trial-{trial.number:03d} {params['recipe']} {params['bf16_layers']}"
        out = self.controls.run(params, "trial", name, trial)
        trial.set_user_attr("mlflow_run_id", out.run_id)
        if out.values and math.isfinite(control.final):
            self.runs.client.log_metric(
                out.run_id, GAP_METRIC, signed_gap(out.final, control.final, self.spec.goal)
            )
        done, _ = counts(self.study)
        if self.progress is not None:
            self.progress.trial_finished(trial.number, out.final, time.perf_counter() - t0, done + 1)
        if out.state == "PRUNED":
            raise self.optuna.TrialPruned(f"pruned after {len(out.values)} values of {self.spec.metric}")
        if out.state == "FAIL":
            raise RuntimeError(out.error or "the program failed")
        return out.final


def run_sweep(spec: SweepSpec, options: SweepOptions) -> SweepOutcome:
    """Run (or resume, or join) the sweep until ``options.trials`` trials finished."""
    return _Sweep(spec, options).run()


__all__ = ["SweepOptions", "SweepOutcome", "run_sweep"]
