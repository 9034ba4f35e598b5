"""Rules that used to be written twice now have one home: each test pins the shared behaviour."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fp8track.analysis import drift
from fp8track.monitoring import naming
from fp8track.numerics import scaling
from fp8track.numerics.formats import get_format
from fp8track.numerics.scaling import block_fake_quantize
from fp8track.numerics.stats import BLOCK_RECIPES, block_quant_stats, quant_stats


def test_statistics_report_the_current_scale_the_backends_use():
    # amax 3: 448 / 3 is not a float32; the statistic is the float32 scale TE and the emulated
    # backend compute (scaling.current_scale), so current scaling shows exactly zero drift.
    x = torch.tensor([1.0, -3.0, 0.5])
    s = quant_stats(x, "e4m3")
    cur = scaling.current_scale(torch.tensor(3.0), "e4m3")
    assert s["current_scale"] == float(cur) == float(np.float32(448.0) / np.float32(3.0))
    assert s["current_scale"] != 448.0 / 3.0
    assert s["scale"] == s["current_scale"] and s["scale_drift_log2"] == 0.0
    # margin and guards are the same rule too
    assert quant_stats(x, "e4m3", margin=2)["current_scale"] == float(
        scaling.current_scale(torch.tensor(3.0), "e4m3", 2)
    )
    assert quant_stats(torch.zeros(4), "e5m2")["current_scale"] == 1.0
    tiny = torch.tensor([1e-40])  # 448 / 1e-40 overflows float32: clamped to its max
    assert quant_stats(tiny, "e4m3")["current_scale"] == scaling.FLOAT32_MAX


def test_drift_has_one_definition():
    assert drift.drift_log2 is scaling.drift_log2
    s = quant_stats(torch.tensor([2.0, 1000.0]), "e4m3", scale=0.25)
    assert s["scale_drift_log2"] == scaling.drift_log2(0.25, s["current_scale"])
    assert quant_stats(torch.tensor([2.0]), "e4m3", scale=0.0)["scale_drift_log2"] == -math.inf


@pytest.mark.parametrize("layout", list(scaling.BLOCK_LAYOUTS))
def test_block_layouts_quantise_the_same_in_backend_and_statistics(layout):
    torch.manual_seed(0)
    x = torch.randn(130, 200) * torch.logspace(-3, 3, 200)  # columns of very different magnitude
    fmt = get_format("e4m3")
    deq, scales = block_fake_quantize(x, layout, fmt)
    stats = block_quant_stats(x, layout, "e4m3")
    assert stats["mse"] == pytest.approx(float(((x.double() - deq.double()) ** 2).mean()), rel=1e-9)
    assert stats["scale"] == float(scales.min())
    assert stats["underflow_pct"] == pytest.approx(100.0 * float(((x != 0) & (deq == 0)).sum()) / x.numel())


def test_block_vocabulary_is_one_table():
    assert BLOCK_RECIPES == tuple(scaling.BLOCK_LAYOUTS) == ("mxfp8", "block128", "block128x128")
    assert {
        t: scaling.block_layout("mxfp8", t) for t in ("activation", "weight", "gradient")
    } == dict.fromkeys(("activation", "weight", "gradient"), "mxfp8")
    assert [scaling.block_layout("block", t) for t in ("activation", "weight", "gradient")] == [
        "block128",
        "block128x128",
        "block128",
    ]
    with pytest.raises(ValueError, match="'delayed'.*'mxfp8', 'block'"):
        scaling.block_layout("delayed", "weight")


def test_one_name_sanitiser_for_metrics_and_tracker_keys():
    from fp8track.trackers import mlflow

    assert mlflow.sanitize_key is naming.sanitize_key
    # MLflow rejects "." and ".." segments; the metric-name builder used to let them through
    assert naming.run_metric("..", "x") == "fp8/_/x"
    assert naming.metric_name("blocks..0", "weight", ".") == "fp8/blocks..0/weight/_"
    long = naming.metric_name("layer" * 80, "weight", "mse")
    assert long == naming.sanitize_key("fp8/" + "layer" * 80 + "/weight/mse")
    assert len(long) == naming.MAX_NAME_LEN and long.startswith("fp8/") and long.endswith("/weight/mse")
