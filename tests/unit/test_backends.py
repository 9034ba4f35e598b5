"""The Backend interface and its registry: a backend defined in one place is used by apply_fp8, the
ApplyReport and the monitor's layer plans without any other code knowing its classes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8track
from fp8track.errors import ConfigError
from fp8track.execution import layers
from fp8track.execution.apply import apply_fp8
from fp8track.execution.backends import (
    backend_of,
    fp8_format_for,
    get_backend,
    is_fp8_linear,
    registered,
    resolve_backend,
)
from fp8track.execution.backends import base as backend_base
from fp8track.execution.backends.base import Backend, Converted, ScaleRule, register
from fp8track.execution.recipes import Recipe
from fp8track.monitoring.plans import plan_for, tensor_partial
from fp8track.monitoring.records import RunReader
from fp8track.numerics.stats import finalize, get_compile, set_compile


class ToyLinear(nn.Module):
    """A stand-in FP8 module: stores its own scale (a power of two) and computes in float32."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.scale = torch.tensor(64.0)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class ToyBackend(Backend):
    name = "toy"

    def owns(self, module):
        return isinstance(module, ToyLinear)

    def format_for(self, module, tensor):
        return "e5m2"  # everything in E5M2: differs from every shipped backend's default

    def scale_rule(self, module):
        return ScaleRule("delayed", margin=1)

    def used_scales(self, module):
        return {k: module.scale for k in ("activation", "weight", "gradient")}

    def convert(self, model, recipe, names, keep_bf16):
        fp8 = [n for n in names if n not in keep_bf16]
        for n in fp8:
            model.set_submodule(n, ToyLinear(model.get_submodule(n)))
        return Converted(tuple(fp8), {})


@pytest.fixture
def toy():
    mode = get_compile()
    set_compile("eager")
    backend = register(ToyBackend())
    yield backend
    backend_base._REGISTRY.pop("toy")
    layers._BACKEND_GEMMS.pop("toy")
    set_compile(mode)


def test_shipped_backends_are_registered_and_own_their_modules():
    assert set(registered()) >= {"emulated", "te", "torchao"}
    assert resolve_backend("auto") == "emulated"  # no CUDA here: TE's priority does not apply
    with pytest.raises(ConfigError, match="unknown backend 'tpu'.*emulated"):
        get_backend("tpu")
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    apply_fp8(model, "current", bf16_layers="last", backend="emulated")
    assert (
        backend_of(model[0]) is get_backend("emulated") and backend_of(model[1]) is None
    )  # fallback stays nn.Linear
    assert is_fp8_linear(model[0]) and not is_fp8_linear(model[1])


def test_a_new_backend_is_used_everywhere_through_the_registry(toy, tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
    report = apply_fp8(model, Recipe("current"), bf16_layers="head", backend="toy")
    assert report.backend == "toy" and report.fp8_layers == ("0",)
    assert [n for n, _ in report.bf16_layers] == ["2"] and report.bf16_layers[0][1].startswith("head")
    assert isinstance(model[0], ToyLinear) and backend_of(model[0]) is toy and is_fp8_linear(model[0])
    assert fp8_format_for(model[0], "activation") == "e5m2"
    plan = plan_for("0", model[0])
    assert plan.fp8 and plan.formats["weight"] == "e5m2" and plan.margin == 1
    x = torch.full((4, 32), 0.5)
    # The backend's own scale (64), not a derived one: amax 0.5 would give 57344 / 0.5 / 2 = 57344.
    assert finalize(tensor_partial(x, plan, "activation"), "e5m2")["scale"] == 64.0
    mon = fp8track.Monitor(
        model,
        fp8track.MonitorConfig(every_n_steps=1, tensors=("activation",)),
        log_dir=tmp_path,
        apply_report=report,
    ).attach()
    model(torch.randn(4, 32)).sum().backward()
    mon.step()
    mon.close()
    rows = {(r.layer, r.variant): r.stats for r in RunReader(mon.run_dir).tensor_stats()}
    assert rows[("0", "actual")]["scale"] == 64.0 and ("2", "shadow") in rows
    meta = RunReader(mon.run_dir).meta()
    assert meta["fp8_layers"] == ["0"] and meta["config"]["apply"]["backend"] == "toy"
