"""Module-list MoEs (SwitchTransformers: an ``nn.ModuleDict`` of per-expert MLPs, a top-1 router with
a capacity): each expert's rows carry its tokens, an expert without tokens has no row, the router's
dropped share; expert rows of every form parse to their group for the diagnosis."""

from __future__ import annotations

import json

import pytest
import torch

import fp8track
from fp8track import apply_fp8
from fp8track.execution.experts import parse_expert_row

from helpers.moe import E, batch, forward_loss, tiny_moe

BLOCK = "encoder.block.0.layer.1.mlp"


@pytest.mark.parametrize("capacity", [64, 1])
def test_switch_expert_rows_carry_tokens_and_the_router_reports_drops(tmp_path, capacity):
    model = tiny_moe("switch")
    for m in model.modules():
        if hasattr(m, "expert_capacity"):
            m.expert_capacity = capacity
    masks: list[torch.Tensor] = []
    router = model.get_submodule(f"{BLOCK}.router")
    router.register_forward_hook(lambda m, a, out: masks.append(out[0].detach()))
    report = apply_fp8(model, "current", backend="emulated")
    with fp8track.Monitor(model, fp8track.MonitorConfig(every_n_steps=1), log_dir=tmp_path,
                          apply_report=report) as mon:
        forward_loss(model, "switch", batch(0)).backward()
        mon.step(loss=torch.tensor(1.0))
    rows = {(r["layer"], r["tensor"]): r["stats"]
            for r in map(json.loads, (mon.run_dir / "tensor_stats.jsonl").read_text().splitlines())}
    metrics = json.loads((mon.run_dir / "metrics.jsonl").read_text().splitlines()[0])["metrics"]
    mask = masks[0]  # [B, T, E]: 1 where a token goes to an expert, after capacity
    kept = mask.sum(dim=(0, 1))
    tokens = mask.shape[0] * mask.shape[1]
    for e in range(E):
        act = rows.get((f"{BLOCK}.experts.expert_{e}.wi", "activation"))
        grad = rows.get((f"{BLOCK}.experts.expert_{e}.wo", "gradient"))
        if kept[e] == 0:
            assert act is None and grad is None
        else:
            assert act["tokens"] == kept[e] and grad["tokens"] == kept[e]
    dropped = metrics[f"fp8/router/{BLOCK}/dropped_pct"]
    assert dropped == pytest.approx(100.0 * (tokens - float(kept.sum())) / tokens)
    # 2 sequences of 8 tokens: capacity 1 keeps at most 4 tokens of each (one per expert)
    assert dropped >= 50.0 if capacity == 1 else dropped == 0.0
    counts = kept.double()
    assert metrics[f"fp8/router/{BLOCK}/load_cv"] == pytest.approx(
        float(counts.std(unbiased=False) / counts.mean()))


def test_mixtral_router_has_no_dropped_share(tmp_path):
    model = tiny_moe("mixtral")
    with fp8track.Monitor(model, fp8track.MonitorConfig(every_n_steps=1), log_dir=tmp_path) as mon:
        forward_loss(model, "mixtral", batch(0)).backward()
        mon.step(loss=torch.tensor(1.0))
    metrics = json.loads((mon.run_dir / "metrics.jsonl").read_text().splitlines()[0])["metrics"]
    assert "fp8/router/model.layers.0.mlp/aux_loss" in metrics
    assert not any(k.endswith("dropped_pct") for k in metrics)


@pytest.mark.parametrize(("row", "parsed"), [
    ("model.layers.1.mlp.experts.down_proj.expert_3", ("model.layers.1.mlp.experts.down_proj", 3)),
    ("encoder.block.1.layer.1.mlp.experts.expert_2.wi", ("encoder.block.1.layer.1.mlp.experts.wi", 2)),
    ("model.blocks.0.moe.experts.7.w1", ("model.blocks.0.moe.experts.w1", 7)),
    ("experts.0.fc.0", ("experts.fc.0", 0)),
    ("decoder.layers.3.mlp.experts.linear_fc1.gemm_5", ("decoder.layers.3.mlp.experts.linear_fc1", 5)),
    ("model.layers.3.self_attn.q_proj", None),
    ("model.layers.3.mlp.experts", None),
    ("model.layers.3.mlp.experts.down_proj", None),
])
def test_expert_rows_of_every_form_parse_to_their_group(row, parsed):
    assert parse_expert_row(row) == parsed
