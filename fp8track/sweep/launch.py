"""Launching the sweep's program: one run as an MLflow child run, or the cached result of the same
parameters reused.

* **Program**: each run is the YAML's ``command`` expanded as ``wandb agent`` does
  (:mod:`fp8track.sweep.command`) and started by :mod:`fp8track.sweep.runner` with
  ``MLFLOW_RUN_ID`` / ``MLFLOW_TRACKING_URI`` naming its child run and ``WANDB_SWEEP_PARAM_PATH``
  its parameters; the caller adds the control and ranking variables
  (:meth:`fp8track.sweep.controls.Controls.run`). The executor imports no model.
* **Metric**: the YAML's ``metric.name`` as the program logs it in its run, read while it runs:
  the n-th value is hyperband's iteration n. A program that finishes without logging the metric
  stops the sweep with one :class:`~fp8track.sweep.options.MetricNotLogged`.
* **Refused input**: a program that stops on fp8track's ``ConfigError`` (the last line of its
  traceback, :func:`refusal_in`) about what every run shares (any refusal in the BF16 control;
  in another run, one naming the control's run, e.g. a control without a training loss for the
  monitor's ``baseline``) stops the sweep with one :class:`~fp8track.sweep.options.ProgramRefused`
  and the control leaves the cache; any other refusal fails that run only (a parameter value this
  model refuses), its message in the run's ``fp8track.error`` tag and the summary.
* **Time limit**: a run past ``trial_timeout_s`` is stopped (SIGTERM, SIGKILL) and FAILED; an
  interrupted sweep (``KeyboardInterrupt``) stops its running program and marks its run KILLED.
* **Reuse**: every finished or pruned run is cached by (program, parameters, store); a trial whose
  parameters were already run gets a child run copying that result (tag ``fp8track.reused_from``)
  and trains nothing (an earlier pruned run is replayed to the pruner: pruned again, or run).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fp8track.errors import ConfigError
from fp8track.sweep.command import expand
from fp8track.sweep.mlflow_runs import SweepRuns, param_text
from fp8track.sweep.options import MetricNotLogged, ProgramRefused, RunOutcome, SweepOptions
from fp8track.sweep.runner import ProgramResult, metric_values, run_program
from fp8track.sweep.sampling import FINISHED_STATES, REFUSED
from fp8track.sweep.spec import SweepSpec
from fp8track.trial import (
    CONTROL_ENV,
    PARAM_PATH_ENV,
    RANKING_ENV,
    RUN_ID_ENV,
    TRACKING_URI_ENV,
    WHATIF_ENV,
    JsonCache,
    cache_key,
    file_lock,
)

ExtraEnv = Callable[[], Mapping[str, str]]
"""Variables a run's environment adds, computed only when the program is really started (they may
train the control and the ``auto:K`` run first)."""


def _no_env() -> Mapping[str, str]:
    return {}


_ERROR_LINE = re.compile(r"^((?:fp8track\.)[\w.]+): (.+)$")
CONTROL_LOSS_FIX = (
    "fix: the program must log its training loss into its MLflow run: fp8track.Monitor does so inside "
    "the run (mlflow.start_run(), which picks up the sweep's MLFLOW_RUN_ID; trackers='auto', the "
    "default), FP8Monitor through trial_settings().mlflow_logger(); or mlflow.log_metric('loss', ...)"
)


def refusal_in(log: Path | None) -> str | None:
    """The message of the fp8track ``ConfigError`` (or subclass) a program's traceback ended on,
    read from its log (the last such line: under ``torchrun`` each rank prints its own); ``None``
    when it failed otherwise."""
    if log is None or not log.is_file():
        return None
    for line in reversed(log.read_text(errors="replace").splitlines()[-400:]):
        m = _ERROR_LINE.match(line.strip())
        if m is None:
            continue
        module, _, name = m.group(1).rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError):
            continue
        if isinstance(cls, type) and issubclass(cls, ConfigError):
            return m.group(2).strip()
    return None


class Launcher:
    """Runs the sweep's program for given parameters (module docstring).

    Args:
        spec, options: the sweep.
        runs: its MLflow runs.
        program_hash: the program's hash (part of every cache key).
    """

    def __init__(self, spec: SweepSpec, options: SweepOptions, runs: SweepRuns, program_hash: str) -> None:
        self.spec, self.options, self.runs, self.program_hash = spec, options, runs, program_hash
        self.cache = JsonCache(options.out / "cache")
        self.logs = options.out / "logs"

    def execute(
        self, params: Mapping[str, Any], role: str, name: str, trial: Any = None,
        whatif: tuple[str, ...] = (), extra_env: ExtraEnv = _no_env,
    ) -> RunOutcome:
        """Run the program with ``params`` as a child run, or reuse the cached result of the same
        parameters (a trial then gets a child run copying it). ``whatif``: what-if variants its
        monitor records (``FP8TRACK_SWEEP_WHATIF``); part of the cache key, so a run recorded
        without them is not taken for one with them."""
        key: dict[str, Any] = {"program": self.program_hash,
                               "params": {k: param_text(v) for k, v in params.items()},
                               "store": self.options.mlflow_uri}
        if whatif:
            key["whatif"] = list(whatif)
        lock = self.cache.path("run", key).with_suffix(".lock")
        self.cache.root.mkdir(parents=True, exist_ok=True)
        with file_lock(lock):
            hit = self.cache.get("run", key)
            if hit is not None and self.runs.exists(hit["run_id"]):
                cached = RunOutcome(
                    hit["run_id"],
                    hit.get("state", "COMPLETE"),
                    [float(v) for v in hit["values"]],
                    float(hit["seconds"]),
                )
                if role != "trial":
                    if cached.state == "COMPLETE":
                        return cached
                else:
                    # The pruner sees the earlier values again; a run that was pruned before and is
                    # not pruned now has to train further, so it runs.
                    pruned = self._replay(cached.values, trial)
                    if pruned or cached.state == "COMPLETE":
                        return self.runs.copy(cached, params, role, name, trial, pruned, self.logs)
            out = self._launch(params, role, name, trial, whatif, extra_env)
            if out.state in FINISHED_STATES:
                self.cache.put(
                    "run",
                    key,
                    {"run_id": out.run_id, "values": out.values, "seconds": out.seconds, "state": out.state},
                )
            return out

    def forget(self, run_id: str) -> None:
        """Drop every cached result of the run ``run_id`` (a control the trials refused)."""
        for p in self.cache.root.glob("run-*.json"):
            with contextlib.suppress(OSError, ValueError):
                if json.loads(p.read_text()).get("run_id") == run_id:
                    p.unlink()

    @staticmethod
    def _replay(values: list[float], trial: Any) -> bool:
        """Report ``values`` to the trial's pruner in order; True as soon as it prunes."""
        for i, v in enumerate(values):
            trial.report(v, i)
            if trial.should_prune():
                return True
        return False

    def _env(self, params: Mapping[str, Any], whatif: tuple[str, ...], extra_env: ExtraEnv) -> dict[str, str]:
        """The program's environment, all but ``MLFLOW_RUN_ID``; ``extra_env`` may train the control
        and the ``auto:K`` run first."""
        import yaml

        env = dict(os.environ)
        env.update({TRACKING_URI_ENV: self.options.mlflow_uri,
                    "OMP_NUM_THREADS": str(self.options.threads), "PYTHONUNBUFFERED": "1"})
        for k in (CONTROL_ENV, RANKING_ENV, WHATIF_ENV, "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME"):
            env.pop(k, None)
        if whatif:
            env[WHATIF_ENV] = ",".join(whatif)
        env["MLFLOW_EXPERIMENT_ID"] = self.runs.experiment_id
        pfile = self.logs / f"params-{cache_key({k: param_text(v) for k, v in params.items()})}.yaml"
        pfile.parent.mkdir(parents=True, exist_ok=True)
        pfile.write_text(yaml.safe_dump({"wandb_version": 1, **{k: {"value": v} for k, v in params.items()}}))
        env[PARAM_PATH_ENV] = str(pfile)
        env.update(extra_env())
        if self.options.wandb:
            env.update({"WANDB_MODE": "offline", "WANDB_DIR": str(self.options.out / "wandb"),
                        "WANDB_RUN_GROUP": self.spec.name})
            (self.options.out / "wandb").mkdir(parents=True, exist_ok=True)
        return env

    def _launch(
        self, params: Mapping[str, Any], role: str, name: str, trial: Any, whatif: tuple[str, ...],
        extra_env: ExtraEnv,
    ) -> RunOutcome:
        # The environment first (it may train the control and the auto:K run), then this run's child.
        env = self._env(params, whatif, extra_env)
        rid = self.runs.child(params, role, name, trial)
        env[RUN_ID_ENV] = rid
        argv = expand(self.spec.command, self.spec.program, params, json_file=self.logs / f"{rid}.args.json",
                      env=env)
        client = self.runs.client
        client.set_tag(rid, "fp8track.command", " ".join(argv)[:8000])

        def on_value(i: int, v: float) -> bool:
            if trial is None or not math.isfinite(v):
                return False
            trial.report(v, i)
            return bool(trial.should_prune())

        try:
            res = run_program(
                argv,
                env,
                client,
                rid,
                self.spec.metric,
                on_value,
                log=self.logs / f"{rid}.log",
                cwd=self.options.cwd,
                poll_s=self.options.poll_s,
                grace_s=self.options.kill_grace_s,
                timeout_s=self.options.trial_timeout_s,
            )
        except KeyboardInterrupt:  # the program was stopped on the way out (runner)
            with contextlib.suppress(Exception):
                client.set_tag(rid, "fp8track.error", "the sweep was interrupted while this run trained")
                self.runs.finish(rid, "KILLED", "KILLED", name=f"{name} [interrupted]")
            raise
        with contextlib.suppress(Exception):
            client.log_artifact(rid, str(res.log))
        if res.pruned:
            self.runs.finish(rid, "PRUNED", "KILLED", name=f"{name} [pruned]")
            return RunOutcome(rid, "PRUNED", res.values, res.seconds)
        if res.timed_out or res.returncode != 0:
            return self._failed(rid, role, name, res, env.get(CONTROL_ENV, ""))
        values = res.values or metric_values(client, rid, self.spec.metric)
        if not values:
            logged = sorted(client.get_run(rid).data.metrics)
            self.runs.finish(rid, "FAIL", "FAILED")
            raise MetricNotLogged(
                f"the program {self.spec.program!r} finished without logging the sweep's metric "
                f"{self.spec.metric!r} into its MLflow run; it logged: {', '.join(logged[:20]) or 'nothing'} "
                "(set metric.name to one of these, or log it through trial_settings().mlflow_logger())")
        self.runs.finish(rid, "COMPLETE", "FINISHED", name=name)  # a program may rename its run
        return RunOutcome(rid, "COMPLETE", values, res.seconds)

    def _failed(self, rid: str, role: str, name: str, res: ProgramResult, control: str) -> RunOutcome:
        """Close a run whose program failed or timed out; raise :class:`ProgramRefused` when its
        refusal would refuse every run (module docstring)."""
        refused = None if res.timed_out else refusal_in(res.log)
        if res.timed_out:
            err = f"timed out after {self.options.trial_timeout_s:g} s (--trial-timeout): stopped"
        elif refused is not None:
            err = f"{REFUSED}{refused}"
        else:
            err = f"exit status {res.returncode}: {res.tail(8)}"
        self.runs.client.set_tag(rid, "fp8track.error", err[-5000:])
        self.runs.finish(rid, "FAIL", "FAILED", name=name)
        if refused is not None:
            if role == "control":
                raise ProgramRefused(f"the BF16 control run {name!r} of {self.spec.program!r} {err}")
            if control and control in refused:
                self.forget(control.removeprefix("mlflow:"))
                fix = f"; {CONTROL_LOSS_FIX}" if "loss metrics" in refused else ""
                raise ProgramRefused(
                    f"the {role} run {name!r} refused the sweep's BF16 control {control}: {refused}{fix} "
                    "(the control left the cache: the next sweep trains it again)"
                )
        return RunOutcome(rid, "FAIL", res.values, res.seconds, error=err)


__all__ = ["Launcher", "ExtraEnv", "refusal_in", "CONTROL_LOSS_FIX"]
