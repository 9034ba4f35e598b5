"""Run a sweep YAML with Optuna, without a W&B server, into MLflow parent/child runs.

* Sampler: ``grid`` -> :class:`optuna.samplers.GridSampler`, ``random`` -> ``RandomSampler``,
  ``bayes`` -> ``TPESampler``; ``early_terminate: hyperband`` -> ``HyperbandPruner`` with
  ``min_resource = min_iter``, ``reduction_factor = eta``, ``max_resource = max_iter`` or the
  trial's number of evaluations. Each evaluation's held-out gap is the intermediate value at step
  = evaluation index, exactly what W&B's hyperband counts (positions in the metric's history).
* Storage: an Optuna RDB (default ``sqlite:///<out>/optuna.db``) with heartbeats. Several
  ``fp8track sweep --storage <same URL>`` processes share one study (Optuna's distributed mode);
  each trial number runs in one process. A process killed mid-trial (SIGKILL) leaves its trial
  RUNNING until its heartbeat is older than the grace period; the next executor then marks it
  failed and :class:`optuna.storages.RetryHeartbeatStaleTrialCallback` queues it again with the
  same parameters; finished trials are never repeated.
* The sweep is done when ``trials`` trials are COMPLETE or PRUNED. A trial whose number comes
  after ``trials`` unfinished-or-finished others (two workers asked at once) is a *surplus* trial:
  it is failed at once, before training, with the user attribute ``surplus``.
* MLflow: one parent run per sweep (created by the process that created the study; its id is the
  study's user attribute ``mlflow_parent_run_id``) and one child run per trial
  (``tags.mlflow.parentRunId``). Child params: every sweep parameter (as written), ``n_bf16_layers``,
  ``n_fp8_layers``; metrics: see :func:`fp8track.examples.train.run_metrics`, plus the gap per
  evaluation; tags ``fp8track.sweep``, ``fp8track.trial``, ``fp8track.state``. The parent gets the
  control's numbers, the ``auto:K`` ranking tables, and at the end the summary table, the Pareto
  plot and the recommendation (:mod:`fp8track.sweep.summary`).
* ``wandb=True``: one W&B offline run per trial, grouped by the sweep name, the trial's parameters
  as config, ready for ``wandb sync``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import socket
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8track.errors import ConfigError, check_int
from fp8track.examples.train import GAP_METRIC, Evaluation, TrainConfig, control_run, probe_ranking, train
from fp8track.optional import require
from fp8track.sweep.progress import SweepProgress
from fp8track.sweep.spec import SweepSpec
from fp8track.sweep.summary import (
    Recommendation,
    TrialRow,
    format_text,
    pareto_figure,
    recommend,
    row_from_run,
    summary_table,
)
from fp8track.trackers.mlflow import RetryingClient
from fp8track.trial import JsonCache, file_lock

PARENT_ATTR = "mlflow_parent_run_id"
FINISHED_STATES = ("COMPLETE", "PRUNED")


@dataclass(frozen=True)
class SweepOptions:
    """How to run a sweep.

    Attributes:
        trials: COMPLETE or PRUNED trials the sweep needs (>= 1).
        out: folder for the default stores, run directories and the control/probe cache.
        tracking_uri: MLflow tracking URI (default ``sqlite:///<out>/mlflow.db``).
        storage: Optuna RDB URL (default ``sqlite:///<out>/optuna.db``).
        wandb: also write W&B offline runs (``<out>/wandb``).
        seed: sampler seed (grid: the same in every worker; random/bayes: plus the process id,
            so two workers do not propose the same sequence).
        progress: show the live display.
        tolerance_factor, tolerance_floor: the recommendation's tolerance
            (:func:`fp8track.sweep.summary.tolerance`).
        heartbeat_s, grace_s: Optuna heartbeat interval and the silence after which a RUNNING
            trial counts as dead (seconds).
        max_retry: how often a dead trial is queued again.
        threads: torch CPU threads for training.
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
    heartbeat_s: int = 5
    grace_s: int = 20
    max_retry: int = 2
    threads: int = 1

    def __post_init__(self) -> None:
        check_int("trials", self.trials, 1)
        check_int("heartbeat_s", self.heartbeat_s, 1)
        check_int("grace_s", self.grace_s, self.heartbeat_s + 1)
        check_int("max_retry", self.max_retry, 0)
        object.__setattr__(self, "out", Path(self.out).resolve())

    @property
    def mlflow_uri(self) -> str:
        return self.tracking_uri or f"sqlite:///{self.out / 'mlflow.db'}"

    @property
    def storage_url(self) -> str:
        return self.storage or f"sqlite:///{self.out / 'optuna.db'}"


@dataclass
class SweepOutcome:
    """What :func:`run_sweep` leaves: the parent run, every trial row, the recommendation
    (``None`` until every trial finished), and the trials this process ran."""

    parent_run_id: str
    rows: list[TrialRow] = field(default_factory=list)
    recommendation: Recommendation | None = None
    ran: list[int] = field(default_factory=list)


@contextlib.contextmanager
def _experimental_ok() -> Iterator[None]:
    """Optuna marks heartbeats and retries experimental (since 2.8/2.9); we rely on them knowingly."""
    optuna = require("optuna", "fp8track sweep")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        yield


class _Surplus(Exception):
    """The trial is beyond the sweep's budget (raised before any training)."""


def base_config(spec: SweepSpec) -> TrainConfig:
    """The :class:`TrainConfig` of the sweep's constant parameters (bad values raise here)."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in spec.constants.items() if k in fields})


def preflight(spec: SweepSpec, cfg: TrainConfig) -> None:
    """Resolve every ``bf16_layers`` value against the real model before any training: a term
    that matches nothing (``first:3`` on two blocks, ``auto:12`` on nine linears) fails here."""
    from fp8track.examples.gpt import GPT, GPTConfig
    from fp8track.execution.fallback import FallbackSpec, linear_names

    model = GPT(GPTConfig(n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head, block_size=cfg.block_size))
    p = spec.param("bf16_layers")
    values = () if p is None else ((p.value,) if p.kind == "constant" else p.values)
    for v in values:
        try:
            FallbackSpec.parse(str(v)).resolve(model, ranking=linear_names(model))
        except ConfigError as err:
            raise ConfigError(f"sweep parameter 'bf16_layers' value {v!r} does not fit the model: {err}") from None
    if cfg.plant_outlier:
        from fp8track.examples.train import plant_outlier

        plant_outlier(model, cfg.plant_outlier)


def _sampler(spec: SweepSpec, seed: int) -> Any:
    optuna = require("optuna", "fp8track sweep")
    if spec.method == "grid":
        space = {p.name: list(p.values) for p in spec.params if p.kind == "categorical"}
        return optuna.samplers.GridSampler(space, seed=seed)
    worker_seed = seed + os.getpid()
    if spec.method == "random":
        return optuna.samplers.RandomSampler(seed=worker_seed)
    return optuna.samplers.TPESampler(seed=worker_seed)


def _pruner(spec: SweepSpec, cfg: TrainConfig) -> Any:
    optuna = require("optuna", "fp8track sweep")
    if spec.hyperband is None:
        return optuna.pruners.NopPruner()
    evals = max(1, math.ceil(cfg.steps / cfg.eval_every)) if cfg.eval_every else 1
    return optuna.pruners.HyperbandPruner(
        min_resource=spec.hyperband.min_iter, max_resource=spec.hyperband.max_iter or evals,
        reduction_factor=spec.hyperband.eta,
    )


def _suggest(trial: Any, spec: SweepSpec) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for p in spec.params:
        if p.kind == "constant":
            params[p.name] = p.value
        elif p.kind == "categorical":
            params[p.name] = trial.suggest_categorical(p.name, list(p.values))
        elif p.kind == "int_uniform":
            params[p.name] = trial.suggest_int(p.name, int(p.low), int(p.high))
        else:
            params[p.name] = trial.suggest_float(p.name, p.low, p.high, log=p.kind == "log_uniform_values")
    return params


class _Sweep:
    """One executor process: the study, the MLflow runs and the trial objective."""

    def __init__(self, spec: SweepSpec, options: SweepOptions) -> None:
        optuna = require("optuna", "fp8track sweep")
        require("mlflow", "fp8track sweep's MLflow runs")
        from mlflow.tracking import MlflowClient

        self.spec, self.options, self.optuna = spec, options, optuna
        self.cfg = base_config(spec)
        preflight(spec, self.cfg)
        options.out.mkdir(parents=True, exist_ok=True)
        self.cache = JsonCache(options.out / "cache")
        self.runs_dir = options.out / "runs"
        # Creating the stores (SQLite tables) and the study/parent is one critical section for the
        # workers of this machine; workers on other machines wait for the parent id instead.
        with file_lock(options.out / ".sweep-init.lock"):
            # Several workers write one store; SQLite lets a writer wait 5 s, then "database is
            # locked": such calls are retried (a loaded machine can hold the lock longer).
            self.client = RetryingClient(MlflowClient(options.mlflow_uri))
            self.experiment_id = self._experiment()
            with _experimental_ok():
                storage = optuna.storages.RDBStorage(
                    options.storage_url, heartbeat_interval=options.heartbeat_s, grace_period=options.grace_s,
                    heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=options.max_retry),
                    # SQLite: several worker processes wait for the write lock instead of failing.
                    engine_kwargs={"connect_args": {"timeout": 60}} if options.storage_url.startswith("sqlite") else None,
                )
            direction = "minimize" if spec.goal == "minimize" else "maximize"
            sampler, pruner = _sampler(spec, options.seed), _pruner(spec, self.cfg)
            try:
                self.study = optuna.create_study(study_name=spec.name, storage=storage, direction=direction,
                                                 sampler=sampler, pruner=pruner)
                self.parent_run_id = self._create_parent()
                self.study.set_user_attr(PARENT_ATTR, self.parent_run_id)
            except optuna.exceptions.DuplicatedStudyError:
                self.study = optuna.load_study(study_name=spec.name, storage=storage, sampler=sampler, pruner=pruner)
                self.parent_run_id = self._wait_for_parent()
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self.progress: SweepProgress | None = None
        self.ran: list[int] = []
        self.controls: dict[str, dict[str, Any]] = {}

    # -- MLflow parent -----------------------------------------------------------------------------
    def _experiment(self) -> str:
        from mlflow.exceptions import MlflowException

        exp = self.client.get_experiment_by_name(self.spec.name)
        if exp is not None:
            return exp.experiment_id
        local = self.options.mlflow_uri.startswith("sqlite:")
        try:
            return self.client.create_experiment(
                self.spec.name, artifact_location=(self.options.out / "mlartifacts").as_uri() if local else None)
        except MlflowException:  # another worker created it first
            exp = self.client.get_experiment_by_name(self.spec.name)
            if exp is None:
                raise
            return exp.experiment_id

    def _create_parent(self) -> str:
        run = self.client.create_run(self.experiment_id, run_name=self.spec.name, tags={
            "fp8track.sweep": self.spec.name, "fp8track.role": "parent", "fp8track.method": self.spec.method})
        rid = run.info.run_id
        params = {"method": self.spec.method, "metric": self.spec.metric, "goal": self.spec.goal,
                  "trials": self.options.trials, "storage": self.options.storage_url,
                  "schema_checked": self.spec.schema_checked, "tolerance_factor": self.options.tolerance_factor,
                  "tolerance_floor": self.options.tolerance_floor}
        params.update({f"sweep.{p.name}": _param_text(p.value if p.kind == "constant" else p.values)
                       for p in self.spec.params})
        for k, v in params.items():
            self.client.log_param(rid, k, _param_text(v))
        self.client.log_dict(rid, dict(self.spec.raw), "sweep.yaml")
        return rid

    def _wait_for_parent(self, timeout_s: float = 300.0) -> str:
        # The study's creator is writing the parent run id right now (or did long ago).
        t0 = time.monotonic()
        while True:
            rid = self.study.user_attrs.get(PARENT_ATTR)
            if rid:
                return str(rid)
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"study {self.spec.name!r} has no {PARENT_ATTR} after {timeout_s:.0f} s; "
                                   "its creator died before writing it: delete the study or set the attribute")
            time.sleep(1.0)
            self.study = self.optuna.load_study(study_name=self.spec.name, storage=self.study._storage,
                                                sampler=self.study.sampler, pruner=self.study.pruner)

    # -- control and probe ---------------------------------------------------------------------------
    def control(self, cfg: TrainConfig) -> dict[str, Any]:
        key = repr(cfg.control_key())
        if key not in self.controls:
            self._status("BF16 control (cached after the first run)")
            result, cached = control_run(cfg, self.cache, self.runs_dir)
            self.controls[key] = result
            self.client.log_metric(self.parent_run_id, "control/spread", float(result["spread"]))
            self.client.log_metric(self.parent_run_id, "control/val_loss", float(list(result["val_loss"].values())[-1]))
            self.client.set_tag(self.parent_run_id, "fp8track.control_cached", str(cached).lower())
        return self.controls[key]

    def ranking(self, cfg: TrainConfig, recipe: str) -> dict[str, Any]:
        self._status(f"auto:K probe under {recipe}")
        probe, _ = probe_ranking(cfg, recipe, self.cache, self.runs_dir)
        name = "auto_ranking_" + "".join(c if c.isalnum() else "_" for c in recipe) + ".json"
        self.client.log_table(self.parent_run_id, _columns(probe["table"]), name)
        return probe

    # -- the loop ------------------------------------------------------------------------------------
    def counts(self) -> tuple[int, int]:
        """(COMPLETE + PRUNED, RUNNING) trials of the study."""
        states = [t.state.name for t in self.study.get_trials(deepcopy=False)]
        return sum(s in FINISHED_STATES for s in states), states.count("RUNNING")

    def run(self) -> SweepOutcome:
        optuna = self.optuna
        done, _ = self.counts()
        self.progress = SweepProgress(self.options.trials, enabled=self.options.progress, done=done)
        failures = 0
        try:
            while True:
                with _experimental_ok():
                    optuna.storages.fail_stale_trials(self.study)
                self.close_dead_children()
                done, running = self.counts()
                if done >= self.options.trials:
                    break
                if done + running >= self.options.trials:
                    self._status(f"waiting for {running} running trial(s)")
                    time.sleep(self.options.heartbeat_s)
                    continue
                self.study.optimize(self.objective, n_trials=1, catch=(Exception,), gc_after_trial=True)
                last = self._my_last_trial()
                if last is None or last.user_attrs.get("surplus"):
                    continue
                failures = failures + 1 if last.state.name == "FAIL" else 0
                if failures >= 3:
                    raise RuntimeError("three trials in a row failed; see the MLflow child runs' fp8track.error tags")
        finally:
            self.progress.close()
        outcome = SweepOutcome(self.parent_run_id, ran=list(self.ran))
        done, running = self.counts()
        if done >= self.options.trials and running == 0:
            outcome.rows, outcome.recommendation = self.write_summary()
        return outcome

    def _my_last_trial(self) -> Any:
        mine = [t for t in self.study.get_trials(deepcopy=False) if t.user_attrs.get("worker") == self.worker]
        return mine[-1] if mine else None

    def close_dead_children(self) -> None:
        """Mark FAILED the MLflow child run of every failed trial that is still RUNNING (its executor
        was killed; found by the trial tag, since it may die before noting the run id)."""
        failed = {str(t.number) for t in self.study.get_trials(deepcopy=False, states=(self.optuna.trial.TrialState.FAIL,))}
        if not failed:
            return
        running = self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.mlflow.parentRunId = '{self.parent_run_id}' and attributes.status = 'RUNNING'")
        for run in running:
            if run.data.tags.get("fp8track.trial") in failed:
                rid = run.info.run_id
                self.client.set_tag(rid, "fp8track.state", "FAIL")
                self.client.set_tag(rid, "fp8track.error", "executor died mid-trial (heartbeat went stale); retried")
                self.client.set_terminated(rid, "FAILED")

    def _status(self, text: str) -> None:
        if self.progress is not None:
            self.progress.status(text)

    # -- one trial -----------------------------------------------------------------------------------
    def objective(self, trial: Any) -> float:
        optuna = self.optuna
        TrialState = optuna.trial.TrialState
        ahead = [t for t in self.study.get_trials(deepcopy=False,
                                                  states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING))
                 if t.number < trial.number]
        trial.set_user_attr("worker", self.worker)
        if len(ahead) >= self.options.trials:
            trial.set_user_attr("surplus", True)
            raise _Surplus(f"trial {trial.number} is beyond the sweep's {self.options.trials} trials")
        params = _suggest(trial, self.spec)
        recipe, spec_text = str(params["recipe"]), str(params["bf16_layers"])
        fields = {f.name for f in dataclasses.fields(TrainConfig)}
        cfg = dataclasses.replace(self.cfg, **{k: v for k, v in params.items() if k in fields})
        frozen = next(t for t in self.study.get_trials(deepcopy=False) if t.number == trial.number)
        with _experimental_ok():
            retry_of = optuna.storages.RetryHeartbeatStaleTrialCallback.retried_trial_number(frozen)
        self.ran.append(trial.number)
        t0 = time.perf_counter()
        # The child run first: whatever fails from here on (the control included) is tagged on it.
        rid = self._create_child(trial.number, params, retry_of)
        trial.set_user_attr("mlflow_run_id", rid)
        loggers: list[Any] = []
        try:
            control = self.control(cfg)
            loggers = self._wandb_logger(trial.number, params) if self.options.wandb else []
            ranking = None
            from fp8track.execution.fallback import FallbackSpec

            if FallbackSpec.parse(spec_text).needs_ranking:
                probe = self.ranking(cfg, recipe)
                ranking = probe["ranking"]
                self.client.log_table(rid, _columns(probe["table"]), "auto_ranking.json")
            self._status(f"trial {trial.number}: {recipe} / {spec_text}")

            def on_eval(ev: Evaluation) -> bool:
                if not math.isfinite(ev.gap):
                    return False
                self.client.log_metric(rid, GAP_METRIC, ev.gap, step=ev.step)
                trial.report(ev.gap, ev.index)
                return bool(trial.should_prune())

            result = train(cfg, recipe, spec_text, log_dir=self.runs_dir, ranking=ranking, control=control,
                           on_eval=on_eval, loggers=loggers, run_name=f"trial-{trial.number}")
        except Exception as err:
            self.client.set_tag(rid, "fp8track.state", "FAIL")
            self.client.set_tag(rid, "fp8track.error", f"{type(err).__name__}: {err}"[:5000])
            self.client.set_terminated(rid, "FAILED")
            raise
        finally:
            for lg in loggers:
                lg.experiment.finish()
        self._log_result(rid, result, ranking)
        state = "PRUNED" if result.pruned else "COMPLETE"
        self.client.set_tag(rid, "fp8track.state", state)
        self.client.set_terminated(rid, "FINISHED")
        done, _ = self.counts()
        if self.progress is not None:
            self.progress.trial_finished(trial.number, result.final_gap, time.perf_counter() - t0, done + 1)
        if result.pruned:
            raise optuna.TrialPruned(f"pruned after {len(result.evals)} evaluations")
        if not math.isfinite(result.final_gap):
            raise RuntimeError("the trial produced no held-out gap")
        return result.final_gap

    def _create_child(self, number: int, params: Mapping[str, Any], retry_of: int | None) -> str:
        from mlflow.entities import Param, RunTag

        tags = {"fp8track.sweep": self.spec.name, "fp8track.trial": str(number), "fp8track.role": "trial",
                "fp8track.state": "RUNNING", "fp8track.worker": self.worker}
        if retry_of is not None:
            tags["fp8track.retry_of"] = str(retry_of)
        name = f"trial-{number:03d} {params['recipe']} {params['bf16_layers']}"
        run = self.client.create_run(self.experiment_id, run_name=name[:250],
                                     tags={"mlflow.parentRunId": self.parent_run_id})
        # Parameters first, then the tags that make it a trial: a run tagged as a trial always has its
        # parameters, even when the process dies in between.
        rid = run.info.run_id
        self.client.log_batch(rid, params=[Param(k, _param_text(v)) for k, v in params.items()], synchronous=True)
        self.client.log_batch(rid, tags=[RunTag(k, v) for k, v in tags.items()], synchronous=True)
        return rid

    def _log_result(self, rid: str, result: Any, ranking: list[str] | None) -> None:
        from mlflow.entities import Metric, Param

        now = int(time.time() * 1000)
        step = result.evals[-1].step if result.evals else 0
        # The final gap was logged per evaluation already (the run's value is the last one).
        metrics = [Metric(k, float(v), now, step) for k, v in result.metrics.items() if k != GAP_METRIC]
        params = [Param("n_bf16_layers", str(len(result.bf16_layers))), Param("n_fp8_layers", str(len(result.fp8_layers)))]
        self.client.log_batch(rid, metrics=[m for m in metrics if math.isfinite(m.value)], params=params, synchronous=True)
        if ranking is not None:
            self.client.set_tag(rid, "fp8track.bf16_layer_names", ",".join(result.bf16_layers)[:5000])

    def _wandb_logger(self, number: int, params: Mapping[str, Any]) -> list[Any]:
        from lightning.pytorch.loggers import WandbLogger

        # mode="offline" goes to wandb.init for this run only (never WANDB_MODE for the process).
        return [WandbLogger(project=str(self.spec.raw.get("project") or "fp8track-sweep"), group=self.spec.name,
                            name=f"trial-{number:03d}", job_type="trial", config=dict(params), mode="offline",
                            save_dir=str(self.options.out), reinit="finish_previous")]

    # -- summary -------------------------------------------------------------------------------------
    def write_summary(self) -> tuple[list[TrialRow], Recommendation]:
        rows, rec = read_summary(self.client, self.experiment_id, self.parent_run_id,
                                 self.options.tolerance_factor, self.options.tolerance_floor)
        rid = self.parent_run_id
        self.client.log_table(rid, summary_table(rows), "sweep_summary.json")
        self.client.log_figure(rid, pareto_figure(rows, rec), "pareto.png")
        self.client.log_dict(rid, rec.to_dict(), "recommendation.json")
        self.client.log_text(rid, format_text(rows, rec), "summary.txt")
        self.client.log_metric(rid, "recommendation/tolerance", rec.tolerance)
        if rec.trial is not None:
            self.client.set_tag(rid, "fp8track.recommendation.recipe", rec.trial.recipe)
            self.client.set_tag(rid, "fp8track.recommendation.bf16_layers", rec.trial.bf16_layers)
            self.client.set_tag(rid, "fp8track.recommendation.trial", str(rec.trial.trial))
            self.client.log_metric(rid, "recommendation/gap", rec.trial.gap)
            self.client.log_metric(rid, "recommendation/n_bf16_layers", rec.trial.n_bf16)
        self.client.set_tag(rid, "fp8track.recommendation", rec.reason[:5000])
        self.client.set_terminated(rid, "FINISHED")
        return rows, rec


def read_summary(client: Any, experiment_id: str, parent_run_id: str, factor: float = 1.0,
                 floor: float = 0.01) -> tuple[list[TrialRow], Recommendation]:
    """Every child run of the parent as a :class:`TrialRow`, and the recommendation."""
    runs = client.search_runs([experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'",
                              max_results=50000)
    rows = sorted((row_from_run(r) for r in runs), key=lambda r: r.trial)
    parent = client.get_run(parent_run_id)
    spread = float(parent.data.metrics.get("control/spread", 0.0))
    return rows, recommend(rows, spread, factor, floor)


def find_parent(client: Any, name: str) -> tuple[str, str]:
    """``(experiment_id, parent_run_id)`` of the sweep ``name`` in an MLflow store."""
    exp = client.get_experiment_by_name(name)
    if exp is None:
        raise ConfigError(f"no MLflow experiment {name!r} at this tracking URI; run the sweep first")
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`fp8track.role` = 'parent' and "
                              f"tags.`fp8track.sweep` = '{name}'", order_by=["attributes.start_time DESC"])
    if not runs:
        raise ConfigError(f"experiment {name!r} has no sweep parent run")
    return exp.experiment_id, runs[0].info.run_id


def _param_text(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return ",".join(str(x) for x in v)
    return str(v).lower() if isinstance(v, bool) else str(v)


def _columns(rows: list[Mapping[str, Any]]) -> dict[str, list[Any]]:
    keys = list(rows[0]) if rows else []
    return {k: [r.get(k) for r in rows] for k in keys}


def run_sweep(spec: SweepSpec, options: SweepOptions) -> SweepOutcome:
    """Run (or resume, or join) the sweep until ``options.trials`` trials finished."""
    import torch

    torch.set_num_threads(options.threads)
    return _Sweep(spec, options).run()


__all__ = ["SweepOptions", "SweepOutcome", "run_sweep", "read_summary", "find_parent", "base_config", "preflight"]
