"""Send a local run directory to a tracker again: what ``fp8track sync`` does (the command itself:
:mod:`fp8track.cli.sync`).

The run directory is the source of truth; a tracker that failed during training has its missed
steps listed in ``<run_dir>/sync/<name>.missed.jsonl``. :func:`sync_run` rebuilds the
:class:`~fp8track.trackers.base.StepBatch` of those steps (or of every step) from the records and
sends them again; what was delivered is removed from the missed file.

Replay re-sends whole steps: a step that had partly reached the tracker (say its metrics but not
its table rows) is sent again in full. MLflow keeps every point, so such a step can appear twice
in a metric history; W&B gains a second row with the same ``trainer/global_step``.

``fp8track sync --mlflow-uri`` without ``--mlflow-run-id`` completes the MLflow run that already
carries the run directory's ``fp8track.run_id`` tag (the training's own run, or the run an earlier
sync created): a second sync finds it and sends only what is still missed, never a second run.
``fp8track sync --wandb-dir`` does the same for W&B: its run's id is derived from the run
directory's ``fp8track.run_id`` (``fp8track-<run id>``), and a run of that id already under
``--wandb-dir`` gets only what is still missed (nothing, after a complete sync).
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import re
import time
import warnings
from pathlib import Path
from typing import Any

from fp8track.errors import ConfigError, dataclass_from_dict
from fp8track.monitoring.records import RunMeta, RunReader, redact
from fp8track.trackers.base import StepBatch, Tracker
from fp8track.trackers.fanout import missed_path, read_missed
from fp8track.trackers.queued import QueuedTracker


def step_batches(run_dir: str | os.PathLike[str]) -> dict[int, StepBatch]:
    """Every logging step of a run directory as a :class:`StepBatch`, keyed by step.

    Several metrics records of one step are merged (later values win); tensor rows and events are
    attached to their step (a step with only events still gets a batch).
    """
    reader = RunReader(run_dir)
    metrics: dict[int, dict[str, float]] = {}
    rows: dict[int, list[Any]] = {}
    events: dict[int, list[Any]] = {}
    for rec in reader.metrics():
        metrics.setdefault(int(rec.step), {}).update(rec.metrics)
    for row in reader.tensor_stats():
        rows.setdefault(int(row.step), []).append(row)
    for ev in reader.events():
        events.setdefault(int(ev.step), []).append(ev)
    steps = sorted(set(metrics) | set(rows) | set(events))
    return {
        s: StepBatch(
            step=s, metrics=metrics.get(s, {}), tensor_rows=rows.get(s, ()), events=events.get(s, ())
        )
        for s in steps
        if s >= 0
    }


def run_meta(run_dir: str | os.PathLike[str]) -> RunMeta:
    """The :class:`RunMeta` stored in ``meta.json`` (unknown keys ignored)."""
    d = RunReader(run_dir).meta()
    return dataclass_from_dict(RunMeta, d, strict=False)


def sync_run(run_dir: str | os.PathLike[str], tracker: Tracker, only_missed: bool = True) -> int:
    """Send the missed (or all) steps of a run directory to ``tracker`` (what ``fp8track sync`` does
    for each destination).

    Calls ``tracker.start(meta)``, ``tracker.log`` for each step in order, then
    ``tracker.finish()``. A step whose only loss was its table rows (``what == "tables"``) is
    sent without its scalars, one that lost only its scalars (``"scalars"``) without its rows
    and events. Failures do not raise: they stay (or are added) in the tracker's missed
    file. Entries for a failed ``start``/``finish`` are cleared when this sync's own start and
    finish succeed.

    Args:
        run_dir: an fp8track run directory.
        tracker: where to send the steps; its ``name`` selects the missed file.
        only_missed: send only the steps listed in the missed file (default), else every step.

    Returns:
        The number of steps delivered.
    """
    run_dir = Path(run_dir)
    batches = step_batches(run_dir)
    old = read_missed(run_dir, tracker.name)
    parts: dict[int, set[str]] = {}  # step -> what was missed ("log", "tables", ...)
    for e in old:
        if e.get("step") is not None:
            parts.setdefault(int(e["step"]), set()).add(str(e.get("what", "log")))
    if only_missed:
        if not old:
            return 0
        wanted = sorted(parts)
    else:
        wanted = sorted(batches)
    failed: dict[int | None, str] = {}

    def fail(step: int | None, exc: BaseException) -> None:
        failed.setdefault(step, redact(f"{type(exc).__name__}: {exc}")[:2000])

    try:
        tracker.start(run_meta(run_dir))
    except Exception as exc:
        fail(None, exc)
    sent = []
    for s in wanted:
        batch = batches.get(s)
        if batch is None:
            continue  # listed as missed but absent from the records: nothing to send
        if only_missed and parts.get(s) == {"tables"}:
            batch = dataclasses.replace(batch, metrics={})  # its scalars did arrive
        elif only_missed and parts.get(s) == {"scalars"}:
            batch = dataclasses.replace(batch, tensor_rows=(), events=())  # its rows did arrive
        try:
            try:
                tracker.log(batch)
            except queue.Full:  # a sync is not the training thread: wait for the worker instead
                if not isinstance(tracker, QueuedTracker):
                    raise
                tracker.flush()
                tracker.log(batch)
            sent.append(s)
        except Exception as exc:
            fail(s, exc)
    try:
        tracker.finish()
    except Exception as exc:
        fail(None, exc)
    for step, exc in tracker.take_failures():
        fail(step, exc)

    delivered = [s for s in sent if s not in failed]
    _rewrite_missed(run_dir, tracker.name, old, set(wanted), failed)
    return len(delivered)


def replay(run_dir: str | os.PathLike[str], tracker: Tracker, only_missed: bool = True) -> int:
    """Deprecated: the former name of :func:`sync_run` (removed in the next release)."""
    warnings.warn(
        "fp8track.trackers.replay.replay is deprecated: use sync_run (same arguments)",
        DeprecationWarning,
        stacklevel=2,
    )
    return sync_run(run_dir, tracker, only_missed=only_missed)


def _rewrite_missed(
    run_dir: Path, name: str, old: list[dict[str, Any]], attempted: set[int], failed: dict[int | None, str]
) -> None:
    """Keep old entries not attempted now, plus this sync's failures; remove the file if empty."""
    keep = [e for e in old if e.get("step") is not None and int(e["step"]) not in attempted]
    now = time.time()
    keep += [
        {"step": s, "what": "replay", "error": err, "time": now}
        for s, err in sorted(failed.items(), key=lambda kv: -1 if kv[0] is None else kv[0])
    ]
    path = missed_path(run_dir, name)
    if not keep:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(e) + "\n" for e in keep), encoding="utf-8")
    os.replace(tmp, path)


def missed_steps(run_dir: str | os.PathLike[str], tracker_name: str) -> list[int]:
    """Sorted distinct steps listed in a tracker's missed file."""
    return sorted({int(e["step"]) for e in read_missed(run_dir, tracker_name) if e.get("step") is not None})


def find_mlflow_run(client: Any, fp8track_run_id: str | None) -> str | None:
    """The MLflow run that already holds this fp8track run: the earliest run, in any experiment of
    ``client``'s store, tagged ``fp8track.run_id`` = ``fp8track_run_id`` (the tag every
    :class:`~fp8track.trackers.mlflow.MLflowTracker` run carries); None when there is none."""
    if not fp8track_run_id or "'" in fp8track_run_id:
        return None
    experiments = [e.experiment_id for e in client.search_experiments()]
    if not experiments:
        return None
    runs = client.search_runs(
        experiments, filter_string=f"tags.`fp8track.run_id` = '{fp8track_run_id}'",
        order_by=["attributes.start_time ASC"], max_results=1,
    )
    return runs[0].info.run_id if runs else None


def wandb_sync_id(fp8track_run_id: str) -> str:
    """The W&B run id ``fp8track sync --wandb-dir`` gives the run of a run directory: derived from
    its ``fp8track.run_id``, so a second sync finds (and resumes) the same run."""
    return "fp8track-" + re.sub(r"[^A-Za-z0-9_-]", "-", fp8track_run_id)[:48]


def find_wandb_run(wandb_dir: str | os.PathLike[str], wandb_run_id: str) -> Path | None:
    """The local folder of the W&B run ``wandb_run_id`` under ``<wandb_dir>/wandb`` (offline
    ``offline-run-<time>-<id>``, online ``run-<time>-<id>``), the earliest; None when there is none."""
    found = sorted(Path(wandb_dir, "wandb").glob(f"*run-*-{wandb_run_id}"))
    return found[0] if found else None


def sync_mlflow(
    run_dir: str | os.PathLike[str],
    tracking_uri: str,
    *,
    run_id: str | None = None,
    experiment: str = "fp8track",
    tracker_name: str = "mlflow",
    all_steps: bool = False,
) -> dict[str, Any]:
    """``fp8track sync --mlflow-uri``: idempotent. Completes ``run_id``, else the run already tagged
    with the run directory's ``fp8track.run_id`` (:func:`find_mlflow_run`), with what it missed;
    with neither, a new run in ``experiment`` gets every step. A store that cannot be used (a server
    that does not answer, a missing database driver) is a :class:`~fp8track.errors.ConfigError`.

    Returns:
        ``run_id``, ``existing_run``, ``steps`` (delivered) and ``still_missed`` (steps).
    """
    from fp8track.optional import require
    from fp8track.trackers.mlflow import MLflowTracker

    meta = run_meta(run_dir)
    client = require("mlflow", "fp8track sync --mlflow-uri").MlflowClient(tracking_uri)
    try:  # one call first: an unreachable or refusing store is one line, not a traceback
        run_id = run_id or find_mlflow_run(client, meta.run_id)
        if run_id is not None:
            client.get_run(run_id)
    except Exception as exc:  # MLflow's, requests' and SQLAlchemy's errors have many types
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise ConfigError(
            f"--mlflow-uri {tracking_uri}: the MLflow store cannot be used "
            f"({type(exc).__name__}: {first}); check that the server runs and the URI is right"
        ) from None
    tracker = MLflowTracker(
        client=client, run_id=run_id, experiment_name=experiment,
        run_name=meta.name, name=tracker_name, background=False,
    )
    # A new run has seen nothing yet, so it gets every step; an existing one (named, or the run
    # an earlier sync or the training itself logged this run directory to) only what it missed,
    # so a second sync sends nothing twice.
    n = sync_run(run_dir, tracker, only_missed=run_id is not None and not all_steps)
    return {"run_id": tracker.run_id, "existing_run": run_id is not None, "steps": n,
            "still_missed": missed_steps(run_dir, tracker.name)}


def sync_wandb(
    run_dir: str | os.PathLike[str],
    wandb_dir: str | os.PathLike[str],
    *,
    run_id: str | None = None,
    project: str = "fp8track",
    mode: str = "offline",
    tracker_name: str = "wandb",
    all_steps: bool = False,
) -> dict[str, Any]:
    """``fp8track sync --wandb-dir``: idempotent. The run's id is derived from the run directory
    (:func:`wandb_sync_id`) unless ``run_id`` names one (an online run, resumed); when that run
    already exists (a folder under ``wandb_dir``, or the named run) only what is still missed is
    sent, so a second sync sends nothing twice and opens no second run.

    Returns:
        ``run_id``, ``run_dir`` (the W&B run's folder), ``existing_run``, ``steps`` (delivered)
        and ``still_missed`` (steps).
    """
    from fp8track.trackers.wandb import WandbTracker

    meta = run_meta(run_dir)
    wandb_id = run_id or wandb_sync_id(meta.run_id)
    previous = find_wandb_run(wandb_dir, wandb_id)
    existing = run_id is not None or previous is not None
    tracker = WandbTracker.create(
        project=project, name=meta.name, dir=str(wandb_dir), mode=mode,
        run_id=wandb_id, resume="must" if run_id else "allow", tracker_name=tracker_name,
        background=False, lazy=True,
    )  # fmt: skip
    n = sync_run(run_dir, tracker, only_missed=existing and not all_steps)
    where = tracker.run.dir if tracker.opened else previous
    return {"run_id": wandb_id, "run_dir": str(where), "existing_run": existing, "steps": n,
            "still_missed": missed_steps(run_dir, tracker.name)}
