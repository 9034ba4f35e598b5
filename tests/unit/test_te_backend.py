"""The TE backend's conversion, shape guard, scale rules and layer recognition, without TE.

TE needs CUDA: ``fake_te`` supplies classes with TE's names (dispatch and structure only). Every
statistic asserted here is computed by fp8track's own numerics and checked against hand-worked
values or an independent call.
"""

import pickle

import fake_te
import pytest
import torch
from torch import nn

from fp8track import Monitor, MonitorConfig
from fp8track.errors import ConfigError
from fp8track.execution.apply import applied_report, apply_fp8
from fp8track.execution.backends import backend_of, get_backend
from fp8track.execution.backends import te as te_backend
from fp8track.execution.layers import is_gemm_layer
from fp8track.execution.recipes import Recipe
from fp8track.monitoring.plans import plan_for
from fp8track.monitoring.records import RunReader
from fp8track.numerics.stats import quant_stats


@pytest.fixture
def te(monkeypatch):
    te_mod, recipe_mod = fake_te.modules()
    monkeypatch.setattr(te_backend, "import_te", lambda: (te_mod, recipe_mod))
    monkeypatch.setattr(te_backend, "_BF16_CLASS", None)
    return te_mod


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.odd = nn.Linear(64, 20)  # out 20: not a multiple of 8
        self.narrow = nn.Linear(20, 64)  # in 20: not a multiple of 16
        self.out = nn.Linear(64, 32, bias=False)
        self.tied = nn.Linear(64, 32, bias=False)
        self.tied.weight = self.out.weight
        self.inp.bias.requires_grad_(False)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        return self.out(self.narrow(self.odd(h))) + self.tied(h)


def test_shape_guard_follows_assert_dim_for_fp8_exec_and_mxfp8_is_quantizable():
    delayed, mx = Recipe("delayed"), Recipe("mxfp8")
    assert te_backend.fp8_shape_problem(32, 64, delayed) is None
    assert "in % 16 and out % 8" in te_backend.fp8_shape_problem(20, 64, delayed)
    assert "in % 16 and out % 8" in te_backend.fp8_shape_problem(64, 20, delayed)
    assert te_backend.fp8_shape_problem(48, 8, delayed) is None  # 16 | 48 and 8 | 8
    assert "MXFP8Quantizer.is_quantizable" in te_backend.fp8_shape_problem(48, 64, mx)  # 48 % 32 != 0
    assert te_backend.fp8_shape_problem(64, 96, mx) is None
    assert te_backend.fp8_shape_problem(20, 20, Recipe("bf16")) is None  # nothing is quantised


def test_apply_fp8_te_keeps_ties_grads_names_and_reports_refused_shapes(te):
    model = Tied()
    params_before = {id(p) for p in model.parameters()}
    report = apply_fp8(model, "delayed", backend="te")
    assert report.fp8_layers == ("inp", "out", "tied")
    reasons = dict(report.bf16_layers)
    assert set(reasons) == {"odd", "narrow"}
    assert "shape 20x64" in reasons["odd"] and "shape 64x20" in reasons["narrow"]
    assert model.tied.weight is model.out.weight  # tied weights stay tied
    assert {id(p) for p in model.parameters()} == params_before  # optimizers built before still work
    assert model.inp.bias.requires_grad is False and model.inp.weight.requires_grad is True
    assert model.out.weight.te_tag is True  # TE's parameter attributes carried onto the adopted one
    # Nothing is added to the modules or classes: TE's own default name, no flags, no recipe attribute.
    assert [model.get_submodule(n).name for n in ("inp", "odd", "tied")] == [None, None, None]
    assert not any(
        hasattr(m, a) for m in model.modules() for a in ("fp8_recipe", "fp8track_bf16", "fp8track_report")
    )
    bf16 = model.odd
    assert type(bf16).__name__ == "TEBF16Linear" and not hasattr(fake_te.Linear, "fp8track_bf16")
    te_b = get_backend("te")
    assert backend_of(bf16) is te_b and not te_b.is_fp8(bf16) and te_b.is_fp8(model.inp)
    assert applied_report(model) is report
    assert type(bf16).__module__ == "fp8track.execution.backends.te"
    clone = pickle.loads(pickle.dumps(bf16))  # module-level class: picklable
    assert type(clone) is type(bf16) and torch.equal(clone.weight, bf16.weight)
    y = bf16(torch.randn(4, 64))
    assert y.shape == (4, 20) and te.autocast_calls[-1]["enabled"] is False  # fallback runs outside FP8


def test_te_bf16_control_is_monitored_in_shadow_mode(te, tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    report = apply_fp8(model, "bf16", backend="te")
    assert report.fp8_layers == () and all(type(m).__name__ == "TEBF16Linear" for m in (model[0], model[2]))
    mon = Monitor(model, MonitorConfig(every_n_steps=1, tensors=("activation",)), log_dir=tmp_path).attach()
    x = torch.randn(8, 32)
    model(x).sum().backward()
    mon.step()
    mon.close()
    rows = {(r.layer, r.variant): r.stats for r in RunReader(mon.run_dir).tensor_stats()}
    assert set(rows) == {("0", "shadow"), ("2", "shadow")}
    want = quant_stats(x, "e4m3")  # shadow = current scaling E4M3 of the layer input
    assert rows[("0", "shadow")]["mse"] == pytest.approx(want["mse"], rel=1e-12)
    assert rows[("0", "shadow")]["scale"] == pytest.approx(448.0 / x.abs().max().item(), rel=1e-6)


def test_te_gemm_modules_are_recognised_through_their_mro():
    class MegatronTELinear(fake_te.Linear):  # Megatron's TELinear derives from te.Linear
        pass

    assert te_backend.te_gemm_class(MegatronTELinear(16, 8)) == "Linear"
    assert is_gemm_layer(MegatronTELinear(16, 8)) and is_gemm_layer(fake_te.LayerNormMLP(16, 32))
    assert te_backend.te_gemm_suffixes(fake_te.LayerNormMLP(16, 32)) == [".fc1", ".fc2"]
    assert te_backend.te_gemm_suffixes(fake_te.GroupedLinear(3)) == [".gemm_0", ".gemm_1", ".gemm_2"]
    assert te_backend.te_gemm_class(nn.Linear(2, 2)) is None


def test_scale_rule_current_and_block_have_no_margin_and_follow_te_env(monkeypatch):
    monkeypatch.delenv("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", raising=False)
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)
    assert te_backend.scale_rule(Recipe("current", margin=1)) == (0, False)
    assert te_backend.scale_rule(Recipe("block")) == (0, True)
    assert te_backend.scale_rule(Recipe("delayed", margin=2)) == (2, None)
    monkeypatch.setenv("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "1")
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")
    assert te_backend.scale_rule(Recipe("current")) == (0, True)
    assert te_backend.scale_rule(Recipe("block")) == (0, False)


def test_te_current_recipe_margin_warns_and_monitor_uses_te_rule(te, monkeypatch):
    with pytest.warns(UserWarning, match="current scaling has no margin; margin=1 is ignored"):
        assert type(te_backend.to_te_recipe(Recipe("current", margin=1))).__name__ == "Float8CurrentScaling"
    monkeypatch.setenv("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "1")
    layer = fake_te.Linear(64, 32)
    layer.fp8_meta["recipe"] = fake_te.Float8CurrentScaling()  # TE records the recipe in the first forward
    plan = plan_for("l", layer)
    assert (plan.margin, plan.power_2_scales) == (0, True)
    x = torch.full((4, 64), 3.0)
    from fp8track.monitoring.plans import tensor_partial
    from fp8track.numerics.stats import finalize

    # 448 / 3 = 149.33; TE's compute_scale_from_amax clears the mantissa: 128.
    assert finalize(tensor_partial(x, plan, "activation"), "e4m3")["scale"] == 128.0


def test_te_errors_name_the_fix():
    with pytest.raises(ConfigError, match="no 'FP8 input, BF16 GEMM' recipe"):
        te_backend.to_te_recipe(Recipe("fp8_input_bf16_gemm"))


def test_te_hooks_follow_tuple_outputs_and_skip_quantized_weights(tmp_path):
    class QuantizedTensor(torch.Tensor):  # the class name TE's Float8Tensor derives from
        pass

    class ProjWithBias(fake_te.Linear):  # TransformerLayer's proj: return_bias=True
        def forward(self, x):
            return torch.nn.functional.linear(x, self.weight), self.bias

    torch.manual_seed(0)
    proj, fp8w = ProjWithBias(16, 16), fake_te.Linear(16, 16)
    for m in (proj, fp8w):
        nn.init.normal_(m.weight)
    fp8w.weight = nn.Parameter(fp8w.weight.detach().as_subclass(QuantizedTensor))
    model = nn.ModuleDict({"proj": proj, "fp8w": fp8w})
    mon = Monitor(model, MonitorConfig(every_n_steps=1), log_dir=tmp_path).attach()
    x = torch.randn(8, 16)
    out, bias = proj(x)
    (fp8w(out) + bias).pow(2).sum().backward()
    mon.step()
    mon.close()
    seen = {(r.layer, r.tensor) for r in RunReader(mon.run_dir).tensor_stats()}
    assert ("proj", "gradient") in seen and ("proj", "weight") in seen
    assert ("fp8w", "weight") not in seen and ("fp8w", "activation") in seen


def test_bf16_control_gets_a_plain_lightning_precision_not_fp8_autocast():
    from lightning.pytorch.plugins import HalfPrecision, Precision, TransformerEnginePrecision

    plugin = te_backend.lightning_precision(Recipe("bf16"))  # no TE import: nothing to quantise
    assert type(plugin) is Precision and not isinstance(plugin, TransformerEnginePrecision)
    half = te_backend.lightning_precision(Recipe("bf16"), torch.bfloat16)
    assert isinstance(half, HalfPrecision) and half.precision == "bf16-true"
