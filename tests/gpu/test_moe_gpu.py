"""Mixture-of-experts on CUDA: torchao's FP8 MoE training through apply_fp8 (rowwise grouped GEMMs,
Triton casts), monitored per expert; the emulated grouped GEMMs on the device. `make test-gpu`;
skipped without CUDA. Sizes are multiples of 16 (torchao's FP8 grouped GEMM alignment)."""

from __future__ import annotations

import json

import pytest
import torch

import fp8track
from fp8track import apply_fp8

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _mixtral() -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.MixtralConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                           num_experts_per_tok=2, max_position_embeddings=256)
    return tf.MixtralForCausalLM(cfg).cuda().to(torch.bfloat16).train()


def _ids(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (4, 128), generator=g).cuda()


def test_torchao_rowwise_moe_training_converts_the_experts_and_the_monitor_sees_them(tmp_path):
    pytest.importorskip("torchao.prototype.moe_training")
    model = _mixtral()
    ids = _ids(0)
    with torch.no_grad():
        plain = model(ids).logits.float()
    report = apply_fp8(model, "rowwise", backend="torchao")
    assert "model.layers.0.mlp.experts" in report.fp8_layers and not report.unconverted
    assert type(model.model.layers[0].mlp.experts.down_proj).__module__.startswith("torchao")
    with torch.no_grad():
        fp8 = model(ids).logits.float()
    rel = ((fp8 - plain).norm() / plain.norm()).item()
    assert 1e-4 < rel < 0.2  # FP8 rounding, and only rounding
    with fp8track.Monitor(model, fp8track.MonitorConfig(every_n_steps=1), log_dir=tmp_path,
                          apply_report=report) as mon:
        out = model(ids, labels=ids)
        out.loss.backward()
        mon.step(loss=out.loss)
    rows = [json.loads(x) for x in (mon.run_dir / "tensor_stats.jsonl").read_text().splitlines()]
    experts = {r["layer"] for r in rows if ".expert_" in r["layer"] and r["variant"] == "actual"}
    assert any(r.startswith("model.layers.0.mlp.experts.down_proj.expert_") for r in experts)
    assert mon.fp8_flop_share > 0.9  # experts and attention in FP8; routers and head are small


@pytest.mark.parametrize("recipe", ["current", "delayed", "mxfp8", "block"])
def test_emulated_experts_train_on_cuda(tmp_path, recipe):
    model = _mixtral()
    report = apply_fp8(model, recipe, backend="emulated")
    assert "model.layers.1.mlp.experts" in report.fp8_layers
    with fp8track.Monitor(model, fp8track.MonitorConfig(every_n_steps=1), log_dir=tmp_path,
                          apply_report=report) as mon:
        for step in range(2):
            out = model(_ids(step), labels=_ids(step))
            out.loss.backward()
            mon.step(loss=out.loss)
    assert torch.isfinite(out.loss)
    metrics = [json.loads(x)["metrics"] for x in (mon.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["fp8/router/aux_loss"] > 0
