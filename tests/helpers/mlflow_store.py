"""One MLflow SQLite store shared by the tests of a session (``mlflow_store`` fixture in
tests/conftest.py): creating a store runs MLflow's schema migrations (about a second), a new
experiment in an existing store takes milliseconds. Each test names its experiments through
:meth:`MlflowStore.experiment`, so its runs never meet another test's."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class MlflowStore:
    """``uri``: the shared ``sqlite:///`` store; ``prefix``: this test's own experiment-name prefix."""

    uri: str
    prefix: str

    def experiment(self, name: str = "fp8track") -> str:
        """The name of this test's experiment ``name`` (created by whoever logs to it first)."""
        return f"{self.prefix}/{name}"


def create_store(uri: str) -> str:
    """Create the store's schema now (one process, before any test or subprocess races to)."""
    from mlflow import MlflowClient

    MlflowClient(uri).search_experiments()
    return uri


def experiment_prefix(nodeid: str) -> str:
    """An experiment-name prefix from a test id: unique per test, readable in the MLflow UI."""
    return re.sub(r"[^A-Za-z0-9_.\-\[\]/]", "_", nodeid)
