"""Hugging Face models built from a config (random weights, no download) under apply_fp8 + Monitor:
GPT-2 (its GEMMs are transformers Conv1D, weight stored [in, out]) and Llama (nn.Linear)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp8track
from fp8track.errors import ConfigError
from fp8track.execution.emulated_linear import EmulatedFP8Conv1D, EmulatedFP8Linear
from fp8track.monitoring.records import RunReader
from fp8track.numerics.stats import get_compile, quant_stats, set_compile

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg)


def llama() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=256,
    )
    return transformers.LlamaForCausalLM(cfg)


@pytest.fixture(autouse=True)
def _eager_stats():
    """The eager statistics path (the compiled one is checked against it in test_stats): keeps
    these tests free of the kernel's compile time."""
    mode = get_compile()
    set_compile("eager")
    yield
    set_compile(mode)


# GPT-2: per block c_attn, c_proj (attention), c_fc, c_proj (MLP) are Conv1D; lm_head is nn.Linear.
# Llama: per block q, k, v, o, gate, up, down are nn.Linear; plus lm_head.
CASES = {
    "gpt2": (gpt2, 2 * 4 + 1, "transformer.h.0.attn.c_attn"),
    "llama": (llama, 2 * 7 + 1, "model.layers.0.mlp.down_proj"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_gemm_layer_is_monitored_with_the_stats_of_its_tensors(name, tmp_path):
    build, n_gemm, probe = CASES[name]
    model = build()
    report = fp8track.apply_fp8(model, "current", backend="emulated")
    assert len(report.fp8_layers) == n_gemm and report.bf16_layers == ()
    fp8_types = {type(model.get_submodule(n)) for n in report.fp8_layers}
    assert fp8_types == ({EmulatedFP8Conv1D, EmulatedFP8Linear} if name == "gpt2" else {EmulatedFP8Linear})

    # Independent capture of the probe layer's GEMM operands at the sampled step (step 2).
    layer = model.get_submodule(probe)
    seen: dict[str, torch.Tensor] = {}

    def fwd(_m, args, out):
        seen["activation"] = args[0].detach().clone()
        out.register_hook(lambda g: seen.__setitem__("gradient", g.detach().clone()))

    handle = layer.register_forward_hook(fwd)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = fp8track.Monitor(model, fp8track.MonitorConfig(every_n_steps=2), log_dir=tmp_path).attach()
    losses = []
    for step in range(3):
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(step))
        if step == 2:
            seen["weight"] = layer.weight.detach().clone()  # as stored, before this step's update
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        mon.step(loss=loss)
        opt.zero_grad()
        losses.append(loss.item())
    handle.remove()
    mon.close()
    assert all(torch.isfinite(torch.tensor(losses)))

    rows = [r for r in RunReader(mon.run_dir).tensor_stats() if r.step == 2 and r.variant == "actual"]
    assert {(r.layer, r.tensor) for r in rows} == {
        (n, t) for n in report.fp8_layers for t in ("activation", "weight", "gradient")
    }
    assert len(rows) == 3 * n_gemm

    # Current scaling, hybrid formats: the row must be quant_stats of the very tensors the GEMM saw.
    formats = {"activation": "e4m3", "weight": "e4m3", "gradient": "e5m2"}
    for tensor, fmt in formats.items():
        row = next(r for r in rows if r.layer == probe and r.tensor == tensor)
        ref = quant_stats(seen[tensor], fmt)
        assert row.stats["numel"] == ref["numel"] == seen[tensor].numel()
        assert row.stats["amax"] == ref["amax"] and row.stats["underflow_pct"] == ref["underflow_pct"]
        assert row.stats == pytest.approx(ref, rel=1e-5, abs=1e-12), (probe, tensor)
    if name == "gpt2":
        conv = model.get_submodule(probe)
        assert isinstance(conv, EmulatedFP8Conv1D) and seen["weight"].shape == (
            64,
            3 * 64,
        )  # stored [in, out]


def test_conv1d_emulation_is_the_linear_on_the_transposed_weight():
    torch.manual_seed(1)
    conv = Conv1D(48, 32)
    x = torch.randn(2, 5, 32)
    # bf16 recipe: Conv1D's own forward, bit for bit
    ctl = EmulatedFP8Conv1D.from_conv1d(conv, "bf16")
    assert ctl.weight is conv.weight and torch.equal(ctl(x), conv(x))
    # FP8: exactly the emulated FP8 linear whose weight is W^T (forward and every gradient)
    for recipe in ("current", "delayed:hybrid:h4", "mxfp8", "block"):
        fp8 = EmulatedFP8Conv1D.from_conv1d(conv, recipe)
        lin = nn.Linear(32, 48)
        with torch.no_grad():
            lin.weight.copy_(conv.weight.t())
            lin.bias.copy_(conv.bias)
        ref = EmulatedFP8Linear.from_linear(lin, recipe)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = fp8(xa), ref(xb)
        assert torch.equal(ya, yb), recipe
        g = torch.randn_like(ya)
        ya.backward(g)
        yb.backward(g)
        assert torch.equal(xa.grad, xb.grad) and torch.equal(conv.weight.grad, lin.weight.grad.t()), recipe
        assert torch.equal(conv.bias.grad, lin.bias.grad)
        assert sorted(fp8.fp8_scales()) == ["activation", "gradient", "weight"]
        conv.zero_grad()


def test_torchao_and_te_refuse_conv1d_naming_the_layer_type():
    model = gpt2()
    with pytest.raises(
        ConfigError,
        match=r"backend 'torchao' converts only nn.Linear.*Conv1D.*transformer\.h\.0\.attn\.c_attn",
    ):
        fp8track.apply_fp8(model, "current", backend="torchao")
    # kept in BF16 on purpose, the refusal does not apply; the BF16 control converts nothing
    pytest.importorskip("torchao")
    report = fp8track.apply_fp8(model, "current", bf16_layers="re:c_attn|c_proj|c_fc", backend="torchao")
    assert report.fp8_layers == ("lm_head",) and len(report.bf16_layers) == 8
