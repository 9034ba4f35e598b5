"""torchao's MoE training on fused experts: what apply_fp8 does with it on this machine (lists the
experts: its FP8 path needs CUDA), and the monitor on experts torchao wrapped (its MXFP8 emulated
recipe runs on CPU): per-expert rows judged as torchao quantises, counted as FP8."""

from __future__ import annotations

import json

import pytest
import torch

import fp8track
from fp8track import apply_fp8
from fp8track.execution.experts import find_moe
from fp8track.numerics.stats import block_quant_stats

from helpers.moe import E, H, K, batch, forward_loss, tiny_moe

pytest.importorskip("torchao.prototype.moe_training")


def test_apply_fp8_on_torchao_lists_the_experts_with_the_reason_on_cpu():
    model = tiny_moe("mixtral")
    with pytest.warns(UserWarning, match="needs CUDA"):
        report = apply_fp8(model, "rowwise", backend="torchao")
    why = dict(report.unconverted)
    assert set(why) == {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"}
    assert "model.layers.0.self_attn.q_proj" in report.fp8_layers  # the linears run torchao's rowwise
    assert type(model.model.layers[0].mlp.experts.down_proj).__module__.startswith("torch")


def test_monitor_judges_torchao_wrapped_experts_as_torchao_quantises(tmp_path):
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
    from torchao.quantization import quantize_

    model = tiny_moe("mixtral")
    cfg = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL)  # runs on CPU
    quantize_(model, cfg, filter_fn=lambda module, fqn: fqn.endswith("experts"))  # torchtitan's filter
    assert {g.kind for g in find_moe(model).groups} == {"torchao"}
    routed, hidden = [], []
    model.model.layers[0].mlp.gate.register_forward_hook(lambda m, a, out: routed.append(out[2].detach()))
    model.model.layers[0].mlp.register_forward_pre_hook(lambda m, a: hidden.append(a[0].detach()))
    with fp8track.Monitor(model, fp8track.MonitorConfig(every_n_steps=1), log_dir=tmp_path) as mon:
        loss = forward_loss(model, "mixtral", batch(0))
        loss.backward()
        mon.step(loss=loss)
    rows = {(r["layer"], r["tensor"]): r
            for r in map(json.loads, (mon.run_dir / "tensor_stats.jsonl").read_text().splitlines())}
    assert ("model.layers.0.mlp.experts", "activation") not in rows  # no row for the module as a layer
    h, idx = hidden[0].reshape(-1, H), routed[0].reshape(-1, K)
    for e in range(E):
        tok = torch.where((idx == e).any(-1))[0]
        row = rows.get((f"model.layers.0.mlp.experts.gate_up_proj.expert_{e}", "activation"))
        if tok.numel() == 0:
            assert row is None
            continue
        assert row["variant"] == "actual" and row["stats"]["tokens"] == tok.numel()
        ref = block_quant_stats(h[tok], "mxfp8", "e4m3")
        for s in ("sqnr_db", "underflow_pct", "scale"):
            assert row["stats"][s] == pytest.approx(ref[s], rel=1e-6), s
    # the experts' GEMMs count as FP8 (attention and the head do not: they were not wrapped)
    assert 0.5 < mon.fp8_flop_share < 1.0
