"""Mixture-of-experts selectors: ``re:`` over expert projections, rankings holding expert rows,
the keywords in the monitor's ``layers=``, routers that are no linear layer."""

from __future__ import annotations

import json

import pytest
import torch

import fp8track
from fp8track import apply_fp8
from fp8track.execution.experts import ROUTER_REASON, projection_of_row
from fp8track.execution.fp8_experts import EmulatedFP8Experts
from fp8track.trial import align_ranking, layer_costs

from helpers.moe import batch, forward_loss, tiny_moe

L1 = "model.layers.1.mlp.experts"


def test_regex_terms_reach_expert_projections_and_a_split_group_is_listed_by_projection():
    model = tiny_moe("mixtral")
    term = r"re:layers\.1\..*experts\.down_proj$"
    report = apply_fp8(model, "current", bf16_layers=term, backend="emulated")
    bf16 = dict(report.bf16_layers)
    assert bf16 == {f"{L1}.down_proj": term}
    assert L1 not in bf16  # the group is not BF16 as a whole: its gate_up_proj runs FP8
    assert f"{L1}.gate_up_proj" in report.fp8_layers and "model.layers.0.mlp.experts" in report.fp8_layers
    assert model.model.layers[1].mlp.experts.fp8_params == ("gate_up_proj",)


def test_bad_regex_lists_expert_projections_among_the_candidates():
    with pytest.raises(fp8track.ConfigError, match=rf"{L1}\.down_proj"):
        apply_fp8(tiny_moe("mixtral"), "current", bf16_layers="re:nothing_here", backend="emulated")


def test_a_ranking_of_expert_rows_keeps_their_projections_in_bf16():
    """The diagnosis ranks one expert's rows; auto:K keeps that expert's projection (no backend keeps
    one expert alone), experts of one projection counting once."""
    assert projection_of_row(f"{L1}.down_proj.expert_3") == f"{L1}.down_proj"
    assert projection_of_row("model.layers.1.mlp.expert_gate") == "model.layers.1.mlp.expert_gate"
    ranking = [f"model.{L1}.down_proj.expert_2", f"model.{L1}.down_proj.expert_0", "model.lm_head",
               f"model.{L1}.down_proj"]
    model = tiny_moe("mixtral")
    aligned = align_ranking(ranking, [c.name for c in layer_costs(model)])
    assert aligned == [f"{L1}.down_proj", "lm_head"]
    canonical = [r.removeprefix("model.") for r in ranking]  # as the monitor names the bare model
    report = apply_fp8(model, "current", bf16_layers="auto:2", ranking=canonical, backend="emulated")
    bf16 = dict(report.bf16_layers)
    assert bf16[f"{L1}.down_proj"] == "auto:2 (rank 1)" and bf16["lm_head"] == "auto:2 (rank 2)"
    assert model.model.layers[1].mlp.experts.fp8_params == ("gate_up_proj",)


def test_router_keyword_and_fp8_routers_on_routers_that_are_no_linear_layer():
    model = tiny_moe("mixtral")  # MixtralTopKRouter: F.linear on its own weight, not an nn.Linear
    report = apply_fp8(model, "current", bf16_layers="router", backend="emulated")
    assert any(n.startswith("router: model.layers.0.mlp.gate, model.layers.1.mlp.gate") for n in report.notes)
    model = tiny_moe("mixtral")
    with pytest.warns(UserWarning, match="computes the router logits in its own forward"):
        report = apply_fp8(model, "current", backend="emulated", fp8_routers=True)
    assert set(dict(report.unconverted)) == {"model.layers.0.mlp.gate", "model.layers.1.mlp.gate"}
    model = tiny_moe("phimoe")  # an nn.Linear subclass returning a tuple: listed when asked for in FP8
    with pytest.warns(UserWarning, match="not exactly nn.Linear"):
        report = apply_fp8(model, "current", backend="emulated", fp8_routers=True)
    assert "model.layers.0.mlp.router" in dict(report.unconverted)


@pytest.mark.parametrize("layers", ["experts", ["re:experts.down_proj"]])
def test_monitor_layers_take_moe_keywords_and_expert_projections(tmp_path, layers):
    model = tiny_moe("qwen2moe")
    report = apply_fp8(model, "current", backend="emulated")
    with fp8track.Monitor(model, fp8track.MonitorConfig(every_n_steps=1), layers=layers, log_dir=tmp_path,
                          apply_report=report) as mon:
        forward_loss(model, "qwen2moe", batch(0)).backward()
        mon.step(loss=torch.tensor(1.0))
    rows = [json.loads(x) for x in (mon.run_dir / "tensor_stats.jsonl").read_text().splitlines()]
    groups = {r["layer"].split(".experts.")[0] for r in rows}
    assert groups == {"model.layers.0.mlp", "model.layers.1.mlp"}  # experts only, no attention, no shared
    assert isinstance(model.model.layers[0].mlp.experts, EmulatedFP8Experts)
    with pytest.raises(fp8track.ConfigError, match="no mixture-of-experts shared experts"):
        fp8track.Monitor(tiny_moe("mixtral"), layers="shared_experts", log_dir=tmp_path)


def test_low_fp8_share_warning_says_why_experts_and_routers_are_not_fp8(tmp_path):
    model = tiny_moe("mixtral")
    report = apply_fp8(model, "current", bf16_layers="experts", backend="emulated")
    with pytest.warns(UserWarning, match="of the GEMM FLOPs ran in FP8") as caught:
        with fp8track.Monitor(model, fp8track.MonitorConfig(every_n_steps=1), log_dir=tmp_path,
                              apply_report=report) as mon:
            forward_loss(model, "mixtral", batch(0)).backward()
            mon.step(loss=torch.tensor(1.0))
    text = next(str(w.message) for w in caught if "GEMM FLOPs" in str(w.message))
    assert f"{L1}.gate_up_proj (kept in BF16: experts (mixture-of-experts keyword))" in text
    assert f"model.layers.1.mlp.gate (kept in BF16: {ROUTER_REASON})" in text
    assert "not an FP8 layer" not in text


def test_router_linears_converted_by_fp8_routers_are_monitored_as_fp8_layers(tmp_path):
    """SwitchTransformers' router ``classifier`` is an exact nn.Linear: ``fp8_routers=True`` makes it
    an FP8 layer. The monitor must record it as one (rows of the FP8 GEMM, FP8 FLOPs), not leave it
    out as a tuple-returning router subclass (it did: no rows, and the share said 0.988, not 1.0)."""
    model = tiny_moe("switch")
    report = apply_fp8(model, "current", backend="emulated", fp8_routers=True)
    routers = [n for n in report.fp8_layers if n.endswith("router.classifier")]
    assert len(routers) == 4 and not report.unconverted  # every GEMM of the model runs FP8
    seen: dict[str, torch.Tensor] = {}
    for name in routers:
        model.get_submodule(name).register_forward_hook(
            lambda m, a, out, name=name: seen.__setitem__(name, a[0].detach()))
    with fp8track.Monitor(model, fp8track.MonitorConfig(every_n_steps=1), log_dir=tmp_path,
                          apply_report=report) as mon:
        forward_loss(model, "switch", batch(0)).backward()
        mon.step(loss=torch.tensor(1.0))
    rows = {(r["layer"], r["tensor"]): r for r in map(json.loads, (mon.run_dir / "tensor_stats.jsonl")
                                                      .read_text().splitlines())}
    for name in routers:
        act = rows[(name, "activation")]
        assert act["variant"] == "actual"
        assert act["stats"]["amax"] == pytest.approx(float(seen[name].abs().max()), rel=1e-6)
        assert (name, "gradient") in rows and (name, "weight") in rows
    assert mon.fp8_flop_share == 1.0
