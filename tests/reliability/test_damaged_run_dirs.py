"""Run directories that are damaged or shared: ``fp8track diagnose`` lists every damaged line and
every missing record file (diagnosis.json, report.html, the terminal), not only the first; two
processes writing one run directory are refused before the second writes a line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import fp8track
from fp8track.monitoring.records import RunMeta, RunReader


def train(log_dir: Path, recipe: str | None, run_id: str, steps: int = 60) -> Path:
    """A small MLP trained ``steps`` steps under the plain monitor (same seed and batches)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    report = fp8track.apply_fp8(model, recipe, backend="emulated") if recipe else None
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    with fp8track.Monitor(model, {"every_n_steps": 5}, log_dir=log_dir, trackers="none",
                          meta=RunMeta(run_id=run_id, name=run_id), apply_report=report) as mon:
        for _ in range(steps):
            x = torch.randn(32, 16, generator=g)
            loss = (model(x) - x[:, :1]).pow(2).mean()
            loss.backward()
            opt.step()
            mon.step(loss=loss)
            opt.zero_grad()
    return mon.run_dir


def damage(path: Path, lines: list[int]) -> None:
    """Overwrite the given 1-based lines with bytes that are not JSON."""
    text = path.read_bytes().splitlines(keepends=True)
    for n in lines:
        text[n - 1] = b"\x00garbage{\n"
    path.write_bytes(b"".join(text))


def test_diagnose_lists_every_damaged_line_and_missing_file(tmp_path):
    fp8 = train(tmp_path / "runs", "current", "fp8run")
    control = train(tmp_path / "runs", None, "bf16run")
    damage(fp8 / "metrics.jsonl", [5, 17, 30])
    damage(control / "tensor_stats.jsonl", [2, 9])
    (fp8 / "events.jsonl").unlink()

    proc = subprocess.run(
        [sys.executable, "-m", "fp8track.cli", "diagnose", str(fp8), "--baseline", str(control),
         "--out", "out"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    problems = json.loads((tmp_path / "out" / "diagnosis.json").read_text())["data_problems"]
    by_file = {p["file"]: p for p in problems["fp8"]}
    assert by_file["metrics.jsonl"]["damaged_lines"] == 3 and by_file["metrics.jsonl"]["lines"] == [5, 17, 30]
    assert by_file["metrics.jsonl"]["kinds"] == {"corrupt_line": 3}
    assert by_file["events.jsonl"]["missing"] is True and set(by_file) == {"metrics.jsonl", "events.jsonl"}
    (ctl,) = problems["control"]
    assert (ctl["file"], ctl["damaged_lines"], ctl["lines"]) == ("tensor_stats.jsonl", 2, [2, 9])
    html = (tmp_path / "out" / "report.html").read_text()
    assert 'id="data-problems"' in html and "3 damaged line(s) skipped (5, 17, 30)" in html
    assert "events.jsonl: missing" in html and "tensor_stats.jsonl: 2 damaged line(s) skipped (2, 9)" in html
    assert "damaged records in the FP8 run" in proc.stdout and "damaged records in the control" in proc.stdout


def test_a_whole_run_read_without_damage_reports_none(tmp_path):
    run = train(tmp_path / "runs", None, "clean", steps=12)
    reader = RunReader(run)
    list(reader.metrics()), list(reader.tensor_stats()), list(reader.events())
    assert reader.problems == []


def test_a_missing_tensor_stats_file_is_said(tmp_path):
    run = train(tmp_path / "runs", None, "nostats", steps=12)
    (run / "tensor_stats.jsonl").unlink()
    from fp8track.analysis.baseline import load_run

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data = load_run(run)
    assert data.problems == [{"file": "tensor_stats.jsonl", "missing": True, "damaged_lines": 0, "lines": [],
                              "kinds": {}, "detail": "the run directory has no tensor_stats.jsonl"}]
    assert any("tensor_stats.jsonl: missing_file" in str(w.message) for w in caught)


HOLDER = textwrap.dedent(
    """
    import sys, torch
    import fp8track
    from fp8track.monitoring.records import RunMeta
    mon = fp8track.Monitor(torch.nn.Linear(4, 4), log_dir=sys.argv[1], trackers="none",
                           meta=RunMeta(run_id="shared")).attach()
    print("attached", flush=True)
    sys.stdin.readline()   # hold the run directory until the test says so
    mon.close()
    """
)


def test_a_second_writer_process_is_refused_before_it_writes(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "attached"
        before = (tmp_path / "shared" / "metrics.jsonl").read_bytes()
        second = fp8track.Monitor(torch.nn.Linear(4, 4), log_dir=tmp_path, trackers="none",
                                  meta=RunMeta(run_id="shared"))
        with pytest.raises(fp8track.ConfigError, match=rf"another process \(pid {holder.pid} on "):
            second.attach()
        assert (tmp_path / "shared" / "metrics.jsonl").read_bytes() == before
    finally:
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.wait(timeout=120)
    assert holder.returncode == 0
    # once the first writer is gone (closed or dead: the kernel drops its lock) the directory is free
    again = fp8track.Monitor(torch.nn.Linear(4, 4), log_dir=tmp_path, trackers="none",
                             meta=RunMeta(run_id="shared")).attach()
    again.close()


def test_an_earlier_monitor_of_the_same_process_is_warned_about(tmp_path):
    first = fp8track.Monitor(torch.nn.Linear(4, 4), log_dir=tmp_path, trackers="none",
                             meta=RunMeta(run_id="twice")).attach()
    with pytest.warns(RuntimeWarning, match="still open in an earlier monitor of this process"):
        second = fp8track.Monitor(torch.nn.Linear(4, 4), log_dir=tmp_path, trackers="none",
                                  meta=RunMeta(run_id="twice")).attach()
    second.close()
    first.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # closed: no warning any more
        fp8track.Monitor(torch.nn.Linear(4, 4), log_dir=tmp_path, trackers="none",
                         meta=RunMeta(run_id="twice")).attach().close()
