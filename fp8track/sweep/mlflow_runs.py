"""The sweep's MLflow side: its experiment (``mlflow.experimentKind``), the parent run (the sweep's
settings, the YAML) and one child run per program run (only what varies and the FP8 choice as
params, so the compare view opens on them; role, trial, seed and worker as tags), a child run
copying an earlier result (reuse), and the trial rows read back.

* **Pruning** marks a run KILLED with tag ``fp8track.state = PRUNED`` and the run name suffix
  ``[pruned]`` (MLflow has no PRUNED status; the UI shows KILLED).
* Every call goes through :class:`fp8track.trackers.mlflow.RetryingClient`: several workers write
  one store.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fp8track.errors import ConfigError
from fp8track.sweep.options import RunOutcome, SweepOptions
from fp8track.sweep.spec import Param, SweepSpec
from fp8track.sweep.summary import TrialRow
from fp8track.trial import FLOP_SHARE_METRIC, LAYERS_ARTIFACT

GAP_METRIC = "gap_vs_bf16"
"""Child-run metric: the trial's final metric minus the control's at its seed, + = worse."""
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
"""MLflow 3's experiment kind for classic training runs: the UI opens the runs table, not the
GenAI overview."""
FP8_PARAMS = ("recipe", "bf16_layers")


def varying(spec: SweepSpec) -> list[Param]:
    """The sweep's parameters that are not constant."""
    return [p for p in spec.params if p.kind != "constant"]


def param_text(v: Any) -> str:
    """A parameter value as MLflow params and cache keys hold it (lists comma-joined)."""
    if isinstance(v, (list, tuple)):
        return ",".join(str(x) for x in v)
    return str(v)


def seed_of(params: Mapping[str, Any], seed_param: str) -> int | None:
    """The program seed in ``params`` (``None`` when the sweep has no seed parameter)."""
    v = params.get(seed_param)
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


class SweepRuns:
    """The sweep's experiment, parent run and child runs in one MLflow store.

    Args:
        client: an ``MlflowClient`` (a :class:`~fp8track.trackers.mlflow.RetryingClient`).
        spec, options: the sweep.
        worker: ``host:pid`` of this executor process (a tag of its child runs).
    """

    def __init__(self, client: Any, spec: SweepSpec, options: SweepOptions, worker: str) -> None:
        self.client, self.spec, self.options, self.worker = client, spec, options, worker
        self.experiment_id = self._experiment()
        self.parent_run_id = ""  # set by create_parent, or by the executor from the study

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

    def create_parent(self, program_hash: str) -> str:
        """Create the parent run (the sweep's settings as params, the YAML as ``sweep.yaml``)."""
        run = self.client.create_run(self.experiment_id, run_name=self.spec.name, tags={
            "fp8track.sweep": self.spec.name, "fp8track.role": "parent", "fp8track.method": self.spec.method})
        rid = run.info.run_id
        params = {
            "method": self.spec.method,
            "metric": self.spec.metric,
            "goal": self.spec.goal,
            "program": self.spec.program,
            "program_hash": program_hash,
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
        from mlflow.entities import Param as MlflowParam

        self.client.log_batch(
            rid, params=[MlflowParam(k, param_text(v)[:6000]) for k, v in params.items()], synchronous=True
        )
        self.client.log_dict(rid, dict(self.spec.raw), "sweep.yaml")
        self.parent_run_id = rid
        return rid

    def child(
        self, params: Mapping[str, Any], role: str, name: str, trial: Any, extra: Mapping[str, str] = ()
    ) -> str:
        """Create a child run of the parent for one program run; its id."""
        from mlflow.entities import Param as MlflowParam
        from mlflow.entities import RunTag

        tags = {"fp8track.sweep": self.spec.name, "fp8track.role": role, "fp8track.state": "RUNNING",
                "fp8track.worker": self.worker, **dict(extra)}
        if trial is not None:
            tags["fp8track.trial"] = str(trial.number)
        seed = seed_of(params, self.options.seed_param)
        if seed is not None:
            tags["fp8track.seed"] = str(seed)
        run = self.client.create_run(
            self.experiment_id, run_name=name[:250], tags={"mlflow.parentRunId": self.parent_run_id}
        )
        rid = run.info.run_id
        # Only what varies and the FP8 choice: the compare view opens on these (constants: the parent).
        shown = [*FP8_PARAMS, *(p.name for p in varying(self.spec) if p.name not in FP8_PARAMS)]
        if role != "trial" and self.options.seed_param in params:
            shown.append(self.options.seed_param)
        self.client.log_batch(
            rid,
            params=[MlflowParam(k, param_text(params[k])) for k in dict.fromkeys(shown) if k in params],
            synchronous=True,
        )
        # Tags last: a run tagged with its role always has its parameters.
        self.client.log_batch(rid, tags=[RunTag(k, v) for k, v in tags.items()], synchronous=True)
        return rid

    def finish(self, rid: str, state: str, status: str, name: str | None = None) -> None:
        """Tag the run's ``fp8track.state``, terminate it with ``status``, rename it if ``name``."""
        self.client.set_tag(rid, "fp8track.state", state)
        self.client.set_terminated(rid, status)
        if name:
            self.client.update_run(rid, name=name[:250])

    def exists(self, run_id: str) -> bool:
        """Whether the run is in the store and not deleted."""
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_run(run_id).info.lifecycle_stage == "active"
        except MlflowException:
            return False

    def copy(self, src: RunOutcome, params: Mapping[str, Any], role: str, name: str, trial: Any,
             pruned: bool, logs: Path) -> RunOutcome:
        """A child run holding the result of ``src`` (same parameters, nothing trained)."""
        from mlflow.entities import Metric, RunTag

        rid = self.child(params, role, f"{name} (reused)", trial, {"fp8track.reused_from": src.run_id})
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
            layers = self.client.download_artifacts(src.run_id, LAYERS_ARTIFACT, str(logs))
            self.client.log_artifact(rid, layers)
        state = "PRUNED" if pruned else "COMPLETE"
        self.finish(
            rid,
            state,
            "KILLED" if pruned else "FINISHED",
            name=f"{name} (reused) [pruned]" if pruned else None,
        )
        return RunOutcome(rid, state, src.values, 0.0, reused_from=src.run_id)

    def close_dead_children(self, failed: set[str]) -> None:
        """Mark FAILED the child run of every failed trial (numbers ``failed``) that is still RUNNING
        (its executor was killed; found by the trial tag, since it may die before noting the run id)."""
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
                self.finish(rid, "FAIL", "FAILED")

    def close_running(self, worker: str, reason: str) -> None:
        """Mark KILLED (tag ``fp8track.state = KILLED``, ``fp8track.error`` = ``reason``) every child
        run of ``worker`` still RUNNING: what an interrupt left open."""
        running = self.client.search_runs(
            [self.experiment_id],
            filter_string=(
                f"tags.mlflow.parentRunId = '{self.parent_run_id}' and attributes.status = 'RUNNING'"
            ),
        )
        for run in running:
            if run.data.tags.get("fp8track.worker") == worker:
                self.client.set_tag(run.info.run_id, "fp8track.error", reason)
                self.finish(run.info.run_id, "KILLED", "KILLED")

    def reopen_parent(self) -> None:
        """A resumed sweep's parent, KILLED or FAILED by an interrupt, is RUNNING again."""
        if self.client.get_run(self.parent_run_id).info.status in ("KILLED", "FAILED"):
            self.client.update_run(self.parent_run_id, status="RUNNING")

    def summary_written(self) -> bool:
        """Whether a worker already wrote the recommendation to the parent."""
        return "fp8track.recommendation" in self.client.get_run(self.parent_run_id).data.tags

    def trial_rows(self) -> list[TrialRow]:
        """Every trial's child run as a :class:`TrialRow`, by trial number."""
        runs = self.client.search_runs(
            [self.experiment_id],
            max_results=50000,
            filter_string=(
                f"tags.mlflow.parentRunId = '{self.parent_run_id}' and tags.`fp8track.role` = 'trial'"
            ),
        )
        names = [p.name for p in varying(self.spec)]
        return sorted((row_from_run(r, self.spec.metric, names) for r in runs), key=lambda r: r.trial)

    def layers(self, run_id: str, logs: Path) -> list[dict[str, Any]]:
        """The layers a program run recorded (its ``LAYERS_ARTIFACT``); ``[]`` when it did not."""
        try:
            path = self.client.download_artifacts(run_id, LAYERS_ARTIFACT, str(logs / run_id))
            return list(json.loads(Path(path).read_text())["layers"])
        except Exception:  # noqa: BLE001 - a program that did not record its layers
            return []


def row_from_run(run: Any, metric: str, varying: list[str] | None = None) -> TrialRow:
    """A :class:`TrialRow` from a trial's MLflow child run."""
    p, m, t = run.data.params, run.data.metrics, run.data.tags

    def f(key: str) -> float:
        return float(m[key]) if key in m else math.nan

    # TrialSettings.apply's layer table; else the monitor's own tag and param (a program calling
    # apply_fp8 and fp8track.Monitor itself), the tag only when it lists every name.
    names = t.get("fp8track.bf16_layer_names", "")
    if not names and " (+" not in t.get("fp8.bf16_layers", " (+"):
        names = t["fp8.bf16_layers"]
    bf16 = tuple(n for n in names.split(",") if n and n != "none")
    n_bf16 = int(m["n_bf16_layers"]) if "n_bf16_layers" in m else (len(bf16) if names else -1)
    if n_bf16 < 0 and str(p.get("fp8.n_bf16_layers", "")).isdigit():
        n_bf16 = int(p["fp8.n_bf16_layers"])
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
        error=t.get("fp8track.error", ""),
    )


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


def trial_run_ids(client: Any, experiment_id: str, parent_run_id: str) -> list[str]:
    """The run ids of the sweep's trials (children of ``parent_run_id`` with role ``trial``), by
    trial number."""
    trials = client.search_runs(
        [experiment_id], f"tags.mlflow.parentRunId = '{parent_run_id}' and tags.`fp8track.role` = 'trial'",
        max_results=1000,
    )
    trials.sort(key=lambda r: int(r.data.tags.get("fp8track.trial", 0)))
    return [r.info.run_id for r in trials]


__all__ = ["GAP_METRIC", "EXPERIMENT_KIND", "FP8_PARAMS", "SweepRuns", "row_from_run", "find_parent",
           "trial_run_ids", "varying", "param_text", "seed_of"]
