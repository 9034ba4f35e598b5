"""Pure helpers of the adapters: MLflow key sanitising, heatmap matrix, TE stat-name parsing."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fp8track.monitoring.records import TensorStatsRow
from fp8track.trackers.mlflow import flatten, heatmap_figure, heatmap_matrix, sanitize_key
from fp8track.trackers.nvdlfw import TEStat, parse_te_stat_name, scalar_name


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ("fp8/blocks.0.attn/activation/underflow_pct", "fp8/blocks.0.attn/activation/underflow_pct"),
        ("fp8/fc1/gradient/underflows%", "fp8/fc1/gradient/underflows_pct"),
        ("loss", "loss"),
        ("a:b(c)[d]", "a_b_c__d_"),
        ("/lead", "_/lead"),
        ("a//b", "a/_/b"),
        ("./a/../b", "_/a/_/b"),
        ("a b-c.d", "a b-c.d"),
    ],
)
def test_sanitize_key_exact(raw, key):
    assert sanitize_key(raw) == key


def test_sanitize_key_long_names_stay_distinct_and_valid():
    a = "fp8/" + "x" * 300 + "/a"
    b = "fp8/" + "y" + "x" * 299 + "/a"
    ka, kb = sanitize_key(a), sanitize_key(b)
    assert len(ka) == len(kb) == 250
    assert ka != kb and ka.endswith("x/a")


def test_sanitized_keys_pass_mlflow_validation():
    from mlflow.utils.validation import _validate_metric_name

    for raw in ["fp8/x%/y", "/a//b/./c:d", "q" * 400, "fp8/l 0/weight/mse"]:
        _validate_metric_name(sanitize_key(raw))  # raises MlflowException when invalid


def test_flatten():
    assert flatten(
        "fp8.recipe", {"name": "delayed", "amax": {"len": 16, "algo": "max"}, "layers": ["a", "b"]}
    ) == {
        "fp8.recipe.name": "delayed",
        "fp8.recipe.amax.len": "16",
        "fp8.recipe.amax.algo": "max",
        "fp8.recipe.layers": "a,b",
    }


def _row(step, layer, tensor, variant="actual", **stats):
    return TensorStatsRow(step=step, layer=layer, tensor=tensor, stats=stats, variant=variant)


def test_heatmap_matrix_hand_worked():
    rows = [
        _row(20, "fc1", "activation", underflow_pct=3.0),
        _row(10, "fc1", "activation", underflow_pct=1.0),
        _row(10, "fc2", "gradient", underflow_pct=5.0),
        _row(10, "fc2", "gradient", variant="mxfp8", underflow_pct=99.0),  # other variant: ignored
        _row(20, "fc2", "weight", mse=1.0),  # no underflow: ignored
    ]
    labels, steps, m = heatmap_matrix(rows, "underflow_pct")
    assert labels == ["fc1/activation", "fc2/gradient"]
    assert steps == [10, 20]
    np.testing.assert_array_equal(m[0], [1.0, 3.0])
    assert m[1, 0] == 5.0 and math.isnan(m[1, 1])


def test_heatmap_figure_panels():
    rows = [
        _row(s, f"l{i}", "weight", underflow_pct=float(i), mse=10.0**-i) for s in range(3) for i in range(4)
    ]
    fig = heatmap_figure(rows)
    assert [ax.get_title() for ax in fig.axes if ax.get_title()] == [
        "underflow_pct by layer over steps",
        "log10(mse) by layer over steps",
    ]
    mse_img = fig.axes[1].images[0].get_array()
    np.testing.assert_allclose(mse_img[:, 0], [0.0, -1.0, -2.0, -3.0])
    assert heatmap_figure([_row(0, "a", "weight", amax=1.0)]) is None


@pytest.mark.parametrize(
    ("name", "parsed"),
    [
        (
            "model.layers.3.mlp.fc1_gradient_underflows%",
            TEStat("model.layers.3.mlp.fc1", "gradient", "underflow_pct"),
        ),
        ("fc1_activation_overflows%", TEStat("fc1", "activation", "overflow_pct")),
        ("decoder.layernorm_qkv_activation_mse", TEStat("decoder.layernorm_qkv", "activation", "mse")),
        ("Layer_3_weight_cur_amax", TEStat("Layer_3", "weight", "amax")),
        (
            "x_weight_proj_activation_dynamic_range",
            TEStat("x_weight_proj", "activation", "dynamic_range_log2"),
        ),
        ("a_activation_fp8_delayed_scaling_overflows%", TEStat("a", "activation", "overflow_pct", "delayed")),
        ("a_gradient_fp8_current_scaling_underflows%", TEStat("a", "gradient", "underflow_pct", "current")),
        (
            "b.proj_activation_mxfp8_scale_inv_min_columnwise",
            TEStat("b.proj", "activation", "scale_inv_min", "mxfp8_columnwise"),
        ),
        ("b_weight_fp8_block_scaling_mse", TEStat("b", "weight", "mse", "block")),
        ("b_activation_nvfp4_underflows%", TEStat("b", "activation", "underflow_pct", "nvfp4")),
        ("c_wgrad_max", TEStat("c", "wgrad", "max")),
        (
            "c_activation_max_blockwise_dynamic_range_block_size_32_dims_1_max_over_orientations",
            TEStat(
                "c", "activation", "max_blockwise_dynamic_range_block_size_32_dims_1_max_over_orientations"
            ),
        ),
    ],
)
def test_parse_te_stat_name(name, parsed):
    assert parse_te_stat_name(name) == parsed


def test_parse_rejects_names_without_a_tensor():
    assert parse_te_stat_name("grad_norm") is None
    assert parse_te_stat_name("fc1_activation") is None  # no stat after the tensor


def test_scalar_name():
    assert scalar_name(TEStat("fc1", "gradient", "underflow_pct")) == "fp8/fc1/gradient/underflow_pct"
    assert scalar_name(TEStat("fc1", "activation", "mse", "mxfp8")) == "fp8/fc1/activation/mxfp8_mse"
    assert scalar_name(TEStat("fc1", "dgrad", "max")) is None
