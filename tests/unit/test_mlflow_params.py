"""The monitor's own MLflow params are short and only those that apply (issue 21, item 7): a BF16
control carries no delayed-scaling history, the FP8 layer list is a tag, not a compare-view axis."""

from __future__ import annotations

from pathlib import Path

import pytest

from fp8track.execution.recipes import Recipe
from fp8track.trackers.mlflow import applicable_recipe_fields


@pytest.mark.parametrize(
    ("recipe", "keys"),
    [
        ("bf16", {"name"}),
        (
            "delayed:hybrid:h16:max",
            {"name", "fp8_format", "amax_history_len", "amax_compute_algo", "margin", "gemm"},
        ),
        ("current", {"name", "fp8_format", "margin", "gemm", "variant"}),
        ("mxfp8", {"name", "fp8_format", "gemm"}),
        ("block", {"name", "fp8_format", "gemm"}),
    ],
)
def test_recipe_params_are_only_the_fields_the_recipe_uses(recipe: str, keys: set[str]) -> None:
    fields = applicable_recipe_fields(Recipe.parse(recipe).to_dict())
    assert set(fields) == keys
    assert Recipe.from_dict(fields) == Recipe.parse(recipe)  # nothing needed to rebuild it was dropped


def test_monitor_run_params_in_mlflow(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from fp8track.monitoring.records import RunMeta
    from fp8track.trackers.mlflow import MLflowTracker

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    names = [f"model.blocks.{i}.mlp.fc" for i in range(6)]
    for recipe, bf16, fp8 in (("bf16", names, []), ("current", names[:1], names[1:])):
        t = MLflowTracker(tracking_uri=uri, experiment_name="p", background=False, heatmap=False)
        t.start(
            RunMeta(run_id=recipe, recipe=Recipe.parse(recipe).to_dict(), bf16_layers=bf16, fp8_layers=fp8)
        )
        run = MlflowClient(uri).get_run(t.run_id)
        p, tags = run.data.params, run.data.tags
        assert "fp8.fp8_layers" not in p and tags["fp8.fp8_layers"] == (",".join(fp8) or "none")
        assert p["fp8.n_bf16_layers"] == str(len(bf16))
        assert ("fp8.recipe.amax_history_len" in p) is False  # neither bf16 nor current keeps a history
