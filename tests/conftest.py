import pytest


@pytest.fixture(autouse=True)
def _run_in_tmp_path(tmp_path, monkeypatch):
    """Every test runs in its own directory, so library defaults that write to the working
    directory (MLflow's ./mlruns artifact root, wandb/, lightning_logs/) stay out of the checkout."""
    monkeypatch.chdir(tmp_path)
