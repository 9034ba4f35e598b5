"""The monitor's own MLflow params are short and only those that apply (issue 21, item 7): a BF16
control or a current-scaling run carries no delayed-scaling history, the layer lists are tags (a
comma list on a compare-view axis is cut to a few characters), the monitor's settings and the
apply report are the ``fp8track_meta.json`` artifact, read back by ``read_mlflow_run``."""

from __future__ import annotations

import pytest
from torch import nn

from fp8track.execution.apply import apply_fp8
from fp8track.execution.recipes import Recipe
from fp8track.monitoring.monitor import run_meta_for
from fp8track.monitoring.records import RunMeta
from fp8track.trackers.mlflow import applicable_recipe_fields, name_list, run_params, run_tags

SETUP = {  # precision_setup of the model below with no optimizer (fused_optimizer None: not a param)
    "fp8track.precision.fp8_weights": "False",
    "fp8track.precision.activation_checkpointing": "False",
    "fp8track.precision.torch_compile": "False",
}


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
        (
            "nvfp4:no_rht",
            {"name", "fp8_format", "disable_rht", "disable_stochastic_rounding", "disable_2d_quantization"},
        ),
    ],
)
def test_recipe_params_are_only_the_fields_the_recipe_uses(recipe: str, keys: set[str]) -> None:
    fields = applicable_recipe_fields(Recipe.parse(recipe).to_dict())
    assert set(fields) == keys
    assert Recipe.from_dict(fields) == Recipe.parse(recipe)  # nothing needed to rebuild it was dropped


def _meta(recipe: str, spec: str) -> RunMeta:
    """A real apply_fp8 report on 3 linears (0: 16->32, 2: 32->32, 3: 32->8) and its run meta, with
    the monitor's settings in the config as the frontends put them."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 8))
    report = apply_fp8(model, recipe, bf16_layers=spec, backend="emulated")
    config = {"monitor": {"spikes": {"z_threshold": 6.0}, "steps": []}}
    return run_meta_for(model, config=config, report=report)


EXPECTED = {
    # the BF16 control: every layer in BF16, no FP8 field
    ("bf16", "none"): {"fp8.recipe.name": "bf16", "fp8.n_bf16_layers": "3", "fp8.n_fp8_layers": "0"},
    ("current", "last:1"): {
        "fp8.recipe.name": "current", "fp8.recipe.fp8_format": "hybrid", "fp8.recipe.margin": "0",
        "fp8.recipe.gemm": "auto", "fp8.recipe.variant": "tensorwise",
        "fp8.n_bf16_layers": "1", "fp8.n_fp8_layers": "2",
    },
    ("delayed:hybrid:h16:max", "first:1"): {
        "fp8.recipe.name": "delayed", "fp8.recipe.fp8_format": "hybrid", "fp8.recipe.amax_history_len": "16",
        "fp8.recipe.amax_compute_algo": "max", "fp8.recipe.margin": "0", "fp8.recipe.gemm": "auto",
        "fp8.n_bf16_layers": "1", "fp8.n_fp8_layers": "2",
    },
}  # fmt: skip


@pytest.mark.parametrize(("recipe", "spec"), list(EXPECTED))
def test_exact_param_set_of_a_control_a_current_and_a_delayed_run(recipe: str, spec: str) -> None:
    meta = _meta(recipe, spec)
    assert run_params(meta) == {**EXPECTED[recipe, spec], "fp8.backend": "emulated", **SETUP}
    tags = run_tags(meta)
    assert tags["fp8.bf16_layers"] == ",".join(meta.bf16_layers)
    assert tags["fp8.fp8_layers"] == (",".join(meta.fp8_layers) or "none")
    assert tags["fp8.recipe"] == recipe.split(":")[0]


def test_a_run_without_apply_fp8_has_no_layer_counts() -> None:
    meta = RunMeta(config={"precision": {"recipe": None, "torch_compile": True, "fused_optimizer": None}})
    assert run_params(meta) == {"fp8track.precision.torch_compile": "True"}


def test_long_layer_lists_are_cut_at_a_whole_name_with_the_count_left_out() -> None:
    names = [f"model.layers.{i}.mlp.down_proj" for i in range(1000)]  # 28-29 characters each
    text = name_list(names, limit=100)
    kept, more = text.split(" (+")
    assert len(text) <= 100 and kept.split(",") == names[: len(kept.split(","))]
    assert int(more.split()[0]) == 1000 - len(kept.split(","))
    assert len(kept.split(",")) == 3  # 3 names + commas = 88 characters; a fourth would need 117
    assert name_list([]) == "none" and name_list(names[:2]) == ",".join(names[:2])


def test_monitor_run_params_in_mlflow_and_read_back(mlflow_store) -> None:
    """Through a real MLflowTracker into SQLite: the params are exactly :func:`run_params`, the layer
    lists are tags, and the config (monitor settings, apply report) comes back from the artifact."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from fp8track.trackers.mlflow import MLflowTracker, read_mlflow_run

    uri = mlflow_store.uri
    for recipe, spec in EXPECTED:
        meta = _meta(recipe, spec)
        t = MLflowTracker(tracking_uri=uri, experiment_name=mlflow_store.experiment("p"), background=False,
                          heatmap=False)
        t.start(meta)
        run = MlflowClient(uri).get_run(t.run_id)
        assert run.data.params == {**EXPECTED[recipe, spec], "fp8.backend": "emulated", **SETUP}
        assert run.data.tags["fp8.fp8_layers"] == (",".join(meta.fp8_layers) or "none")
        back = read_mlflow_run(t.run_id, uri).meta
        assert back["config"]["monitor"] == {"spikes": {"z_threshold": 6.0}, "steps": []}
        assert back["config"]["apply"]["fp8_layers"] == list(meta.fp8_layers)
        assert back["config"]["precision"]["recipe"] == str(Recipe.parse(recipe))
        assert Recipe.from_dict(back["recipe"]) == Recipe.parse(recipe)


def test_an_unwritable_artifact_store_costs_only_the_meta_artifact(mlflow_store) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from fp8track.trackers.mlflow import META_ARTIFACT, MLflowTracker

    uri = mlflow_store.uri
    t = MLflowTracker(tracking_uri=uri, experiment_name=mlflow_store.experiment("ro"),
                      artifact_location="/proc/fp8track-no-such-dir", background=False, heatmap=False)
    t.start(_meta("current", "last:1"))  # does not raise
    assert MlflowClient(uri).get_run(t.run_id).data.params["fp8.n_fp8_layers"] == "2"
    assert any(META_ARTIFACT in n and "not written" in n for n in t.take_notices())
