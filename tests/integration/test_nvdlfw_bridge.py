"""TE debug API bridge: real nvdlfw_inspect on CPU (generic LogTensorStats), TE features on GPU."""

from __future__ import annotations

import math

import pytest
import torch

debug_api = pytest.importorskip("nvdlfw_inspect.api")

from fp8track.monitoring.records import RunMeta, RunReader, RunWriter  # noqa: E402
from fp8track.trackers import TrackerFanout  # noqa: E402
from fp8track.trackers.base import StepBatch, Tracker  # noqa: E402
from fp8track.trackers.nvdlfw import TEStatsBridge, record_and_log  # noqa: E402


class Keep(Tracker):
    name = "keep"

    def __init__(self):
        self.got: list[StepBatch] = []

    def log(self, batch):
        self.got.append(batch)


@pytest.fixture
def nvdlfw_session():
    """nvdlfw_inspect keeps its manager in a module global: always end it."""
    debug_api.end_debug()
    yield debug_api
    debug_api.end_debug()


CONFIG = {
    "stats_for_linears": {
        "enabled": True,
        "layers": {"layer_name_regex_pattern": r"^blocks\.\d+\.(fc1|proj_out)$"},
        "LogTensorStats": {
            "enabled": True,
            "tensors_struct": [
                {"tensor": "activation", "stats": ["min", "max", "mean", "l2_norm"], "freq": 2},
                {"tensor": "weight", "stats": ["std"], "freq": 1},
            ],
        },
    }
}


def test_generic_log_tensor_stats_reach_run_dir_and_trackers(nvdlfw_session, tmp_path):
    writer = RunWriter(tmp_path / "run", RunMeta(name="nvdlfw"))
    keep = Keep()
    fan = TrackerFanout([keep], writer.run_dir)
    bridge = TEStatsBridge(record_and_log(writer, fan), step_offset=100)
    nvdlfw_session.initialize(
        config_file=CONFIG,
        statistics_logger=bridge,
        log_dir=str(tmp_path / "nv"),
        default_logging_enabled=False,
    )
    torch.manual_seed(0)
    acts, weights = {}, {}
    for it in range(4):
        for layer in ("blocks.0.fc1", "blocks.1.proj_out", "blocks.1.other"):
            a = torch.randn(8, 16)
            w = torch.randn(4, 16)
            acts[(it, layer)], weights[(it, layer)] = a, w
            nvdlfw_session.log_tensor_stats(
                layer_name=layer, tensor=a, tensor_name="activation", skip_reduction=True
            )
            nvdlfw_session.log_tensor_stats(
                layer_name=layer, tensor=w, tensor_name="weight", skip_reduction=True
            )
        nvdlfw_session.step()
    bridge.flush()
    fan.finish()
    writer.close()

    assert [b.step for b in keep.got] == [100, 101, 102, 103]
    b2 = keep.got[2]
    a = acts[(2, "blocks.0.fc1")]
    assert b2.metrics["fp8/blocks.0.fc1/activation/max"] == pytest.approx(a.max().item())
    assert b2.metrics["fp8/blocks.0.fc1/activation/l2_norm"] == pytest.approx(a.norm().item(), rel=1e-6)
    assert b2.metrics["fp8/blocks.1.proj_out/weight/std"] == pytest.approx(
        weights[(2, "blocks.1.proj_out")].std().item(), rel=1e-6
    )
    assert not any("other" in k for k in b2.metrics)  # not selected by the config's regex
    # freq 2 for activations: only even iterations carry them; weights every iteration
    assert any("activation" in k for k in keep.got[0].metrics)
    assert not any("activation" in k for k in keep.got[1].metrics)
    assert sorted((r.layer, r.tensor) for r in keep.got[1].tensor_rows) == [
        ("blocks.0.fc1", "weight"),
        ("blocks.1.proj_out", "weight"),
    ]
    row = next(r for r in b2.tensor_rows if r.layer == "blocks.0.fc1" and r.tensor == "activation")
    assert row.variant == "actual" and row.stats["mean"] == pytest.approx(a.mean().item(), abs=1e-7)

    # the run directory is the source of truth: same values, written before the trackers saw them
    reader = RunReader(writer.run_dir)
    assert reader.series("fp8/blocks.0.fc1/activation/max") == {
        100 + it: pytest.approx(acts[(it, "blocks.0.fc1")].max().item()) for it in (0, 2)
    }
    assert len(list(reader.tensor_stats())) == sum(len(b.tensor_rows) for b in keep.got)


def test_te_names_parsed_into_rows_and_unknown_names_kept(nvdlfw_session, tmp_path):
    """The logger interface with TE's own stat names (as TE's stats buffer emits them)."""
    got: list[StepBatch] = []
    bridge = TEStatsBridge(got.append)
    bridge.log_scalar("model.layers.0.fc1_activation_underflows%", torch.tensor(12.5), 7)
    bridge.log_scalar("model.layers.0.fc1_activation_mse", torch.tensor(3e-5), 7)
    bridge.log_scalar("model.layers.0.fc1_activation_mxfp8_underflows%", 40.0, 7)
    bridge.log_scalar("model.layers.0.fc1_gradient_scale_inv_min", 0.25, 7)
    with pytest.warns(RuntimeWarning, match="grad_norm"):
        bridge.log_scalar("grad_norm", 2.0, 7)
    bridge.log_scalar("model.layers.0.fc1_activation_underflows%", 1.0, 8)  # next iteration flushes 7
    assert len(got) == 1
    b = got[0]
    assert b.step == 7
    assert b.metrics == {
        "fp8/layers.0.fc1/activation/underflow_pct": 12.5,
        "fp8/layers.0.fc1/activation/mse": pytest.approx(3e-5),
        "fp8/layers.0.fc1/activation/mxfp8_underflow_pct": 40.0,
        "fp8/layers.0.fc1/gradient/scale_inv_min": 0.25,
        "fp8/te/grad_norm": 2.0,
    }
    assert {r.layer for r in b.tensor_rows} == {
        "layers.0.fc1"
    }  # infer_and_assign_layer_names' "model." dropped
    rows = {(r.tensor, r.variant): dict(r.stats) for r in b.tensor_rows}
    assert rows[("activation", "actual")] == {"underflow_pct": 12.5, "mse": pytest.approx(3e-5)}
    assert rows[("activation", "mxfp8")] == {"underflow_pct": 40.0}
    bridge.flush()
    assert [g.step for g in got] == [7, 8]


@pytest.mark.gpu
def test_te_fp8_stats_through_bridge(nvdlfw_session, tmp_path):
    """TE's LogFp8TensorStats on a real FP8 Linear (needs CUDA and transformer_engine)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    try:
        import transformer_engine
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import DelayedScaling
    except (ImportError, RuntimeError, OSError) as exc:
        pytest.skip(f"transformer_engine unavailable: {exc}")
    from pathlib import Path

    features = str(Path(transformer_engine.__file__).parent / "debug" / "features")
    got: list[StepBatch] = []
    bridge = TEStatsBridge(got.append)
    cfg = {
        "fp8": {
            "enabled": True,
            "layers": {"layer_name_regex_pattern": ".*"},
            "transformer_engine": {
                "LogFp8TensorStats": {
                    "enabled": True,
                    "tensors": ["activation", "gradient", "weight"],
                    "stats": ["underflows%", "mse", "scale_inv_min"],
                    "freq": 1,
                }
            },
        }
    }
    nvdlfw_session.initialize(
        config_file=cfg,
        feature_dirs=[features],
        statistics_logger=bridge,
        log_dir=str(tmp_path),
        default_logging_enabled=False,
    )
    layer = te.Linear(256, 256, name="fc1").cuda()
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    for _ in range(2):
        with te.autocast(enabled=True, recipe=DelayedScaling()):
            y = layer(x)
        y.float().pow(2).mean().backward()
        nvdlfw_session.step()
    bridge.flush()
    rows = [r for b in got for r in b.tensor_rows if r.layer == "fc1"]
    assert {r.tensor for r in rows} == {"activation", "gradient", "weight"}
    for r in rows:
        assert 0.0 <= r.stats["underflow_pct"] <= 100.0
        assert r.stats["mse"] >= 0.0 and math.isfinite(r.stats["mse"])
        assert r.stats["scale_inv_min"] > 0.0
