"""The ``wandb sync`` line ``fp8track sweep --wandb`` prints names the folders W&B really wrote.

The sweep sets ``WANDB_DIR=<out>/wandb``; W&B 0.31 writes ``$WANDB_DIR/wandb/offline-run-*``, so
the line printed before (``wandb sync <out>/wandb/offline-run-*``) matched nothing (measured on a
plain-loop sweep with ``wandb.init()``: 9 runs under ``<out>/wandb/wandb/``, none under the glob)."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp8track.cli.sweep import wandb_runs_line


def test_the_sync_line_globs_the_runs_a_program_wrote_under_wandb_dir(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    root = tmp_path / "wandb"
    root.mkdir()
    env = {**os.environ, "WANDB_DIR": str(root), "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    code = "import wandb; r = wandb.init(project='p'); r.log({'x': 1}); r.finish()"
    subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, check=True, timeout=120)
    written = {str(p) for p in root.rglob("offline-run-*") if p.is_dir()}
    assert len(written) == 1
    line = wandb_runs_line(root)
    globs = line.split("wandb sync ", 1)[1].rstrip(")").split()
    assert {m for g in globs for m in glob.glob(g)} == written, line


def test_no_run_says_so(tmp_path: Path) -> None:
    assert "none under" in wandb_runs_line(tmp_path / "wandb")
