"""Longest test files first, so two xdist workers finish together.

``make test`` runs ``pytest -n 2 --dist loadfile --no-loadscope-reorder``: each worker takes a whole
file at a time, in collection order. xdist's default order (most tests first) puts the many small
unit files first and the few long integration files last, where one of them can keep a worker busy
for minutes after the other has run out of work. Sorting files by their expected seconds, longest
first, is the classic longest-processing-time rule: the last files handed out are short, so the
workers end within a short file of each other.

Expected seconds come from ``tests/file_durations.json`` (per file, measured on the 2-core CI
machine by ``FP8TRACK_RECORD_FILE_DURATIONS=tests/file_durations.json make test``); a file not in it
is estimated from its tests: :data:`SLOW_TEST_S` per ``slow``-marked test, :data:`TEST_S` per other.
Hand-written because pytest-xdist orders by test count only and pytest-split needs its own
duration format and a fixed group count.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

DURATIONS = Path(__file__).resolve().parents[1] / "file_durations.json"
SLOW_TEST_S = 30.0
TEST_S = 0.5


def file_of(nodeid: str) -> str:
    """``tests/unit/test_x.py::test_y[1]`` -> ``tests/unit/test_x.py``."""
    return nodeid.split("::", 1)[0]


def estimated_seconds(items: Iterable[pytest.Item], measured: Mapping[str, float]) -> dict[str, float]:
    """Seconds each file is expected to take: measured where known, else estimated from its marks."""
    estimate: dict[str, float] = defaultdict(float)
    for item in items:
        estimate[file_of(item.nodeid)] += SLOW_TEST_S if item.get_closest_marker("slow") else TEST_S
    return {f: float(measured.get(f, s)) for f, s in estimate.items()}


def longest_files_first(items: list[pytest.Item], measured: Mapping[str, float]) -> list[pytest.Item]:
    """``items`` grouped by file, files by expected seconds (longest first, ties by path); the
    order of tests inside a file is kept."""
    seconds = estimated_seconds(items, measured)
    rank = {f: i for i, f in enumerate(sorted(seconds, key=lambda f: (-seconds[f], f)))}
    return sorted(items, key=lambda item: rank[file_of(item.nodeid)])  # stable: in-file order kept


def read_durations(path: Path = DURATIONS) -> dict[str, float]:
    return json.loads(path.read_text()) if path.exists() else {}


class DurationRecorder:
    """Sums each file's setup, call and teardown seconds from the test reports (on the xdist
    controller they arrive from every worker) and writes ``{file: seconds}`` at the end."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[file_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if hasattr(session.config, "workerinput"):  # an xdist worker: the controller writes
            return
        rounded = {f: round(s, 1) for f, s in sorted(self.seconds.items())}
        self.out.write_text(json.dumps(rounded, indent=1) + "\n")
