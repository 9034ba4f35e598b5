"""The planted-fault kit (fp8track.execution.faults): each kind does exactly what it says to the
state or tensors it names, only inside its windows, on training passes unless told otherwise, and
leaves what it must not touch alone (the high-precision model for the outlier kinds)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fp8track
from fp8track.errors import ConfigError
from fp8track.execution.faults import FAULTS, Fault, FaultKind, has_outlier_row, plant


def _mlp(recipe: str | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    if recipe is not None:
        fp8track.apply_fp8(model, recipe, backend="emulated")
    return model


def _train_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.train()
    out = model(x)
    out.square().mean().backward()
    return out


def test_the_registry_is_read_only_and_every_kind_is_a_frozen_spec() -> None:
    assert set(FAULTS) == {"amax", "amax_outlier", "scale_state", "scale", "outlier", "element", "sink",
                           "weight_flush", "nan_output", "nan_gradient"}
    assert all(isinstance(k, FaultKind) and k.name == name for name, k in FAULTS.items())
    with pytest.raises(TypeError):
        FAULTS["mine"] = FAULTS["amax"]  # type: ignore[index]
    with pytest.raises(AttributeError):
        FAULTS["amax"].summary = "changed"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "typo"}, "unknown fault kind 'typo'; valid values are: 'amax'"),
        (
            {"kind": "outlier", "tensor": "weight"},
            "tensor for the outlier fault 'weight'; valid values are: 'activation'",
        ),
        ({"kind": "amax", "log2": -8.0}, "amax fault: log2 must be > 0"),
        ({"kind": "scale", "windows": ((5, 5),)}, "window stop must be an integer >= 6, got 5"),
        ({"kind": "scale", "windows": ()}, "at least one window"),
        ({"kind": "sink", "channels": (-1,)}, "channels entry must be an integer >= 0"),
    ],
)
def test_bad_faults_are_refused_at_construction(kwargs, match) -> None:
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace(")", r"\)")):
        Fault(**kwargs)


def test_windows_are_half_open_and_open_ended() -> None:
    f = Fault("scale", windows=((2, 4), (10, None)))
    assert [s for s in range(14) if f.active(s)] == [2, 3, 10, 11, 12, 13]
    assert f.windows == ((2, 4), (10, None))


def test_amax_writes_one_entry_from_the_reference_taken_before_it_first_acted() -> None:
    model = _mlp("delayed:hybrid:h4:max")
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    _train_step(model, x)  # fills the histories
    scaler = model[2].delayed_scalers["weight"]
    ref = float(scaler.amax_history.max())
    p = plant(model, Fault("amax", "weight", windows=((1, 3),), log2=10.0), ["2"])
    p.before_step(0)  # outside the window
    assert float(scaler.amax_history.max()) == ref and p.touched == 0
    p.before_step(1)
    assert float(scaler.amax_history[0]) == ref * 2.0**10 and p.touched == 1
    _train_step(model, x)  # the scale computed from the history is 2**10 too small
    p.before_step(2)  # the same value again: the reference does not compound
    assert float(scaler.amax_history[0]) == ref * 2.0**10 and p.touched == 2


def test_scale_state_multiplies_the_scale_before_each_step_of_its_window() -> None:
    model = _mlp("delayed")
    _train_step(model, torch.randn(4, 8))
    scaler = model[0].delayed_scalers["activation"]
    before = scaler.scale.clone()
    p = plant(model, Fault("scale_state", windows=((0, 2),), log2=3.0), ["0"])
    p.before_step(0)
    p.before_step(1)
    p.before_step(2)
    assert torch.equal(scaler.scale, before * 2.0**-6) and p.touched == 2


def test_the_outlier_row_leaves_the_high_precision_model_alone_and_breaks_per_tensor_fp8() -> None:
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(2))
    bf16, fp8 = _mlp(), _mlp("current")
    want_bf16, want_fp8 = bf16(x).detach(), fp8(x).detach()
    pb = plant(bf16, Fault("outlier", value=1e6), ["2"])
    pf = plant(fp8, Fault("outlier", value=1e6), ["2"])
    got_bf16, got_fp8 = bf16(x).detach(), fp8(x).detach()
    assert got_bf16.shape == want_bf16.shape and torch.allclose(got_bf16, want_bf16, rtol=0, atol=1e-6)
    assert pb.touched == 1 and pf.touched == 1
    # the extra row sets the activation scale: the real inputs underflow, the output is ~the bias
    err = (got_fp8 - want_fp8).norm() / want_fp8.norm()
    assert err > 0.5
    assert has_outlier_row(torch.cat([x, torch.tensor([[1e6] + [0.0] * 7])]), 1e6)
    assert not has_outlier_row(x, 1e6)


def test_element_acts_in_its_window_on_training_passes_only_and_a_clock_gives_the_step() -> None:
    model = _mlp()
    seen = []
    model[2].register_forward_hook(lambda m, args, out: seen.append(float(args[0][0, 3])))
    base = float(torch.tanh(model[0].bias[3]))  # what layer 2 sees at [0, 3] of a zero input
    step = {"now": 0}
    p = plant(model, Fault("element", windows=((1, 2),), value=300.0, element=(0, 3)), ["2"],
              clock=lambda: step["now"])
    x = torch.zeros(2, 8)
    for s in range(3):
        step["now"] = s
        model(x)
    model.eval()
    step["now"] = 1
    with torch.no_grad():
        model(x)
    assert seen == [base, 300.0, base, base] and p.touched == 1


def test_sink_holds_its_weight_columns_at_zero_so_high_precision_never_sees_the_value() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(5, 3)
    reference = copy.deepcopy(layer)
    with torch.no_grad():
        reference.weight[:, 4] = 0.0
    plant(layer, Fault("sink", value=1e6, channels=(4,)), [""])
    opt = torch.optim.Adam(layer.parameters(), lr=0.1)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.1)
    x = torch.cat([torch.randn(4, 4), torch.zeros(4, 1)], dim=1)  # channel 4: the sink
    for _ in range(3):
        for m, o in ((layer, opt), (reference, ref_opt)):
            m(x).square().sum().backward()
            o.step()
            o.zero_grad()
    assert torch.equal(layer.weight[:, 4], torch.zeros(3))
    assert torch.equal(layer.weight, reference.weight) and torch.equal(layer(x), reference(x))


def test_weight_flush_zeroes_the_columns_from_its_first_step() -> None:
    model = _mlp()
    p = plant(model, Fault("weight_flush", "weight", windows=((2, None),), channels=(0, 1, 2)), ["2"])
    p.before_step(1)
    assert (model[2].weight[:, :3] != 0).all()
    p.before_step(2)
    assert torch.equal(model[2].weight[:, :3], torch.zeros(4, 3)) and (model[2].weight[:, 3:] != 0).all()


def test_nan_output_and_nan_gradient() -> None:
    x = torch.randn(3, 8)
    model = _mlp()
    plant(model, Fault("nan_output"), ["2"])
    assert torch.isnan(model(x)).all()
    model = _mlp()
    plant(model, Fault("nan_gradient", "gradient"), ["2"])
    out = model(x)
    out.square().mean().backward()
    assert torch.isfinite(out).all()  # the loss is finite ...
    assert torch.isnan(model[0].weight.grad).all()  # ... the gradient is not


def test_strict_refuses_a_layer_without_the_state_and_lenient_leaves_it_alone() -> None:
    model = _mlp()  # no FP8 state
    with pytest.raises(
        ConfigError, match="the amax fault needs delayed scaling of its activation .* on layer '0'"
    ):
        plant(model, Fault("amax"), ["0"])
    p = plant(model, Fault("amax"), ["0"], strict=False)
    p.before_step(0)
    assert p.touched == 0
    with pytest.raises(ConfigError, match="no layer 'blocks.9' to plant a fault in; GEMM layers: 0, 2"):
        plant(model, Fault("scale"), ["blocks.9"])
