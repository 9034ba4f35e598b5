"""Reading offline W&B runs back through W&B's own reader (``wandb leet inspect --json``) and the
increment files of its incremental tables."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def inspect(run_dir: str | Path) -> list[dict]:
    """Every record of an offline run, via W&B's own reader (``wandb leet inspect --json``)."""
    exe = Path(sys.executable).with_name("wandb")
    out = subprocess.run(
        [str(exe), "leet", "inspect", str(run_dir), "--json"],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def history(records: list[dict]) -> list[dict]:
    """The history rows (one per ``run.log``) of :func:`inspect`'s records, in order."""
    return [r["history"]["item"] for r in records if r["type"] == "history"]


def table_rows(run_dir: Path, key: str) -> list[list]:
    """All rows of an incremental table: the union of its increment files."""
    rows = []
    for f in sorted((run_dir / "files" / "media" / "table").glob(f"{key}_*.table.json")):
        rows += json.loads(f.read_text())["data"]
    return rows
