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
* **Budget**: distinct configurations; a re-proposed one runs nothing and spends nothing
  (:mod:`~fp8track.sweep.sampling`); the budget is at most the search space's size.
* **Failures**: a failed program fails its trial (its reason in the trial's ``error`` attribute,
  the child run's ``fp8track.error`` tag and the summary); three in a row stop the sweep
  (:class:`TrialsFailing`); refused input (the metric never logged, a control the trials refuse)
  stops it at once. Optuna's own log lines (a traceback per failed trial) are silenced: the
  progress line and the summary say it.
* **Interrupt** (Ctrl-C, or SIGTERM through :func:`signals_interrupt`): the running program is
  stopped (:mod:`~fp8track.sweep.runner`), its run KILLED, this worker's other open runs and the
  parent (unless another worker still runs trials) KILLED, and the ``KeyboardInterrupt`` goes on to
  the caller; the same command resumes the sweep (the parent RUNNING again). A stopping error
  leaves the parent FAILED the same way.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from fp8track.errors import ConfigError
from fp8track.optional import require
from fp8track.sweep.command import program_hash
from fp8track.sweep.controls import Controls, control_whatif
from fp8track.sweep.finish import finish_sweep, read_summary
from fp8track.sweep.launch import Launcher
from fp8track.sweep.mlflow_runs import GAP_METRIC, SweepRuns
from fp8track.sweep.options import SweepOptions
from fp8track.sweep.progress import SweepProgress
from fp8track.sweep.sampling import (
    DUPLICATE_ATTR,
    PARENT_ATTR,
    SPACE_LIMIT,
    Surplus,
    counts,
    experimental_ok,
    failed,
    failed_trials,
    is_duplicate,
    last_trial_of,
    open_study,
    space_size,
    suggest,
    summary_writer,
    trial_seed,
    twin_of,
    unevaluated_point,
    wait_for_parent,
)
from fp8track.sweep.spec import SweepSpec
from fp8track.sweep.summary import Recommendation, TrialRow, signed_gap
from fp8track.trackers.mlflow import RetryingClient
from fp8track.trial import file_lock


class TrialsFailing(ConfigError):
    """Three trials in a row failed: the program fails whatever the sampler proposes."""


class Duplicate(RuntimeError):
    """The trial re-proposed the parameters of a trial still running elsewhere."""


class SweepInterrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP reached the sweep (:func:`signals_interrupt`); ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP raise :class:`SweepInterrupted` (a ``KeyboardInterrupt``) in the main
    thread while the block runs, as Ctrl-C does: the sweep then stops its running program and
    closes its runs instead of dying with the program left running in its own process group."""

    def interrupt(signum: int, _frame: Any) -> None:
        raise SweepInterrupted(signum)

    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def quiet_optuna() -> Iterator[None]:
    """Optuna logs every failed trial with its traceback; the sweep reports failures itself."""
    log = logging.getLogger("optuna")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


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
        size = space_size(spec)
        self.budget = options.trials if size is None else min(options.trials, size)
        self.exhausted = False  # every point of a finite space evaluated or taken
        self.current = -1  # the trial the last optimize() call ran
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
                self.runs.reopen_parent()
        self.parent_run_id = self.runs.parent_run_id

    def run(self) -> SweepOutcome:
        try:
            with quiet_optuna():
                return self._run()
        except KeyboardInterrupt:
            self._close("the sweep was interrupted", "KILLED")
            raise
        except ConfigError as err:
            self._close(f"the sweep stopped: {err}", "FAILED")
            raise

    def _close(self, reason: str, status: str) -> None:
        """This worker's runs an interrupt or a stopping error left open, KILLED; the parent
        ``status`` (with ``reason``) unless another worker still runs a trial (Optuna failed ours on
        the way out)."""
        with contextlib.suppress(Exception):
            self.runs.close_running(self.worker, reason)
            if counts(self.study)[1] == 0:
                self.runs.client.set_tag(self.parent_run_id, "fp8track.error", reason[:5000])
                self.runs.client.set_terminated(self.parent_run_id, status)

    def _run(self) -> SweepOutcome:
        done, _ = counts(self.study)
        self.progress = SweepProgress(self.budget, enabled=self.options.progress, done=done)
        try:
            self._loop()
        finally:
            self.progress.close()
        outcome = SweepOutcome(self.parent_run_id, ran=list(self.ran))
        done, running = counts(self.study)
        if (done >= self.budget or self.exhausted) and running == 0:
            # One worker writes the summary (reruns the finalists, writes the parent's artifacts):
            # the one that ran the highest-numbered finished trial. Every worker computes the same
            # answer from the shared study, on any machine. A process that ran no trial here (a
            # resume after that worker died) writes it if nobody has; same-machine resumes take turns
            # under a file lock.
            with file_lock(self.options.out / ".sweep-finish.lock"):
                if self.runs.summary_written():
                    outcome.summary_text = read_summary(self.runs.client, self.parent_run_id)
                elif summary_writer(self.study) in (self.worker, None) or not self.ran:
                    outcome.rows, outcome.recommendation = finish_sweep(
                        self.controls, self._status, failed(self.study)
                    )
        return outcome

    def _loop(self) -> None:
        """Run trials until the study holds ``budget`` finished ones (or the space is exhausted)."""
        failures = streak = 0
        while True:
            with experimental_ok():
                self.optuna.storages.fail_stale_trials(self.study)
            self.runs.close_dead_children(failed_trials(self.study))
            done, running = counts(self.study)
            if done >= self.budget or self.exhausted:
                break
            if done + running >= self.budget:
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
            if is_duplicate(last):
                streak += 1
                # A sampler that keeps re-proposing points of a space too large to enumerate.
                self.exhausted = self.exhausted or streak >= 100
                continue
            streak = 0
            failures = failures + 1 if last.state.name == "FAIL" else 0
            if failures >= 3:
                raise TrialsFailing(
                    f"three trials in a row failed (the last, trial {last.number}: "
                    f"{last.user_attrs.get('error', 'see its run')}); see the child runs' fp8track.error "
                    f"tags and the programs' logs in {self.launcher.logs}"
                )

    def _status(self, text: str) -> None:
        if self.progress is not None:
            self.progress.status(text)

    def objective(self, trial: Any) -> float:
        """One trial; its failure's reason kept in the trial's ``error`` attribute (the summary)."""
        try:
            return self._objective(trial)
        except self.optuna.TrialPruned:
            raise
        except Exception as err:
            trial.set_user_attr("error", " ".join(str(err).split())[:500])
            raise

    def _objective(self, trial: Any) -> float:
        TrialState = self.optuna.trial.TrialState
        ahead = [
            t
            for t in self.study.get_trials(
                deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
            )
            if t.number < trial.number and not is_duplicate(t)
        ]
        trial.set_user_attr("worker", self.worker)
        self.current = trial.number
        if len(ahead) >= self.budget:
            trial.set_user_attr("surplus", True)
            raise Surplus(f"trial {trial.number} is beyond the sweep's {self.budget} trials")
        params = suggest(trial, self.spec)
        twin = twin_of(self.study, trial)
        if twin is not None:
            return self._duplicate(trial, twin)
        self.ran.append(trial.number)
        t0 = time.perf_counter()
        control = self.controls.control(params)
        self._status(f"trial {trial.number}: {params['recipe']} / {params['bf16_layers']}")
        name = f"trial-{trial.number:03d} {params['recipe']} {params['bf16_layers']}"
        out = self.controls.run(params, "trial", name, trial)
        trial.set_user_attr("mlflow_run_id", out.run_id)
        gap = math.nan
        if out.values and math.isfinite(control.final):
            gap = signed_gap(out.final, control.final, self.spec.goal)
            self.runs.client.log_metric(out.run_id, GAP_METRIC, gap)
        done, _ = counts(self.study)
        if self.progress is not None:
            finished = out.state != "FAIL"
            self.progress.trial_finished(trial.number, gap, time.perf_counter() - t0, done + finished)
        if out.state == "PRUNED":
            raise self.optuna.TrialPruned(f"pruned after {len(out.values)} values of {self.spec.metric}")
        if out.state == "FAIL":
            raise RuntimeError(out.error or "the program failed")
        return out.final

    def _duplicate(self, trial: Any, twin: Any) -> float:
        """Close a trial that re-proposed ``twin``'s parameters without running anything (module
        docstring of :mod:`~fp8track.sweep.sampling`), and queue a point not yet evaluated."""
        trial.set_user_attr(DUPLICATE_ATTR, twin.number)
        point = unevaluated_point(self.study, self.spec, trial_seed(self.options.seed, trial.number))
        if point is not None:
            self.study.enqueue_trial(point, skip_if_exists=True)
        else:
            size = space_size(self.spec)
            self.exhausted = size is not None and size <= SPACE_LIMIT
        self._status(f"trial {trial.number} re-proposed trial {twin.number}'s configuration: not run again")
        if twin.state.name == "COMPLETE":
            return float(twin.value)
        if twin.state.name == "PRUNED":
            raise self.optuna.TrialPruned(f"same configuration as pruned trial {twin.number}")
        if twin.state.name == "FAIL":
            raise Duplicate(f"same configuration as trial {twin.number}, which the program refused")
        raise Duplicate(f"same configuration as trial {twin.number}, running elsewhere")


def run_sweep(spec: SweepSpec, options: SweepOptions) -> SweepOutcome:
    """Run (or resume, or join) the sweep until ``options.trials`` trials finished."""
    return _Sweep(spec, options).run()


__all__ = ["SweepOptions", "SweepOutcome", "TrialsFailing", "SweepInterrupted", "signals_interrupt",
           "run_sweep"]
