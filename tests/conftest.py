import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from fp8track.numerics import kernel_policy

from helpers import allocator, file_order, subprocesses

allocator.keep_freed_heap()  # before any test allocates: see helpers/allocator.py

# The tests' own processes run the statistics kernel the user chose (default "auto": each worker
# compiles it once and every test file reuses it). Processes the tests start (trial
# programs, torchrun ranks, the CLI) run the eager kernel: a fresh process spends about 5 s of CPU
# compiling it, more than a run of a few dozen sampled steps saves. The compiled and AOT kernels
# are tested in-process (test_stats*, test_aot_kernels, test_compile); the demo test runs the CLI
# with the user's default (helpers.subprocesses.user_default_env).
kernel_policy.set_compile(subprocesses.choose_stats_kernels())


def pytest_configure(config: pytest.Config) -> None:
    out = os.environ.get("FP8TRACK_RECORD_FILE_DURATIONS")
    if out:
        config.pluginmanager.register(file_order.DurationRecorder(Path(out)), "fp8track-file-durations")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest files first (helpers/file_order.py): with ``--no-loadscope-reorder`` the xdist
    workers take them in this order and finish together."""
    items[:] = file_order.longest_files_first(items, file_order.read_durations())


@contextmanager
def _environment_restored() -> Iterator[None]:
    """``os.environ`` as it was on entry, put back on exit (what the body exported is dropped)."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True, scope="module")
def _restore_environment_per_module():
    """What a module-scoped fixture exports (Lightning's MLFlowLogger sets ``MLFLOW_TRACKING_URI``,
    WandbLogger ``WANDB_MODE``) stays inside its test file: with the files reordered longest first,
    a later file's subprocess would otherwise inherit it."""
    with _environment_restored():
        yield


@pytest.fixture(autouse=True)
def _run_in_tmp_path(tmp_path):
    """Every test runs in its own directory, so library defaults that write to the working
    directory (MLflow's ./mlruns artifact root, wandb/, lightning_logs/) stay out of the checkout.
    The environment is restored afterwards: ``mlflow.set_tracking_uri`` (called by Lightning's
    MLFlowLogger) exports ``MLFLOW_TRACKING_URI``, which a later test's subprocess would inherit.
    No ``monkeypatch`` here: a test's own monkeypatch is then undone before this restore, not
    after it (its undo would put back a value a fixture had exported)."""
    cwd = os.getcwd()
    os.chdir(tmp_path)
    with _environment_restored():
        yield
    os.chdir(cwd)


def _install_chromium() -> str | None:
    """Debian's chromium, installed with apt on CI or as root when missing (the project's own test
    set-up: the report test renders report.html in it). Returns the binary or None."""
    import os
    import shutil
    import subprocess

    for name in ("chromium", "chromium-browser"):
        if shutil.which(name):
            return shutil.which(name)
    allowed = os.environ.get("CI") == "true" or (hasattr(os, "geteuid") and os.geteuid() == 0)
    if not allowed or not shutil.which("apt-get"):
        return None
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        subprocess.run(["apt-get", "update"], check=True, capture_output=True, timeout=600, env=env)
        subprocess.run(
            ["apt-get", "install", "-y", "chromium"], check=True, capture_output=True, timeout=900, env=env
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return shutil.which("chromium")


@pytest.fixture(scope="session")
def chromium():
    """Path of a headless-capable Chromium; skips (with the reason) only when it cannot be installed."""
    path = _install_chromium()
    if path is None:
        pytest.skip(
            "chromium is not installed and could not be installed with apt-get (needs root or CI=true)"
        )
    return path


@pytest.fixture(scope="session")
def _mlflow_db(tmp_path_factory) -> str:
    pytest.importorskip("mlflow")
    from helpers.mlflow_store import create_store

    return create_store(f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}")


@pytest.fixture
def mlflow_store(_mlflow_db, request):
    """The session's shared MLflow SQLite store and this test's experiment names
    (:class:`helpers.mlflow_store.MlflowStore`)."""
    from helpers.mlflow_store import MlflowStore, experiment_prefix

    return MlflowStore(_mlflow_db, experiment_prefix(request.node.nodeid))
