"""Shorten lines over the ruff line length (E501) without reformatting whole files.

For every E501 line that ruff reports in the given files, run ``ruff format --range`` on that
line only: ruff then reformats just the statement enclosing it, so the rest of the file keeps
its layout. Lines ruff format cannot shorten (long strings, comments, docstrings) are listed at
the end; rewrap those by hand.

Usage: ``python tools/fix_long_lines.py FILE_OR_DIR ...`` (``--check`` only lists what is long).
Runs ruff with the interpreter that runs this script (``python -m ruff``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import defaultdict


def long_lines(paths: list[str]) -> dict[str, list[int]]:
    """Map each file to its E501 line numbers (1-based, ascending), as ruff reports them."""
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--select", "E501", "--output-format", "json", *paths],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode not in (0, 1):
        raise SystemExit(f"ruff check failed: {proc.stderr.strip()}")
    found: dict[str, set[int]] = defaultdict(set)
    for item in json.loads(proc.stdout or "[]"):
        found[item["filename"]].add(item["location"]["row"])
    return {name: sorted(rows) for name, rows in found.items()}


def format_line(path: str, row: int) -> None:
    """Let ruff format the statement around ``row`` of ``path`` (the range end is exclusive)."""
    subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--quiet", f"--range={row}:1-{row + 1}:1", path],
        check=False,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="files or folders to fix")
    parser.add_argument("--check", action="store_true", help="only list the long lines")
    args = parser.parse_args(argv)
    if not args.check:
        for path, rows in long_lines(args.paths).items():
            # Bottom-up, so that reformatting one statement does not move the rows still to do.
            for row in reversed(rows):
                format_line(path, row)
    remaining = long_lines(args.paths)
    for path, rows in sorted(remaining.items()):
        for row in rows:
            print(f"{path}:{row}: still over the line length (string, comment or docstring?)")
    return 1 if remaining else 0


if __name__ == "__main__":
    sys.exit(main())
