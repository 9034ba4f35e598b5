"""Run a sweep YAML with Optuna, without a W&B server: the YAML's program, one subprocess per trial,
logging into MLflow parent/child runs.

* **Program**: each run is the YAML's ``command`` expanded as ``wandb agent`` does
  (:mod:`fp8track.sweep.command`) and started by :mod:`fp8track.sweep.runner` with
  ``MLFLOW_RUN_ID`` / ``MLFLOW_TRACKING_URI`` naming its child run, ``WANDB_SWEEP_PARAM_PATH`` its
  parameters, ``FP8TRACK_SWEEP_CONTROL`` the control run of its seed (``mlflow:<id>``, the
  monitor's baseline) and, for ``auto:K``, ``FP8TRACK_SWEEP_RANKING``; the program reads them with
  :func:`fp8track.trial.trial_settings`. The executor imports no model.
* **Metric**: the YAML's ``metric.name`` as the program logs it in its run, read while it runs:
  the n-th value is hyperband's iteration n (W&B counts positions in the metric's history). The
  run's last value is its result; ``goal`` sets the study's direction. A program that finishes
  without logging the metric stops the sweep with one :class:`~fp8track.errors.ConfigError`.
* **Control**: the same program with ``recipe=bf16, bf16_layers=none`` for each seed it is needed
  at (the trials' seed, and ``control_seeds`` seeds from it for the finalists); cached by the hash
  of the program and command, its other parameters and the seed (:class:`~fp8track.trial.JsonCache`
  in ``<out>/cache``), so a second sweep of the same program trains no control.
* **auto:K**: the ranking comes from the monitor's statistics of the same recipe with every layer
  in FP8 (that run is itself the ``bf16_layers=none`` trial, cached like any run),
  :func:`fp8track.analysis.ranking.rank_layers`. With ``auto_from="whatif"`` no such run is
  trained: the BF16 control of each seed is recorded with the what-if rows of the sweep's recipes
  (``FP8TRACK_SWEEP_WHATIF``, the program's monitor ``whatif``) and the ranking is
  ``rank_layers`` of the trial recipe's what-if rows alone (``variant=``), for hardware that cannot
  run the recipe (NVFP4 before Blackwell).
* **Reuse**: every finished or pruned run is cached by (program, parameters, store); a trial whose
  parameters were already run gets a child run copying that result (tag ``fp8track.reused_from``)
  and trains nothing (an earlier pruned run is replayed to the pruner: pruned again, or run).
* **Sampler**: ``grid`` -> ``GridSampler``, ``random`` -> ``RandomSampler``, ``bayes`` ->
  ``TPESampler``, re-seeded for every trial from ``(seed, trial number)``: one worker with the same
  YAML and seed proposes the same trials; several workers share the study's history in the storage
  (no process id in any seed). ``early_terminate: hyperband`` -> ``HyperbandPruner``
  (``min_resource = min_iter``, ``reduction_factor = eta``, ``max_resource = max_iter`` or "auto").
* **Pruning** stops the subprocess (SIGTERM, SIGKILL after ``kill_grace_s``) and marks its run
  KILLED with tag ``fp8track.state = PRUNED`` and the run name suffix ``[pruned]`` (MLflow has no
  PRUNED status; the UI shows KILLED).
* **Storage**: an Optuna RDB (default ``sqlite:///<out>/optuna.db``; PostgreSQL for many machines)
  with heartbeats; several ``fp8track sweep --storage <same URL>`` processes share one study; a
  killed worker's trial is failed after ``grace_s`` and retried with the same parameters. Trials
  beyond the budget (two workers asked at once) are failed before running, user attribute
  ``surplus``.
* **Finish**: the last worker reruns the finalists on the control's seeds and writes the summary
  (:mod:`fp8track.sweep.summary`) to the parent: ``sweep_summary.json``, ``pareto.png``,
  ``recommendation.json``, ``summary.txt`` and ``fp8track.recommendation.*`` tags.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8track.errors import ConfigError, check_int, invalid_choice
from fp8track.optional import require
from fp8track.sweep.command import expand, program_hash
from fp8track.sweep.progress import SweepProgress
from fp8track.sweep.runner import metric_values, run_program
from fp8track.sweep.spec import Param, SweepSpec
from fp8track.sweep.summary import (
    Recommendation,
    TrialRow,
    format_text,
    judge,
    pareto_figure,
    pick_finalists,
    recommend,
    signed_gap,
    spread,
    summary_table,
    tolerance,
)
from fp8track.trackers.mlflow import RetryingClient
from fp8track.trial import (
    AUTO_FROM,
    CONTROL_ENV,
    FLOP_SHARE_METRIC,
    LAYERS_ARTIFACT,
    PARAM_PATH_ENV,
    RANKING_ENV,
    RUN_ID_ENV,
    TRACKING_URI_ENV,
    WHATIF_ENV,
    JsonCache,
    cache_key,
    file_lock,
    ranking_table,
    whatif_variant,
)

PARENT_ATTR = "mlflow_parent_run_id"
FINISHED_STATES = ("COMPLETE", "PRUNED")
GAP_METRIC = "gap_vs_bf16"
"""Child-run metric: the trial's final metric minus the control's at its seed, + = worse."""
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
"""MLflow 3's experiment kind for classic training runs: the UI opens the runs table, not the
GenAI overview."""
FP8_PARAMS = ("recipe", "bf16_layers")


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
class SweepOutcome:
    """What :func:`run_sweep` leaves: the parent run, every trial row, the recommendation
    (``None`` until every trial finished, and in the workers that did not write it), the trials
    this process ran, and the summary another worker wrote."""

    parent_run_id: str
    rows: list[TrialRow] = field(default_factory=list)
    recommendation: Recommendation | None = None
    ran: list[int] = field(default_factory=list)
    summary_text: str | None = None


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


@contextlib.contextmanager
def _experimental_ok() -> Iterator[None]:
    """Optuna marks heartbeats and retries experimental; we rely on them knowingly."""
    optuna = require("optuna", "fp8track sweep")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        yield


class _Surplus(RuntimeError):
    """The trial is beyond the sweep's budget (raised before any training)."""


def _base_sampler(spec: SweepSpec, seed: int) -> Any:
    optuna = require("optuna", "fp8track sweep")
    if spec.method == "grid":
        space = {p.name: list(p.values) for p in spec.params if p.kind == "categorical"}
        return optuna.samplers.GridSampler(space, seed=seed)
    if spec.method == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def control_whatif(spec: SweepSpec, auto_from: str) -> tuple[str, ...]:
    """The what-if variants the BF16 controls record: under ``auto_from="whatif"``, when some
    ``bf16_layers`` value is ``auto:K``, the variant of every quantising recipe the sweep may try
    (one control per seed serves them all); else none.

    Raises:
        ConfigError: a recipe of the sweep has no what-if rows (before anything is trained).
    """
    from fp8track.execution.fallback import FallbackSpec
    from fp8track.execution.recipes import Recipe

    if auto_from != "whatif":
        return ()
    layers, recipes = spec.param("bf16_layers"), spec.param("recipe")
    if layers is None or recipes is None:
        return ()
    if not any(FallbackSpec.parse(str(v)).needs_ranking for v in _param_values(layers)):
        return ()
    out: list[str] = []
    for v in _param_values(recipes):
        r = Recipe.parse(str(v))
        if r.quantizes and (w := whatif_variant(r)) not in out:
            out.append(w)
    return tuple(out)


def _param_values(p: Param) -> tuple[Any, ...]:
    return (p.value,) if p.kind == "constant" else p.values


def trial_seed(seed: int, number: int) -> int:
    """The sampler seed of trial ``number``: a stable hash of ``(seed, number)`` (no process id)."""
    return int(cache_key({"seed": seed, "trial": number}), 16) % (2**31)


def seeded_sampler(spec: SweepSpec, seed: int) -> Any:
    """An Optuna sampler re-seeded for every trial from ``(seed, trial number)`` (module docstring).

    ``grid`` keeps one ``GridSampler(seed)``: its seed shuffles the grid once and trial ``n`` takes
    the n-th point not yet run, the same order in every worker that uses the same seed."""
    optuna = require("optuna", "fp8track sweep")
    if spec.method == "grid":
        return _base_sampler(spec, seed)

    class TrialSeededSampler(optuna.samplers.BaseSampler):
        def __init__(self) -> None:
            self.inner = _base_sampler(spec, seed)

        def before_trial(self, study: Any, trial: Any) -> None:
            self.inner = _base_sampler(spec, trial_seed(seed, trial.number))
            self.inner.before_trial(study, trial)

        def infer_relative_search_space(self, study: Any, trial: Any) -> Any:
            return self.inner.infer_relative_search_space(study, trial)

        def sample_relative(self, study: Any, trial: Any, search_space: Any) -> Any:
            return self.inner.sample_relative(study, trial, search_space)

        def sample_independent(self, study: Any, trial: Any, name: str, dist: Any) -> Any:
            return self.inner.sample_independent(study, trial, name, dist)

        def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
            self.inner.after_trial(study, trial, state, values)

        def reseed_rng(self) -> None:  # Optuna calls it for n_jobs > 1; our seeds come from the trial
            pass

    return TrialSeededSampler()


def _pruner(spec: SweepSpec) -> Any:
    optuna = require("optuna", "fp8track sweep")
    if spec.hyperband is None:
        return optuna.pruners.NopPruner()
    return optuna.pruners.HyperbandPruner(min_resource=spec.hyperband.min_iter,
                                          max_resource=spec.hyperband.max_iter or "auto",
                                          reduction_factor=spec.hyperband.eta)


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


def _varying(spec: SweepSpec) -> list[Param]:
    return [p for p in spec.params if p.kind != "constant"]


def _param_text(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return ",".join(str(x) for x in v)
    return str(v)


class _Sweep:
    """One executor process: the study, the MLflow runs, the program runs."""

    def __init__(self, spec: SweepSpec, options: SweepOptions) -> None:
        optuna = require("optuna", "fp8track sweep")
        require("mlflow", "fp8track sweep's MLflow runs")
        from mlflow.tracking import MlflowClient

        self.spec, self.options, self.optuna = spec, options, optuna
        self.control_whatif = control_whatif(spec, options.auto_from)  # refused before any store exists
        self.program_hash = program_hash(spec.program, spec.command, options.cwd)
        options.out.mkdir(parents=True, exist_ok=True)
        self.cache = JsonCache(options.out / "cache")
        self.logs = options.out / "logs"
        # Creating the stores and the study/parent is one critical section for the workers of this
        # machine; workers on other machines wait for the parent id instead.
        with file_lock(options.out / ".sweep-init.lock"):
            self.client = RetryingClient(MlflowClient(options.mlflow_uri))
            self.experiment_id = self._experiment()
            with _experimental_ok():
                storage = optuna.storages.RDBStorage(
                    options.storage_url,
                    heartbeat_interval=options.heartbeat_s,
                    grace_period=options.grace_s,
                    heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(
                        max_retry=options.max_retry
                    ),
                    # SQLite: several worker processes wait for the write lock instead of failing.
                    engine_kwargs={"connect_args": {"timeout": 120}}
                    if options.storage_url.startswith("sqlite")
                    else None,
                )
            sampler, pruner = seeded_sampler(spec, options.seed), _pruner(spec)
            try:
                self.study = optuna.create_study(study_name=spec.name, storage=storage, direction=spec.goal,
                                                 sampler=sampler, pruner=pruner)
                self.parent_run_id = self._create_parent()
                self.study.set_user_attr(PARENT_ATTR, self.parent_run_id)
            except optuna.exceptions.DuplicatedStudyError:
                self.study = optuna.load_study(
                    study_name=spec.name, storage=storage, sampler=sampler, pruner=pruner
                )
                self.parent_run_id = self._wait_for_parent()
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self.progress: SweepProgress | None = None
        self.ran: list[int] = []
        self.controls: dict[str, RunOutcome] = {}

    # -- MLflow experiment and parent ---------------------------------------------------------------
    def _experiment(self) -> str:
        from mlflow.exceptions import MlflowException

        exp = self.client.get_experiment_by_name(self.spec.name)
        if exp is None:
            local = self.options.mlflow_uri.startswith("sqlite:")
            try:
                exp_id = self.client.create_experiment(
                    self.spec.name,
                    artifact_location=(self.options.out / "mlartifacts").as_uri() if local else None,
                )
            except MlflowException:  # another worker created it first
                exp = self.client.get_experiment_by_name(self.spec.name)
                if exp is None:
                    raise
                exp_id = exp.experiment_id
        else:
            exp_id = exp.experiment_id
        self.client.set_experiment_tag(exp_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return exp_id

    def _create_parent(self) -> str:
        run = self.client.create_run(self.experiment_id, run_name=self.spec.name, tags={
            "fp8track.sweep": self.spec.name, "fp8track.role": "parent", "fp8track.method": self.spec.method})
        rid = run.info.run_id
        params = {
            "method": self.spec.method,
            "metric": self.spec.metric,
            "goal": self.spec.goal,
            "program": self.spec.program,
            "program_hash": self.program_hash,
            "trials": self.options.trials,
            "seed": self.options.seed,
            "control_seeds": self.options.control_seeds,
            "finalists": self.options.finalists,
            "tolerance_factor": self.options.tolerance_factor,
            "tolerance_floor": self.options.tolerance_floor,
            "auto_from": self.options.auto_from,
        }
        params.update(
            {f"sweep.{p.name}": p.value if p.kind == "constant" else p.values for p in self.spec.params}
        )
        from mlflow.entities import Param

        self.client.log_batch(
            rid, params=[Param(k, _param_text(v)[:6000]) for k, v in params.items()], synchronous=True
        )
        self.client.log_dict(rid, dict(self.spec.raw), "sweep.yaml")
        return rid

    def _wait_for_parent(self, timeout_s: float = 300.0) -> str:
        t0 = time.monotonic()
        while True:
            rid = self.study.user_attrs.get(PARENT_ATTR)
            if rid:
                return str(rid)
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(
                    f"study {self.spec.name!r} has no {PARENT_ATTR} after {timeout_s:.0f} s; "
                    "its creator died before writing it: delete the study or set the attribute"
                )
            time.sleep(1.0)
            self.study = self.optuna.load_study(study_name=self.spec.name, storage=self.study._storage,
                                                sampler=self.study.sampler, pruner=self.study.pruner)

    # -- running the program -----------------------------------------------------------------------
    def _seed_of(self, params: Mapping[str, Any]) -> int | None:
        v = params.get(self.options.seed_param)
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    def _with_seed(self, params: Mapping[str, Any], seed: int) -> dict[str, Any]:
        return {**params, self.options.seed_param: seed}

    def control(self, params: Mapping[str, Any]) -> RunOutcome:
        """The BF16 control of ``params``' seed and non-FP8 parameters (cached)."""
        cparams = {**params, "recipe": "bf16", "bf16_layers": "none"}
        key = cache_key(cparams)
        if key not in self.controls:
            seed = self._seed_of(cparams)
            self._status(f"BF16 control{'' if seed is None else f' seed {seed}'}")
            out = self.execute(cparams, "control", f"control bf16{'' if seed is None else f' seed={seed}'}",
                               whatif=self.control_whatif)
            if out.state != "COMPLETE":
                raise RuntimeError(f"the BF16 control failed ({out.error or out.state}); see {self.logs}")
            self.controls[key] = out
            self.client.set_tag(
                self.parent_run_id, f"fp8track.control.seed{seed if seed is not None else ''}", out.run_id
            )
        return self.controls[key]

    def ranking(self, params: Mapping[str, Any]) -> Path:
        """The ``auto:K`` ranking under ``params``' recipe: the monitor's statistics of the run with
        every layer in FP8, ranked; written as JSON for the program."""
        from fp8track.analysis.baseline import load_run
        from fp8track.analysis.ranking import rank_layers

        if self.options.auto_from == "whatif":
            variant = whatif_variant(str(params["recipe"]))
            control = self.control(params)
            key = {"p": self.program_hash, "control": control.run_id, "whatif": variant}
        else:
            variant, pparams = None, {**params, "bf16_layers": "none"}
            key = {"p": self.program_hash, "params": pparams}
        path = self.options.out / "rankings" / f"{cache_key(key)}.json"
        if path.is_file():
            return path
        if variant is not None:
            self._status(f"auto:K: {variant} what-if rows of the BF16 control")
            source = control.run_id
        else:
            self._status(f"auto:K: all-FP8 run under {params['recipe']}")
            out = self.execute(pparams, "probe", f"probe {params['recipe']} none")
            if out.state != "COMPLETE":
                raise RuntimeError(f"the all-FP8 run for auto:K failed ({out.error or out.state})")
            source = out.run_id
        rows = load_run(f"mlflow:{source}", self.options.mlflow_uri).tensor_rows
        table = ranking_table(rank_layers(rows, variant=variant))
        if not table:
            raise ConfigError(
                f"auto:K from what-if rows needs the BF16 control's {variant!r} rows in its MLflow run: "
                f"pass whatif=list(trial_settings().whatif) ({WHATIF_ENV}) to the program's FP8Monitor"
                if variant is not None
                else "auto:K needs the monitor's per-layer statistics in the program's MLflow run: add "
                "FP8Monitor to the program's Trainer with the logger of trial_settings().mlflow_logger()"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps([r["layer"] for r in table]))
        os.replace(tmp, path)
        name = "auto_ranking_" + "".join(c if c.isalnum() else "_" for c in str(params["recipe"])) + ".json"
        self.client.log_table(self.parent_run_id, {k: [r.get(k) for r in table] for k in table[0]}, name)
        return path

    def execute(
        self, params: Mapping[str, Any], role: str, name: str, trial: Any = None, whatif: tuple[str, ...] = ()
    ) -> RunOutcome:
        """Run the program with ``params`` as a child run, or reuse the cached result of the same
        parameters (a trial then gets a child run copying it). ``whatif``: what-if variants its
        monitor records (``FP8TRACK_SWEEP_WHATIF``); part of the cache key, so a run recorded
        without them is not taken for one with them."""
        key: dict[str, Any] = {"program": self.program_hash,
                               "params": {k: _param_text(v) for k, v in params.items()},
                               "store": self.options.mlflow_uri}
        if whatif:
            key["whatif"] = list(whatif)
        lock = self.cache.path("run", key).with_suffix(".lock")
        self.cache.root.mkdir(parents=True, exist_ok=True)
        with file_lock(lock):
            hit = self.cache.get("run", key)
            if hit is not None and self._exists(hit["run_id"]):
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
                        return self._copy(cached, params, role, name, trial, pruned)
            out = self._launch(params, role, name, trial, whatif)
            if out.state in FINISHED_STATES:
                self.cache.put(
                    "run",
                    key,
                    {"run_id": out.run_id, "values": out.values, "seconds": out.seconds, "state": out.state},
                )
            return out

    @staticmethod
    def _replay(values: list[float], trial: Any) -> bool:
        """Report ``values`` to the trial's pruner in order; True as soon as it prunes."""
        for i, v in enumerate(values):
            trial.report(v, i)
            if trial.should_prune():
                return True
        return False

    def _exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_run(run_id).info.lifecycle_stage == "active"
        except MlflowException:
            return False

    def _child(
        self, params: Mapping[str, Any], role: str, name: str, trial: Any, extra: Mapping[str, str] = ()
    ) -> str:
        from mlflow.entities import Param, RunTag

        tags = {"fp8track.sweep": self.spec.name, "fp8track.role": role, "fp8track.state": "RUNNING",
                "fp8track.worker": self.worker, **dict(extra)}
        if trial is not None:
            tags["fp8track.trial"] = str(trial.number)
        seed = self._seed_of(params)
        if seed is not None:
            tags["fp8track.seed"] = str(seed)
        run = self.client.create_run(
            self.experiment_id, run_name=name[:250], tags={"mlflow.parentRunId": self.parent_run_id}
        )
        rid = run.info.run_id
        # Only what varies and the FP8 choice: the compare view opens on these (constants: the parent).
        shown = [*FP8_PARAMS, *(p.name for p in _varying(self.spec) if p.name not in FP8_PARAMS)]
        if role != "trial" and self.options.seed_param in params:
            shown.append(self.options.seed_param)
        self.client.log_batch(
            rid,
            params=[Param(k, _param_text(params[k])) for k in dict.fromkeys(shown) if k in params],
            synchronous=True,
        )
        # Tags last: a run tagged with its role always has its parameters.
        self.client.log_batch(rid, tags=[RunTag(k, v) for k, v in tags.items()], synchronous=True)
        return rid

    def _env(self, params: Mapping[str, Any], role: str, whatif: tuple[str, ...] = ()) -> dict[str, str]:
        """The program's environment (module docstring), all but ``MLFLOW_RUN_ID``; may train the
        control and the ``auto:K`` run first."""
        import yaml

        env = dict(os.environ)
        env.update({TRACKING_URI_ENV: self.options.mlflow_uri,
                    "OMP_NUM_THREADS": str(self.options.threads), "PYTHONUNBUFFERED": "1"})
        for k in (CONTROL_ENV, RANKING_ENV, WHATIF_ENV, "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME"):
            env.pop(k, None)
        if whatif:
            env[WHATIF_ENV] = ",".join(whatif)
        env["MLFLOW_EXPERIMENT_ID"] = self.experiment_id
        pfile = self.logs / f"params-{cache_key({k: _param_text(v) for k, v in params.items()})}.yaml"
        pfile.parent.mkdir(parents=True, exist_ok=True)
        pfile.write_text(yaml.safe_dump({"wandb_version": 1, **{k: {"value": v} for k, v in params.items()}}))
        env[PARAM_PATH_ENV] = str(pfile)
        if role != "control":
            env[CONTROL_ENV] = f"mlflow:{self.control(params).run_id}"
        from fp8track.execution.fallback import FallbackSpec

        if role != "control" and FallbackSpec.parse(str(params["bf16_layers"])).needs_ranking:
            env[RANKING_ENV] = str(self.ranking(params))
        if self.options.wandb:
            env.update({"WANDB_MODE": "offline", "WANDB_DIR": str(self.options.out / "wandb"),
                        "WANDB_RUN_GROUP": self.spec.name})
            (self.options.out / "wandb").mkdir(parents=True, exist_ok=True)
        return env

    def _launch(
        self, params: Mapping[str, Any], role: str, name: str, trial: Any, whatif: tuple[str, ...] = ()
    ) -> RunOutcome:
        # The environment first (it may train the control and the auto:K run), then this run's child.
        env = self._env(params, role, whatif)
        rid = self._child(params, role, name, trial)
        env[RUN_ID_ENV] = rid
        argv = expand(self.spec.command, self.spec.program, params, json_file=self.logs / f"{rid}.args.json")
        self.client.set_tag(rid, "fp8track.command", " ".join(argv)[:8000])

        def on_value(i: int, v: float) -> bool:
            if trial is None or not math.isfinite(v):
                return False
            trial.report(v, i)
            return bool(trial.should_prune())

        res = run_program(
            argv,
            env,
            self.client,
            rid,
            self.spec.metric,
            on_value,
            log=self.logs / f"{rid}.log",
            cwd=self.options.cwd,
            poll_s=self.options.poll_s,
            grace_s=self.options.kill_grace_s,
        )
        with contextlib.suppress(Exception):
            self.client.log_artifact(rid, str(res.log))
        if res.pruned:
            self._finish(rid, "PRUNED", "KILLED", name=f"{name} [pruned]")
            return RunOutcome(rid, "PRUNED", res.values, res.seconds)
        if res.returncode != 0:
            err = f"exit status {res.returncode}: {res.tail(8)}"
            self.client.set_tag(rid, "fp8track.error", err[-5000:])
            self._finish(rid, "FAIL", "FAILED")
            return RunOutcome(rid, "FAIL", res.values, res.seconds, error=err)
        values = res.values or metric_values(self.client, rid, self.spec.metric)
        if not values:
            logged = sorted(self.client.get_run(rid).data.metrics)
            self._finish(rid, "FAIL", "FAILED")
            raise MetricNotLogged(
                f"the program {self.spec.program!r} finished without logging the sweep's metric "
                f"{self.spec.metric!r} into its MLflow run; it logged: {', '.join(logged[:20]) or 'nothing'} "
                "(set metric.name to one of these, or log it through trial_settings().mlflow_logger())")
        self._finish(rid, "COMPLETE", "FINISHED")
        return RunOutcome(rid, "COMPLETE", values, res.seconds)

    def _finish(self, rid: str, state: str, status: str, name: str | None = None) -> None:
        self.client.set_tag(rid, "fp8track.state", state)
        self.client.set_terminated(rid, status)
        if name:
            self.client.update_run(rid, name=name[:250])

    def _copy(self, src: RunOutcome, params: Mapping[str, Any], role: str, name: str, trial: Any,
              pruned: bool) -> RunOutcome:
        """A child run holding the result of ``src`` (same parameters, nothing trained)."""
        from mlflow.entities import Metric, RunTag

        rid = self._child(params, role, f"{name} (reused)", trial, {"fp8track.reused_from": src.run_id})
        run = self.client.get_run(src.run_id)
        now = int(time.time() * 1000)
        history = self.client.get_metric_history(src.run_id, self.spec.metric)
        metrics = [Metric(k, v, now, 0) for k, v in run.data.metrics.items() if k != self.spec.metric]
        metrics += [Metric(m.key, m.value, m.timestamp, m.step) for m in history]
        tags = [
            RunTag(k, v)
            for k, v in run.data.tags.items()
            if k in ("fp8track.bf16_layer_names", "fp8track.command")
        ]
        for i in range(0, len(metrics), 900):
            self.client.log_batch(rid, metrics=metrics[i:i + 900], synchronous=True)
        if tags:
            self.client.log_batch(rid, tags=tags, synchronous=True)
        with contextlib.suppress(Exception):
            layers = self.client.download_artifacts(src.run_id, LAYERS_ARTIFACT, str(self.logs))
            self.client.log_artifact(rid, layers)
        state = "PRUNED" if pruned else "COMPLETE"
        self._finish(
            rid,
            state,
            "KILLED" if pruned else "FINISHED",
            name=f"{name} (reused) [pruned]" if pruned else None,
        )
        return RunOutcome(rid, state, src.values, 0.0, reused_from=src.run_id)

    # -- the loop ------------------------------------------------------------------------------------
    def counts(self) -> tuple[int, int]:
        """(COMPLETE + PRUNED, RUNNING) trials of the study."""
        states = [t.state.name for t in self.study.get_trials(deepcopy=False)]
        return sum(s in FINISHED_STATES for s in states), states.count("RUNNING")

    def run(self) -> SweepOutcome:
        done, _ = self.counts()
        self.progress = SweepProgress(self.options.trials, enabled=self.options.progress, done=done)
        failures = 0
        try:
            while True:
                with _experimental_ok():
                    self.optuna.storages.fail_stale_trials(self.study)
                self.close_dead_children()
                done, running = self.counts()
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
                last = self._my_last_trial()
                if last is None or last.user_attrs.get("surplus"):
                    continue
                failures = failures + 1 if last.state.name == "FAIL" else 0
                if failures >= 3:
                    raise RuntimeError(
                        "three trials in a row failed; see the child runs' fp8track.error tags and "
                        f"{self.logs}"
                    )
        finally:
            self.progress.close()
        outcome = SweepOutcome(self.parent_run_id, ran=list(self.ran))
        done, running = self.counts()
        if done >= self.options.trials and running == 0:
            # One worker writes the summary (reruns the finalists, writes the parent's artifacts):
            # the one that ran the highest-numbered finished trial. Every worker computes the same
            # answer from the shared study, on any machine. A process that ran no trial here (a
            # resume after that worker died) writes it if nobody has; same-machine resumes take turns
            # under a file lock.
            with file_lock(self.options.out / ".sweep-finish.lock"):
                if self._summary_written():
                    outcome.summary_text = read_summary(self.client, self.parent_run_id)
                elif self._summary_writer() in (self.worker, None) or not self.ran:
                    outcome.rows, outcome.recommendation = self.finish()
        return outcome

    def _summary_writer(self) -> str | None:
        """The worker of the highest-numbered finished trial (``None`` when none finished)."""
        finished = [
            t for t in self.study.get_trials(deepcopy=False)
            if t.state.name in FINISHED_STATES and not t.user_attrs.get("surplus")
        ]
        return max(finished, key=lambda t: t.number).user_attrs.get("worker") if finished else None

    def _summary_written(self) -> bool:
        return "fp8track.recommendation" in self.client.get_run(self.parent_run_id).data.tags

    def _my_last_trial(self) -> Any:
        mine = [t for t in self.study.get_trials(deepcopy=False) if t.user_attrs.get("worker") == self.worker]
        return mine[-1] if mine else None

    def close_dead_children(self) -> None:
        """Mark FAILED the child run of every failed trial that is still RUNNING (its executor was
        killed; found by the trial tag, since it may die before noting the run id)."""
        failed = {
            str(t.number)
            for t in self.study.get_trials(deepcopy=False, states=(self.optuna.trial.TrialState.FAIL,))
        }
        if not failed:
            return
        running = self.client.search_runs(
            [self.experiment_id],
            filter_string=(
                f"tags.mlflow.parentRunId = '{self.parent_run_id}' and attributes.status = 'RUNNING'"
            ),
        )
        for run in running:
            if run.data.tags.get("fp8track.trial") in failed:
                rid = run.info.run_id
                self.client.set_tag(
                    rid, "fp8track.error", "executor died mid-trial (heartbeat went stale); retried"
                )
                self._finish(rid, "FAIL", "FAILED")

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
            raise _Surplus(f"trial {trial.number} is beyond the sweep's {self.options.trials} trials")
        params = _suggest(trial, self.spec)
        self.ran.append(trial.number)
        t0 = time.perf_counter()
        control = self.control(params)
        self._status(f"trial {trial.number}: {params['recipe']} / {params['bf16_layers']}")
        name = f"trial-{trial.number:03d} {params['recipe']} {params['bf16_layers']}"
        out = self.execute(params, "trial", name, trial)
        trial.set_user_attr("mlflow_run_id", out.run_id)
        if out.values and math.isfinite(control.final):
            self.client.log_metric(
                out.run_id, GAP_METRIC, signed_gap(out.final, control.final, self.spec.goal)
            )
        done, _ = self.counts()
        if self.progress is not None:
            self.progress.trial_finished(trial.number, out.final, time.perf_counter() - t0, done + 1)
        if out.state == "PRUNED":
            raise self.optuna.TrialPruned(f"pruned after {len(out.values)} values of {self.spec.metric}")
        if out.state == "FAIL":
            raise RuntimeError(out.error or "the program failed")
        return out.final

    # -- finalists and summary -------------------------------------------------------------------------
    def rows(self) -> list[TrialRow]:
        runs = self.client.search_runs(
            [self.experiment_id],
            max_results=50000,
            filter_string=(
                f"tags.mlflow.parentRunId = '{self.parent_run_id}' and tags.`fp8track.role` = 'trial'"
            ),
        )
        varying = [p.name for p in _varying(self.spec)]
        return sorted((row_from_run(r, self.spec.metric, varying) for r in runs), key=lambda r: r.trial)

    def finish(self) -> tuple[list[TrialRow], Recommendation]:
        """Rerun the finalists on the control's seeds, judge them, write the summary to the parent."""
        rows = self.rows()
        seed0 = next((self._seed_of(self._params_of(r)) for r in rows if r.finished), None)
        seeds = [seed0] if seed0 is None else [seed0 + i for i in range(self.options.control_seeds)]
        base = next((self._params_of(r) for r in rows if r.finished), None)
        finals = (
            {s: self.control(base if s is None else self._with_seed(base, s)).final for s in seeds}
            if base
            else {}
        )
        cspread = spread(list(finals.values()))
        tol = tolerance(cspread, self.options.tolerance_factor, self.options.tolerance_floor)
        judged = []
        for r in pick_finalists(rows, tol, self.options.finalists):
            gaps = {seeds[0] if seeds[0] is not None else 0: r.gap}
            for s in seeds[1:]:
                self._status(f"finalist trial {r.trial} on seed {s}")
                params = self._with_seed(self._params_of(r), s)
                out = self.execute(params, "finalist", f"finalist trial-{r.trial:03d} seed={s}")
                if out.state == "COMPLETE":
                    gaps[s] = signed_gap(out.final, finals[s], self.spec.goal)
                    self.client.log_metric(out.run_id, GAP_METRIC, gaps[s])
            judged.append(
                judge(r, gaps, cspread, self.options.tolerance_factor, self.options.tolerance_floor)
            )
        layers = {j.row.run_id: self._layers(j.row.run_id) for j in judged}
        rec = recommend(judged, cspread, self.options.tolerance_factor, self.options.tolerance_floor, layers)
        self._write_summary(rows, rec)
        return rows, rec

    def _params_of(self, row: TrialRow) -> dict[str, Any]:
        """A trial's full parameters: the constants plus its varying values (typed from the spec)."""
        params: dict[str, Any] = {}
        for p in self.spec.params:
            if p.kind == "constant":
                params[p.name] = p.value
            else:
                text = row.params.get(p.name, "")
                params[p.name] = (
                    next((v for v in p.values if str(v) == text), text)
                    if p.kind == "categorical"
                    else (int(text) if p.kind == "int_uniform" else float(text))
                )
        return params

    def _layers(self, run_id: str) -> list[dict[str, Any]]:
        try:
            path = self.client.download_artifacts(run_id, LAYERS_ARTIFACT, str(self.logs / run_id))
            return list(json.loads(Path(path).read_text())["layers"])
        except Exception:  # noqa: BLE001 - a program that did not record its layers
            return []

    def _write_summary(self, rows: list[TrialRow], rec: Recommendation) -> None:
        rid = self.parent_run_id
        self.client.log_table(rid, summary_table(rows), "sweep_summary.json")
        self.client.log_figure(rid, pareto_figure(rows, rec), "pareto.png")
        self.client.log_dict(rid, rec.to_dict(), "recommendation.json")
        self.client.log_text(rid, format_text(rows, rec), "summary.txt")
        self.client.log_metric(rid, "recommendation/tolerance", rec.tolerance)
        self.client.log_metric(rid, "control/spread", rec.spread)
        if rec.trial is not None:
            t = rec.trial
            for k, v in {"recipe": t.recipe, "bf16_layers": t.bf16_layers, "trial": str(t.trial),
                         "bf16_layer_names": ",".join(t.bf16_names) or "none", "verdict": rec.verdict,
                         "apply_fp8": rec.apply_call}.items():
                self.client.set_tag(rid, f"fp8track.recommendation.{k}", v[:8000])
            self.client.log_metric(rid, "recommendation/mean_gap", rec.mean_gap)
            self.client.log_metric(rid, "recommendation/band", rec.band)
            if math.isfinite(t.fp8_flop_share):
                self.client.log_metric(rid, "recommendation/fp8_flop_share", t.fp8_flop_share)
        self.client.set_tag(rid, "fp8track.recommendation", rec.reason[:5000])
        self.client.set_terminated(rid, "FINISHED")


def row_from_run(run: Any, metric: str, varying: list[str] | None = None) -> TrialRow:
    """A :class:`TrialRow` from a trial's MLflow child run."""
    p, m, t = run.data.params, run.data.metrics, run.data.tags

    def f(key: str) -> float:
        return float(m[key]) if key in m else math.nan

    names = t.get("fp8track.bf16_layer_names", "")
    bf16 = tuple(n for n in names.split(",") if n and n != "none")
    n_bf16 = int(m["n_bf16_layers"]) if "n_bf16_layers" in m else (len(bf16) if names else -1)
    return TrialRow(
        trial=int(t.get("fp8track.trial", -1)),
        state=t.get("fp8track.state", "FAIL"),
        recipe=p.get("recipe", ""),
        bf16_layers=p.get("bf16_layers", ""),
        n_bf16=n_bf16,
        gap=f(GAP_METRIC),
        fp8_flop_share=f(FLOP_SHARE_METRIC),
        bf16_names=bf16,
        value=f(metric),
        step_time_s=f("fp8/step_time_s"),
        run_id=run.info.run_id,
        params={k: p[k] for k in (varying or [*FP8_PARAMS]) if k in p},
    )


def read_summary(client: Any, parent_run_id: str) -> str | None:
    """The ``summary.txt`` the sweep wrote to its parent run (``None`` before it finished)."""
    import tempfile

    try:
        with tempfile.TemporaryDirectory() as tmp:
            return Path(client.download_artifacts(parent_run_id, "summary.txt", tmp)).read_text()
    except Exception:  # noqa: BLE001 - not written yet
        return None


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


def run_sweep(spec: SweepSpec, options: SweepOptions) -> SweepOutcome:
    """Run (or resume, or join) the sweep until ``options.trials`` trials finished."""
    return _Sweep(spec, options).run()


__all__ = ["SweepOptions", "SweepOutcome", "RunOutcome", "MetricNotLogged", "GAP_METRIC", "EXPERIMENT_KIND",
           "seeded_sampler", "trial_seed", "run_sweep", "read_summary", "find_parent", "row_from_run"]
