"""The sweep's Optuna side: the study in its RDB storage (heartbeats, retry of a dead worker's
trial), samplers re-seeded per trial, the hyperband pruner, parameter suggestion, and the
questions the executor asks the shared study (how many trials finished, who writes the summary).

* ``grid`` -> ``GridSampler``, ``random`` -> ``RandomSampler``, ``bayes`` -> ``TPESampler``,
  re-seeded for every trial from ``(seed, trial number)``: one worker with the same YAML and seed
  proposes the same trials; several workers share the study's history in the storage (no process
  id in any seed).
* ``early_terminate: hyperband`` -> ``HyperbandPruner`` (``min_resource = min_iter``,
  ``reduction_factor = eta``, ``max_resource = max_iter`` or "auto").
* **No configuration twice**: a trial whose sampled parameters equal an evaluated trial's
  (:func:`twin_of`; random and TPE samplers re-propose points of a small categorical space) runs
  nothing and spends no budget: it is closed with the earlier result (a COMPLETE twin's value, so
  the sampler learns from the point as Optuna's FAQ recommends; PRUNED as pruned; a twin still
  RUNNING elsewhere as failed) and user attribute ``duplicate_of``, and, in a finite space, a point
  not yet evaluated is queued for the next trial (:func:`unevaluated_point`), so the sweep neither
  stalls nor evaluates fewer configurations than asked. The budget is at most the space's size.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import random
import time
import warnings
from collections.abc import Iterator
from typing import Any

from fp8track.optional import require
from fp8track.sweep.options import SweepOptions
from fp8track.sweep.spec import SweepSpec
from fp8track.trial import cache_key

PARENT_ATTR = "mlflow_parent_run_id"
"""Study user attribute holding the MLflow parent run's id (workers on other machines wait for it)."""
FINISHED_STATES = ("COMPLETE", "PRUNED")
REFUSED = "refused its input: "
"""How a trial's ``error`` attribute starts when its program refused the parameters (a ConfigError)."""


class Surplus(RuntimeError):
    """The trial is beyond the sweep's budget (raised before any training)."""


@contextlib.contextmanager
def experimental_ok() -> Iterator[None]:
    """Optuna marks heartbeats and retries experimental; we rely on them knowingly."""
    optuna = require("optuna", "fp8track sweep")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        yield


def _base_sampler(spec: SweepSpec, seed: int) -> Any:
    optuna = require("optuna", "fp8track sweep")
    if spec.method == "grid":
        space = {p.name: list(p.values) for p in spec.params if p.kind == "categorical"}
        return optuna.samplers.GridSampler(space, seed=seed)
    if spec.method == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


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


def pruner(spec: SweepSpec) -> Any:
    """``HyperbandPruner`` for ``early_terminate: hyperband``, else ``NopPruner``."""
    optuna = require("optuna", "fp8track sweep")
    if spec.hyperband is None:
        return optuna.pruners.NopPruner()
    return optuna.pruners.HyperbandPruner(min_resource=spec.hyperband.min_iter,
                                          max_resource=spec.hyperband.max_iter or "auto",
                                          reduction_factor=spec.hyperband.eta)


def suggest(trial: Any, spec: SweepSpec) -> dict[str, Any]:
    """The trial's parameters: constants as given, the others suggested by the study's sampler."""
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


def open_study(spec: SweepSpec, options: SweepOptions) -> tuple[Any, bool]:
    """``(study, created)``: the sweep's study in its RDB storage, created by this call or loaded
    when another worker created it first (then ``created`` is False)."""
    optuna = require("optuna", "fp8track sweep")
    with experimental_ok():
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
    sampler, prune = seeded_sampler(spec, options.seed), pruner(spec)
    try:
        study = optuna.create_study(study_name=spec.name, storage=storage, direction=spec.goal,
                                    sampler=sampler, pruner=prune)
        return study, True
    except optuna.exceptions.DuplicatedStudyError:
        return optuna.load_study(study_name=spec.name, storage=storage, sampler=sampler, pruner=prune), False


def wait_for_parent(study: Any, timeout_s: float = 300.0) -> tuple[Any, str]:
    """``(study, parent run id)`` once the study's creator wrote :data:`PARENT_ATTR` (the study
    reloaded while waiting)."""
    optuna = require("optuna", "fp8track sweep")
    t0 = time.monotonic()
    while True:
        rid = study.user_attrs.get(PARENT_ATTR)
        if rid:
            return study, str(rid)
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(
                f"study {study.study_name!r} has no {PARENT_ATTR} after {timeout_s:.0f} s; "
                "its creator died before writing it: delete the study or set the attribute"
            )
        time.sleep(1.0)
        study = optuna.load_study(study_name=study.study_name, storage=study._storage,
                                  sampler=study.sampler, pruner=study.pruner)


DUPLICATE_ATTR = "duplicate_of"
"""Trial user attribute: the number of the evaluated trial whose parameters it re-proposed."""
SPACE_LIMIT = 100_000
"""Largest search space enumerated to find points not yet evaluated (larger ones rarely repeat)."""


def is_duplicate(trial: Any) -> bool:
    return trial.user_attrs.get(DUPLICATE_ATTR) is not None


def is_refused(trial: Any) -> bool:
    """A failed trial whose program refused its parameters: running them again gives the same."""
    return trial.state.name == "FAIL" and str(trial.user_attrs.get("error", "")).startswith(REFUSED)


def counts(study: Any) -> tuple[int, int]:
    """(COMPLETE + PRUNED, RUNNING) trials of the study, re-proposed configurations not counted."""
    states = [t.state.name for t in study.get_trials(deepcopy=False) if not is_duplicate(t)]
    return sum(s in FINISHED_STATES for s in states), states.count("RUNNING")


def space_size(spec: SweepSpec) -> int | None:
    """Points in the search space (``None`` when a parameter is continuous)."""
    n = 1
    for p in spec.params:
        if p.kind == "categorical":
            n *= len(p.values)
        elif p.kind == "int_uniform":
            n *= int(p.high) - int(p.low) + 1
        elif p.kind != "constant":
            return None
    return n


def twin_of(study: Any, trial: Any) -> Any:
    """The earliest other trial with ``trial``'s parameters that is evaluated or being evaluated
    (COMPLETE, PRUNED, RUNNING, or refused by the program; not itself a duplicate nor a surplus),
    or ``None``. Another failed trial's parameters may run again (a retry)."""
    for t in study.get_trials(deepcopy=False):
        if (t.number != trial.number and (t.state.name in (*FINISHED_STATES, "RUNNING") or is_refused(t))
                and not is_duplicate(t) and not t.user_attrs.get("surplus") and t.params == trial.params):
            return t
    return None


def unevaluated_point(study: Any, spec: SweepSpec, seed: int) -> dict[str, Any] | None:
    """A point of a finite search space that no trial has evaluated, runs, waits for or had refused
    (drawn with ``seed``), as ``study.enqueue_trial`` takes it; ``None`` when every point is taken
    or the space is continuous or larger than :data:`SPACE_LIMIT`."""
    size = space_size(spec)
    if size is None or size > SPACE_LIMIT:
        return None
    axes = {p.name: (list(p.values) if p.kind == "categorical" else list(range(int(p.low), int(p.high) + 1)))
            for p in spec.params if p.kind in ("categorical", "int_uniform")}
    taken = [
        t.params for t in study.get_trials(deepcopy=False)
        if (t.state.name in (*FINISHED_STATES, "RUNNING", "WAITING") or is_refused(t)) and not is_duplicate(t)
    ]
    free = [dict(zip(axes, values, strict=True)) for values in itertools.product(*axes.values())]
    free = [p for p in free if not any(_same(p, t) for t in taken)]
    return random.Random(seed).choice(free) if free else None


def _same(point: dict[str, Any], params: dict[str, Any]) -> bool:
    return all(k in params and (params[k] == v or (isinstance(v, float) and math.isclose(params[k], v)))
               for k, v in point.items())


def summary_writer(study: Any) -> str | None:
    """The worker of the highest-numbered finished trial (``None`` when none finished)."""
    finished = [
        t for t in study.get_trials(deepcopy=False)
        if t.state.name in FINISHED_STATES and not t.user_attrs.get("surplus") and not is_duplicate(t)
    ]
    return max(finished, key=lambda t: t.number).user_attrs.get("worker") if finished else None


def last_trial_of(study: Any, worker: str) -> Any:
    """The last trial ``worker`` ran (``None`` when it ran none)."""
    mine = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("worker") == worker]
    return mine[-1] if mine else None


def failed_trials(study: Any) -> set[str]:
    """Numbers (as text, as the child runs' ``fp8track.trial`` tag) of the study's failed trials."""
    return {str(t.number) for t in failed(study)}


def failed(study: Any) -> list[Any]:
    """The study's failed trials (surplus and re-proposed ones left out), by number."""
    optuna = require("optuna", "fp8track sweep")
    return [
        t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.FAIL,))
        if not t.user_attrs.get("surplus") and not is_duplicate(t)
    ]


__all__ = ["PARENT_ATTR", "FINISHED_STATES", "DUPLICATE_ATTR", "REFUSED", "Surplus", "experimental_ok",
           "trial_seed", "seeded_sampler", "pruner", "suggest", "open_study", "wait_for_parent", "counts",
           "space_size", "twin_of", "unevaluated_point", "is_duplicate", "is_refused", "summary_writer",
           "last_trial_of", "failed_trials", "failed"]
