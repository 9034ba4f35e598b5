"""The emulated backend under the ``nvfp4`` recipe, and the monitor's NVFP4 rows: the GEMMs run
from exactly the operands TE's NVFP4 recipe quantises (fp8track.numerics.nvfp4, itself checked in
test_nvfp4.py), what-if NVFP4 on a BF16 layer, column-wise rows of block recipes."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from fp8track import Monitor, apply_fp8
from fp8track.monitoring.plans import LayerPlan, plan_for, tensor_partial, variant_format
from fp8track.numerics.nvfp4 import NVFP4Options, columnwise_operand, nvfp4_quantize
from fp8track.numerics.stats import block_quant_stats, finalize, nvfp4_quant_stats


def _layer(recipe: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(48, 32))
    apply_fp8(m, recipe, backend="emulated")
    return m


def test_forward_and_dgrad_are_the_te_operands_products() -> None:
    m = _layer("nvfp4:no_sr")
    w = m[0].weight.detach()
    x = torch.randn(32, 48, requires_grad=True)
    y = m(x)
    xq = nvfp4_quantize(x.detach()).dequantized
    wq = nvfp4_quantize(w, NVFP4Options(tile_2d=True)).dequantized
    assert torch.allclose(y, xq @ wq.t() + m[0].bias, atol=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    want_dgrad = nvfp4_quantize(g).dequantized @ wq  # 16x16 tiles: the weight's column-wise copy is wq^T
    assert torch.allclose(x.grad, want_dgrad, atol=1e-5)
    # wgrad: column-wise copies with the Hadamard transform along the 32 tokens
    gc = nvfp4_quantize(columnwise_operand(g, True)).dequantized
    xc = nvfp4_quantize(columnwise_operand(x.detach(), True)).dequantized
    assert torch.allclose(m[0].weight.grad, gc @ xc.t(), atol=1e-5)
    exact = g.t() @ x.detach()
    cos = torch.nn.functional.cosine_similarity(m[0].weight.grad.flatten(), exact.flatten(), dim=0)
    assert cos > 0.97


def test_switches_change_the_gemms() -> None:
    x, g = torch.randn(32, 48), torch.randn(32, 32)
    grads = {}
    for recipe in ("nvfp4:no_sr", "nvfp4:no_sr:no_rht", "nvfp4:no_sr:no_2d"):
        m = _layer(recipe)
        xi = x.clone().requires_grad_(True)
        out = m(xi)
        out.backward(g)
        grads[recipe] = (out.detach(), m[0].weight.grad.clone())
    # RHT touches only wgrad; 2-D tiles touch the forward (the weight)
    assert torch.equal(grads["nvfp4:no_sr"][0], grads["nvfp4:no_sr:no_rht"][0])
    assert not torch.equal(grads["nvfp4:no_sr"][1], grads["nvfp4:no_sr:no_rht"][1])
    assert not torch.equal(grads["nvfp4:no_sr"][0], grads["nvfp4:no_sr:no_2d"][0])


def test_stochastic_rounding_is_private_and_unbiased() -> None:
    m = _layer("nvfp4:no_rht")
    x = torch.randn(16, 48)
    c = torch.randn(16, 32)  # dY off the E2M1 grid
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    outs = []
    for _ in range(100):
        xi = x.clone().requires_grad_(True)
        (m(xi) * c).sum().backward()
        outs.append(xi.grad.clone())
    assert torch.equal(torch.rand(3), before)  # torch's global stream untouched
    assert not torch.equal(outs[0], outs[1])  # fresh draws each backward
    w = nvfp4_quantize(m[0].weight.detach(), NVFP4Options(tile_2d=True)).dequantized
    exact = c @ w
    one = (outs[0] - exact).pow(2).mean()
    mean = (torch.stack(outs).mean(0) - exact).pow(2).mean()
    assert mean < one / 20  # unbiased: averaging draws converges to the exact product


def test_trains_on_cpu() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    apply_fp8(model, "nvfp4", backend="emulated")
    target = nn.Linear(32, 8)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        x = torch.randn(32, 32)
        loss = (model(x) - target(x).detach()).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5])


def test_plan_and_rows_of_an_nvfp4_layer() -> None:
    m = _layer("nvfp4")
    plan = plan_for("0", m[0])
    assert plan.scaling == "nvfp4" and plan.formats["activation"] == "e2m1"
    x = torch.randn(32, 48)
    p = tensor_partial(x, plan, "activation")
    assert finalize(p, variant_format(plan, "activation", "actual")) == pytest.approx(nvfp4_quant_stats(x))
    col = finalize(tensor_partial(x, plan, "activation", "nvfp4_columnwise"), "e2m1")
    assert col == pytest.approx(nvfp4_quant_stats(x, NVFP4Options(rht=True), columnwise=True))
    # an FP8 what-if on an NVFP4 layer is judged in E4M3
    mx = finalize(tensor_partial(x, plan, "activation", "mxfp8"), variant_format(plan, "activation", "mxfp8"))
    assert mx == pytest.approx(block_quant_stats(x, "mxfp8", "e4m3"))


def test_block_columnwise_partial_is_the_transposed_operand() -> None:
    torch.manual_seed(1)
    x = torch.randn(64, 96) * torch.exp(torch.randn(64, 1) * 2)
    plan = LayerPlan("l", True, {"gradient": "e4m3"}, scaling="block")
    got = finalize(tensor_partial(x, plan, "gradient", "block_columnwise"), "e4m3")
    assert got == pytest.approx(block_quant_stats(x.t().contiguous(), "block128", "e4m3"))


def test_whatif_nvfp4_on_bf16_and_columnwise_rows_in_the_records(tmp_path) -> None:
    def run(recipe: str, whatif: tuple[str, ...]) -> list[dict]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
        report = apply_fp8(model, recipe, backend="emulated")
        with Monitor(model, {"every_n_steps": 1, "whatif": whatif}, log_dir=tmp_path / recipe,
                     apply_report=report) as mon:
            for _ in range(2):
                loss = model(torch.randn(48, 32)).pow(2).mean()
                loss.backward()
                mon.step(loss=loss)
                model.zero_grad()
        return [json.loads(line) for line in open(mon.run_dir / "tensor_stats.jsonl")]

    rows = run("bf16", ("nvfp4",))
    variants = {(r["layer"], r["tensor"], r["variant"]) for r in rows}
    for layer in ("0", "2"):
        for t in ("activation", "weight", "gradient"):
            assert {(layer, t, v) for v in ("shadow", "nvfp4", "nvfp4_columnwise")} <= variants
    nv = [r for r in rows if r["variant"] == "nvfp4"]
    assert all(r["stats"]["current_scale"] * r["stats"]["amax"] == pytest.approx(6.0, rel=1e-5) for r in nv)
    rows = run("mxfp8", ())
    assert {r["variant"] for r in rows} == {"actual", "actual_columnwise"}


def test_stochastic_rounding_state_is_checkpointed_and_a_resumed_run_rounds_alike(tmp_path) -> None:
    """The NVFP4 gradients' stochastic-rounding generator travels in the layer's ``_extra_state``:
    a model rebuilt (its generator seeded differently) and loaded from a checkpoint taken after two
    steps computes the same gradients over the next two steps as the uninterrupted model; without
    the generator state it does not."""
    torch.manual_seed(1)
    xs = [torch.randn(32, 48) for _ in range(4)]
    gs = [torch.randn(32, 32) for _ in range(4)]

    def steps(m: nn.Module, idx) -> list[torch.Tensor]:
        out = []
        for i in idx:
            m.zero_grad()
            m(xs[i]).backward(gs[i])
            out.append(m[0].weight.grad.clone())
        return out

    run = _layer("nvfp4")
    steps(run, [0, 1])
    torch.save(run.state_dict(), tmp_path / "ckpt.pt")
    want = steps(run, [2, 3])

    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert set(state["0._extra_state"]["nvfp4_sr_generators"]) == {"cpu"}
    resumed = _layer("nvfp4", seed=7)  # other weights and a generator seeded later: both restored
    resumed.load_state_dict(state)
    got = steps(resumed, [2, 3])
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)

    state["0._extra_state"].pop("nvfp4_sr_generators")
    fresh = _layer("nvfp4")
    fresh.load_state_dict(state)
    assert not torch.equal(steps(fresh, [2])[0], want[0])  # the rounding draws differ
    no_sr = _layer("nvfp4:no_sr")
    steps(no_sr, [0])
    assert "nvfp4_sr_generators" not in no_sr.state_dict()["0._extra_state"]  # nothing drawn
