"""fp8track's capture through TE's debug API: the partial of each quantizer kind, lazy plans, and
the nvdlfw_inspect feature driven through nvdlfw's real registry, config and generic API."""

import fake_te
import pytest
import torch
from torch import nn

from fp8track import Monitor, MonitorConfig
from fp8track.monitoring import te_capture
from fp8track.monitoring.plans import shadow_plan
from fp8track.monitoring.records import RunReader
from fp8track.numerics.stats import block_quant_stats, finalize, quant_stats

debug_api = pytest.importorskip("nvdlfw_inspect.api")


def _stats(x, quantizer, tensor="activation", fmt_pair="hybrid"):
    plan = shadow_plan("l", fmt_pair)
    plan = type(plan)(fqn="l", fp8=True, formats=plan.formats)
    p = te_capture.te_partial(x, quantizer, tensor, plan)
    return finalize(p, te_capture.quantizer_format(quantizer, plan.formats[tensor]))


def test_delayed_quantizer_scale_is_the_one_judged():
    x = torch.randn(64, 32) * 5
    got = _stats(x, fake_te.Float8Quantizer(16.0, "kFloat8E5M2"), tensor="gradient")
    want = quant_stats(x, "e5m2", 16.0)
    assert got["scale"] == 16.0 and got["mse"] == pytest.approx(want["mse"], rel=1e-12)
    assert got["underflow_pct"] == want["underflow_pct"] and got["overflow_pct"] == want["overflow_pct"]


def test_current_quantizer_follows_compute_scale_from_amax():
    x = torch.linspace(-3.0, 3.0, 512).reshape(16, 32)
    assert _stats(x, fake_te.Float8CurrentScalingQuantizer())["scale"] == pytest.approx(448 / 3, rel=1e-7)
    assert _stats(x, fake_te.Float8CurrentScalingQuantizer(force_pow_2_scales=True))["scale"] == 128.0
    # amax_epsilon floors the amax: 448 / 4 = 112 -> power of two 64.
    q = fake_te.Float8CurrentScalingQuantizer(force_pow_2_scales=True, amax_epsilon=4.0)
    assert _stats(x, q)["scale"] == 64.0


def test_block_quantizers_follow_block_scaling_dim_and_fp32_scales():
    torch.manual_seed(0)
    x = torch.randn(128, 256)
    x[:, :128] *= 3.0 / x[:, :128].abs().max()  # one 1x128 block family with amax <= 3
    one_d = _stats(x, fake_te.Float8BlockQuantizer(block_scaling_dim=1))
    assert one_d["mse"] == pytest.approx(block_quant_stats(x, "block128", "e4m3")["mse"], rel=1e-12)
    two_d = _stats(x, fake_te.Float8BlockQuantizer(block_scaling_dim=2), tensor="weight")
    assert two_d["mse"] == pytest.approx(block_quant_stats(x, "block128x128", "e4m3")["mse"], rel=1e-12)
    # NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1: scale = 448 / amax exactly; the largest 128x128 tile
    # amax is the tensor's amax, so the smallest scale is 448 / amax(x).
    fp32 = _stats(
        x, fake_te.Float8BlockQuantizer(block_scaling_dim=2, force_pow_2_scales=False), tensor="weight"
    )
    assert fp32["scale"] == pytest.approx(448.0 / x.abs().max().item(), rel=1e-7)
    assert two_d["scale"] <= fp32["scale"] < 2 * two_d["scale"]  # power of two rounds down
    mx = _stats(x, fake_te.MXFP8Quantizer())
    assert mx["mse"] == pytest.approx(block_quant_stats(x, "mxfp8", "e4m3")["mse"], rel=1e-12)


def test_no_quantizer_gives_shadow_current_scaling():
    x = torch.randn(8, 16)
    assert _stats(x, None)["scale"] == pytest.approx(448.0 / x.abs().max().item(), rel=1e-7)


def test_native_te_layer_plan_resolves_after_its_first_forward(tmp_path):
    """TE builds fp8_meta (recipe, scales) in the first forward: the plan must wait for it."""

    class NativeTE(fake_te.Linear):
        def forward(self, x):
            if "recipe" not in self.fp8_meta:  # what TE's init_fp8_metadata does on first use
                self.fp8_meta["recipe"] = fake_te.DelayedScaling(margin=0)
                fwd = type("Meta", (), {})()
                fwd.scale, fwd.amax_history = torch.tensor([2.0, 4.0, 1.0]), torch.zeros(1, 3)
                self.fp8_meta["scaling_fwd"] = fwd
                bwd = type("Meta", (), {})()
                bwd.scale, bwd.amax_history = torch.tensor([8.0, 1.0]), torch.zeros(1, 2)
                self.fp8_meta["scaling_bwd"] = bwd
            return super().forward(x)

    torch.manual_seed(0)
    layer = NativeTE(32, 16)
    nn.init.normal_(layer.weight)
    mon = Monitor(nn.Sequential(layer), MonitorConfig(every_n_steps=1), log_dir=tmp_path).attach()
    assert "recipe" not in layer.fp8_meta  # nothing known yet when the monitor was built
    x = torch.randn(8, 32) * 100
    layer(x).sum().backward()
    mon.step()
    mon.close()
    rows = {r.tensor: r.stats for r in RunReader(mon.run_dir).tensor_stats() if r.variant == "actual"}
    assert (
        rows["activation"]["scale"] == 2.0
        and rows["weight"]["scale"] == 4.0
        and rows["gradient"]["scale"] == 8.0
    )
    assert rows["activation"]["overflow_pct"] == pytest.approx(quant_stats(x, "e4m3", 2.0)["overflow_pct"])
    assert rows["activation"]["overflow_pct"] > 0  # delayed scale 2 is far too large for |x| ~ 300


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = fake_te.LayerNormMLP(32, 64)

    def forward(self, x):
        return self.mlp(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@pytest.fixture
def generic_debug(tmp_path):
    debug_api.end_debug()
    te_capture.initialize(framework="base", log_dir=str(tmp_path / "nv"))
    yield debug_api
    debug_api.end_debug()


def _inspect(layer, tensor_name, x, quantizer, it):
    # The call TE's DebugQuantizer._call_inspect_tensor_api makes, through nvdlfw's generic router.
    debug_api.inspect_tensor(
        layer_name=layer,
        tensor_name=tensor_name,
        iteration=it,
        tp_group=None,
        tensor=x,
        rowwise_quantized_tensor=None,
        columnwise_quantized_tensor=None,
        quantizer=quantizer,
        tp_size=1,
    )


def test_nvdlfw_feature_routes_every_gemm_to_the_monitor(generic_debug, tmp_path):
    torch.manual_seed(0)
    model = Net()
    assert te_capture.capture_live()
    mon = Monitor(model, MonitorConfig(every_n_steps=2, whatif=("mxfp8",)), log_dir=tmp_path).attach()
    assert set(mon.captures) == {
        "blocks.0.mlp.fc1",
        "blocks.0.mlp.fc2",
        "blocks.1.mlp.fc1",
        "blocks.1.mlp.fc2",
        "head",
    }
    debug_api.infer_and_assign_layer_names(model)  # TE's names gain a "model." prefix: still joined
    assert model.blocks[1].mlp.name == "model.blocks.1.mlp"
    # Schedule: TE asks inspect_tensor_enabled and caches (run, next_iter).
    assert debug_api.inspect_tensor_enabled(
        layer_name="model.blocks.0.mlp.fc1", tensor_name="activation", iteration=1
    ) == (
        False,
        2,
    )
    x1 = torch.randn(16, 64) * 4  # fc2's input: invisible to any module hook
    q = fake_te.Float8Quantizer(32.0)
    _inspect("model.blocks.1.mlp.fc2", "activation", x1, q, 0)
    _inspect("model.blocks.1.mlp.fc2", "activation", x1 * 2, q, 0)  # a second micro-batch merges
    w = torch.randn(32, 64)
    _inspect("model.blocks.1.mlp.fc2", "weight", w, fake_te.Float8Quantizer(64.0), 0)
    _inspect("model.blocks.1.mlp.fc2", "weight", w * 100, fake_te.Float8Quantizer(64.0), 0)  # once per step
    _inspect("model.blocks.1.mlp.fc2", "output", x1, None, 0)  # GEMM outputs are not fp8track tensors
    _inspect("model.blocks.0.mlp.fc1", "weight", None, q, 0)  # FP8 primary weights: no HP tensor, no row
    mon.step()
    _inspect("model.blocks.1.mlp.fc2", "activation", x1, q, 1)  # unsampled step 1: ignored
    mon.step()
    mon.close()
    assert debug_api.DEBUG_MANAGER._trainer_iteration_count == 2  # the monitor steps nvdlfw once per step
    rows = {(r.step, r.layer, r.tensor, r.variant): r.stats for r in RunReader(mon.run_dir).tensor_stats()}
    both = torch.cat([x1.reshape(-1), (x1 * 2).reshape(-1)])
    want = quant_stats(both, "e4m3", 32.0)
    got = rows[(0, "blocks.1.mlp.fc2", "activation", "actual")]
    # float32 chunked sums vs one pass: equal to ~1e-7
    assert got["mse"] == pytest.approx(want["mse"], rel=1e-6) and got["numel"] == 2 * x1.numel()
    assert got["overflow_pct"] == want["overflow_pct"] and got["underflow_pct"] == want["underflow_pct"]
    assert rows[(0, "blocks.1.mlp.fc2", "weight", "actual")]["mse"] == pytest.approx(
        quant_stats(w, "e4m3", 64.0)["mse"], rel=1e-6
    )
    mx = rows[(0, "blocks.1.mlp.fc2", "activation", "mxfp8")]  # what-if on the same tensors
    assert mx["mse"] == pytest.approx(
        block_quant_stats(torch.cat([x1, x1 * 2]), "mxfp8", "e4m3")["mse"], rel=1e-6
    )
    assert (0, "blocks.0.mlp.fc1", "weight", "actual") not in rows  # nothing recorded
    assert not any(k[0] == 1 for k in rows)  # step 1 was not sampled


def test_bridge_rows_join_monitor_rows_and_e8m0_codes_become_floats():
    from fp8track.trackers.nvdlfw import TEStatsBridge, e8m0_to_float, join_layer_name, te_layer_names

    model = Net()
    debug_api.infer_and_assign_layer_names(model)
    names = te_layer_names(model)
    assert names["model.blocks.0.mlp.fc2"] == "blocks.0.mlp.fc2"
    assert join_layer_name("model.head") == "head" and join_layer_name("Layer_3") == "Layer_3"
    assert (e8m0_to_float(127), e8m0_to_float(130), e8m0_to_float(120)) == (1.0, 8.0, 2.0**-7)
    got = []
    bridge = TEStatsBridge(got.append, model=model, training_recipe="mxfp8")
    bridge.log_scalar("model.blocks.0.mlp.fc2_activation_scale_inv_min", 124, 0)
    bridge.log_scalar(
        "model.blocks.0.mlp.fc2_activation_mxfp8_scale_inv_max_columnwise", torch.tensor(128.0), 0
    )
    bridge.log_scalar("model.blocks.0.mlp.fc2_activation_underflows%", 2.5, 0)
    bridge.flush()
    rows = {(r.layer, r.variant): r.stats for r in got[0].tensor_rows}
    assert rows[("blocks.0.mlp.fc2", "actual")] == {"scale_inv_min": 0.125, "underflow_pct": 2.5}
    assert rows[("blocks.0.mlp.fc2", "mxfp8_columnwise")] == {"scale_inv_max": 2.0}
    assert got[0].metrics["fp8/blocks.0.mlp.fc2/activation/underflow_pct"] == 2.5


def test_schedule_tells_te_when_to_run_its_debug_path_next():
    hub = te_capture.CaptureHub()
    assert hub.enabled(0) == (False, None)  # no monitor bound: TE never needs the debug path
    hub.add_schedule(10, (3,))
    assert hub.enabled(1) == (False, 3) and hub.enabled(3) == (True, 10) and hub.enabled(10) == (True, 20)
    hub.add_schedule(4)
    assert hub.enabled(5) == (False, 8)


def test_initialize_refuses_when_te_modules_already_exist_or_twice(monkeypatch, tmp_path):
    import sys
    import types

    from fp8track.errors import ConfigError

    debug_api.end_debug()
    state = types.ModuleType("transformer_engine.debug.pytorch.debug_state")
    # What TEDebugState records when a TE module was built while nvdlfw was imported, not initialised.
    state.TEDebugState = type("TEDebugState", (), {"debug_enabled": False})
    monkeypatch.setitem(sys.modules, state.__name__, state)
    with pytest.raises(ConfigError, match="built before the debug API was initialised"):
        te_capture.initialize()
    te_capture.initialize(framework="base", log_dir=str(tmp_path))
    try:
        with pytest.raises(ConfigError, match="already initialised"):
            te_capture.initialize(framework="base", log_dir=str(tmp_path))
    finally:
        debug_api.end_debug()
