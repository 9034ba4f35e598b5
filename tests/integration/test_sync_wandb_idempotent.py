"""``fp8track sync --wandb-dir`` twice makes one W&B run, not two: the run id comes from the run
directory (``fp8track-<run id>``); a second sync finds it and sends only what is still missed
(offline runs read back with ``wandb leet inspect --json``)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from fp8track.cli import main
from fp8track.monitoring.records import MetricsRecord, RunMeta, RunWriter
from fp8track.trackers.fanout import missed_path

pytestmark = pytest.mark.slow

pytest.importorskip("wandb")

from helpers.wandb_records import history, inspect  # noqa: E402


def write_steps(run_dir: Path, steps, resume: int | None = None) -> None:
    writer = RunWriter(run_dir, RunMeta(run_id="idem42", name="idem"), resume_step=resume)
    for s in steps:
        writer.write_metrics(MetricsRecord(s, {"fp8/loss": 3.0 - s / 10}))
    writer.close()


def sync(run_dir: Path, wandb_dir: Path, capsys) -> dict:
    capsys.readouterr()
    assert main(["sync", str(run_dir), "--wandb-dir", str(wandb_dir)]) == 0
    return json.loads(capsys.readouterr().out)["wandb"]


def logged_steps(offline: Path) -> list[int]:
    return [int(h["trainer/global_step"]) for h in history(inspect(offline)) if "fp8/loss" in h]


def test_second_sync_adds_no_run_and_a_later_one_only_the_missed_steps(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir, wandb_dir = tmp_path / "run", tmp_path / "wb"
    write_steps(run_dir, range(6))

    first = sync(run_dir, wandb_dir, capsys)
    assert (first["run_id"], first["existing_run"], first["steps"]) == ("fp8track-idem42", False, 6)
    (offline,) = (wandb_dir / "wandb").glob("offline-run-*")
    assert offline.name.endswith("-fp8track-idem42") and logged_steps(offline) == [0, 1, 2, 3, 4, 5]

    second = sync(run_dir, wandb_dir, capsys)
    assert (second["existing_run"], second["steps"], second["still_missed"]) == (True, 0, [])
    assert second["run_dir"] == str(offline)
    assert list((wandb_dir / "wandb").glob("offline-run-*")) == [offline]  # no second run

    # The training goes on (resumed) and its tracker misses steps 6 and 7: a third sync sends
    # exactly those, under the same run id (W&B's `wandb sync` merges them into one run).
    write_steps(run_dir, range(6, 8), resume=6)
    missed = missed_path(run_dir, "wandb")
    missed.parent.mkdir(parents=True, exist_ok=True)
    missed.write_text("".join(json.dumps({"step": s, "what": "log", "error": "x", "time": time.time()}) + "\n"
                              for s in (6, 7)))
    third = sync(run_dir, wandb_dir, capsys)
    assert (third["existing_run"], third["steps"], third["still_missed"]) == (True, 2, [])
    runs = sorted((wandb_dir / "wandb").glob("offline-run-*"))
    # W&B names a run's folder offline-run-<second>-<id>, with "-1" added when a sync in the same
    # second took that name already.
    assert len(runs) == 2 and all(re.search(r"-fp8track-idem42(-\d+)?$", r.name) for r in runs), runs
    steps = [s for r in runs for s in logged_steps(r)]
    assert sorted(steps) == list(range(8))  # every step once over the run's two offline parts
