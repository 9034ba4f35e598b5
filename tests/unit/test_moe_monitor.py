"""Mixture-of-experts monitoring: per-expert rows, router statistics and the executed FP8 FLOP share.

Expected values are computed here from the routing the test itself chose or observed, with the
single-tensor statistics (``quant_stats``) and hand-made FLOP counts, never with the grouped code.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import fp8track
from fp8track import apply_fp8
from fp8track.execution.experts import find_moe
from fp8track.execution.recipes import Recipe
from fp8track.numerics.stats import quant_stats

from helpers.moe import ALL_FAMILIES, E, H, K, batch, forward_loss, tiny_moe

STATS = ("amax", "underflow_pct", "sqnr_db", "cos", "scale")


class _Block(torch.nn.Module):
    """An MoE block without router: the experts run on routing the test chooses."""

    def __init__(self, experts: torch.nn.Module) -> None:
        super().__init__()
        self.experts = experts

    def forward(self, hidden, top_k_index, top_k_weights):
        return self.experts(hidden, top_k_index, top_k_weights)


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "tensor_stats.jsonl").read_text().splitlines()]


def _metrics(run_dir: Path) -> dict[int, dict]:
    return {
        r["step"]: r["metrics"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    }


def _close(a: dict, b: dict) -> None:
    for s in STATS:
        assert a[s] == pytest.approx(b[s], rel=1e-6, abs=1e-9), s


def _routing(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-2 routing over 4 experts that never picks expert 3 (it must get no activation row)."""
    g = torch.Generator().manual_seed(7)
    idx = torch.stack([torch.randperm(3, generator=g)[:K] for _ in range(tokens)])
    return idx, torch.softmax(torch.randn(tokens, K, generator=g), -1)


@pytest.mark.parametrize("recipe", ["current", "delayed:hybrid:h4:max", None])
def test_per_expert_rows_equal_each_experts_own_statistics(tmp_path, recipe):
    """Activation rows: expert e's routed tokens; weight rows: its slice; gradient rows of down_proj:
    with loss = sum(output), dY of a slot's row is its routing weight in every column. ``None``: an
    unconverted module (a BF16 control) watched by the grouped-GEMM spy, shadow rows."""
    model = _Block(tiny_moe("mixtral").model.layers[0].mlp.experts)
    report = apply_fp8(model, recipe, backend="emulated") if recipe else None
    torch.manual_seed(8)
    tokens = 10
    hidden = torch.randn(tokens, H)
    idx, weights = _routing(tokens)
    cfg = fp8track.MonitorConfig(every_n_steps=1)
    with fp8track.Monitor(model, cfg, log_dir=tmp_path, apply_report=report) as mon:
        for _ in range(2):  # delayed scaling: step 1 uses the scales step 0 produced
            model(hidden, idx, weights).sum().backward()
            mon.step(loss=torch.tensor(1.0))
    rows = {(r["layer"], r["tensor"]): r for r in _rows(mon.run_dir) if r["step"] == 1}
    variant = "actual" if recipe else "shadow"
    formats = (
        Recipe.parse(recipe).formats if recipe else Recipe("current", "hybrid").formats
    )  # shadow: hybrid
    fwd, bwd = formats.for_tensor("activation").name, formats.for_tensor("gradient").name
    experts = model.experts
    name = "experts"
    for e in range(E):
        tok = torch.where((idx == e).any(-1))[0]
        act = rows.get((f"{name}.gate_up_proj.expert_{e}", "activation"))
        if tok.numel() == 0:
            assert act is None and (f"{name}.down_proj.expert_{e}", "gradient") not in rows
        else:
            assert act["variant"] == variant and act["stats"]["tokens"] == tok.numel()
            scale = None
            if recipe and recipe.startswith("delayed"):
                scale = experts.fp8_quantizers("gate_up_proj").last_scales["activation"][e]
                assert act["stats"]["scale"] == pytest.approx(float(scale))
            _close(act["stats"], quant_stats(hidden[tok], fwd, scale))
            slot_w = torch.cat([weights[t][idx[t] == e] for t in tok.tolist()])
            dy = slot_w.unsqueeze(1).expand(-1, H)
            grad = rows[(f"{name}.down_proj.expert_{e}", "gradient")]
            assert grad["stats"]["tokens"] == tok.numel()
            if not (recipe and recipe.startswith("delayed")):
                _close(grad["stats"], quant_stats(dy, bwd))
        w = rows[(f"{name}.down_proj.expert_{e}", "weight")]
        if not (recipe and recipe.startswith("delayed")):
            _close(w["stats"], quant_stats(experts.down_proj[e].detach(), fwd))
    agg = rows[(f"{name}.gate_up_proj", "activation")]
    assert agg["stats"]["tokens"] == tokens * K
    assert agg["stats"]["amax"] == pytest.approx(hidden.abs().max().item())
    assert agg["stats"]["scale"] == pytest.approx(
        min(rows[(f"{name}.gate_up_proj.expert_{e}", "activation")]["stats"]["scale"] for e in range(3)))
    metrics = _metrics(mon.run_dir)[1]
    assert f"fp8/{name}.gate_up_proj/activation/sqnr_db" in metrics  # the aggregate as scalars
    assert not any("expert_0" in k for k in metrics)  # one expert's rows go to the tables only


def test_router_statistics_match_the_models_own_aux_loss(tmp_path):
    """A one-layer Mixtral: its load-balancing loss (transformers' load_balancing_loss_func over that
    layer's logits) equals fp8/router/aux_loss; entropy and margin recomputed from its logits."""
    model = tiny_moe("mixtral", num_hidden_layers=1)
    ids = batch(3)
    logits: list[torch.Tensor] = []
    model.model.layers[0].mlp.gate.register_forward_hook(lambda m, a, out: logits.append(out[0].detach()))
    with fp8track.Monitor(model, fp8track.MonitorConfig(every_n_steps=1), log_dir=tmp_path) as mon:
        out = model(ids, labels=ids, output_router_logits=True)
        out.loss.backward()
        mon.step(loss=out.loss)
    m = _metrics(mon.run_dir)[0]
    block = "model.layers.0.mlp"
    assert m[f"fp8/router/{block}/aux_loss"] == pytest.approx(float(out.aux_loss), rel=1e-6)
    assert m["fp8/router/aux_loss"] == pytest.approx(float(out.aux_loss), rel=1e-6)
    z = logits[0].float()
    p = torch.softmax(z, -1)
    assert m[f"fp8/router/{block}/entropy"] == pytest.approx(float(-(p * p.log()).sum(-1).mean()), rel=1e-5)
    top = torch.topk(z, K + 1, -1).values
    assert m[f"fp8/router/{block}/topk_margin"] == pytest.approx(
        float((top[:, K - 1] - top[:, K]).mean()), rel=1e-5
    )
    assert m[f"fp8/router/{block}/logit_amax"] == pytest.approx(float(z.abs().max()), rel=1e-6)
    assert m[f"fp8/router/{block}/flip_pct"] == 0.0  # a float32 model: both logits are float32
    counts = torch.bincount(torch.topk(p, K, -1).indices.reshape(-1), minlength=E).double()
    assert m[f"fp8/router/{block}/load_cv"] == pytest.approx(
        float(counts.std(unbiased=False) / counts.mean())
    )
    assert m[f"fp8/router/{block}/z_loss"] == pytest.approx(
        float(torch.logsumexp(z, -1).square().mean()), rel=1e-5
    )


class _GemmFlops(TorchFunctionMode):
    """An independent count of the forward GEMM FLOPs on parameters: F.linear, bmm, grouped_mm,
    attributed to the parameter's owner (``2 * rows * in * out``)."""

    def __init__(self, owners: dict[int, str]) -> None:
        super().__init__()
        self.owners = owners
        self.flops: dict[str, float] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        w = args[1] if len(args) > 1 else kwargs.get("weight")
        owner = self.owners.get(w.untyped_storage().data_ptr()) if isinstance(w, torch.Tensor) else None
        if owner is not None:
            if func is F.linear:
                n = 2 * args[0].numel() * w.shape[0]
            elif func in (torch.matmul, torch.Tensor.matmul, torch.mm):  # DBRX's experts: x @ w.t()
                n = 2 * args[0].numel() * out.shape[-1]
            elif func in (torch.bmm, torch._grouped_mm, getattr(F, "grouped_mm", None)) and args[0].dim() in (
                2,
                3,
            ):
                n = 2 * args[0].numel() * out.shape[-1]
            else:
                n = 0
            self.flops[owner] = self.flops.get(owner, 0) + n
        return out


@pytest.mark.parametrize("name", ALL_FAMILIES)
def test_fp8_flop_share_is_the_executed_share(tmp_path, name):
    """The monitor's share (hooks) equals an independent count on the same, unconverted model's
    forward, each GEMM attributed to its module (FP8 where apply_fp8 put it)."""
    ids = batch(5)
    reference = tiny_moe(name)
    owners = {}
    for mod_name, module in reference.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            if p.dim() >= 2 and "embed" not in p_name and "embed" not in mod_name and "shared" != mod_name:
                owners[p.untyped_storage().data_ptr()] = mod_name
    counter = _GemmFlops(owners)
    with counter, torch.no_grad():
        forward_loss(reference, name, ids)
    model = tiny_moe(name)
    report = apply_fp8(
        model, "current", bf16_layers="experts" if name == "mixtral" else "none", backend="emulated"
    )
    fp8_modules = set(report.fp8_layers)

    def is_fp8(owner: str) -> bool:
        return owner in fp8_modules
    total = sum(counter.flops.values())
    expected = sum(f for o, f in counter.flops.items() if is_fp8(o)) / total
    with fp8track.Monitor(
        model, fp8track.MonitorConfig(every_n_steps=1), log_dir=tmp_path, apply_report=report
    ) as mon:
        forward_loss(model, name, ids).backward()
        mon.step(loss=torch.tensor(1.0))
    assert mon.fp8_flop_share == pytest.approx(expected, rel=0.01)
    if name == "mixtral":  # the case the share used to report as 1.0
        assert mon.fp8_flop_share < 0.5
    assert not math.isnan(mon.fp8_flop_share)


@pytest.mark.parametrize("name", ["llama4", "phimoe"])
def test_models_with_router_subclasses_train_under_the_monitor(tmp_path, name):
    model = tiny_moe(name)
    report = apply_fp8(model, "delayed", backend="emulated")
    with fp8track.Monitor(
        model, fp8track.MonitorConfig(every_n_steps=2), log_dir=tmp_path, apply_report=report
    ) as mon:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        for step in range(4):
            loss = forward_loss(model, name, batch(step))
            loss.backward()
            opt.step()
            mon.step(loss=loss)
            opt.zero_grad()
    rows = _rows(mon.run_dir)
    layers = {r["layer"] for r in rows}
    block = find_moe(model).blocks[0]
    assert f"{block.experts.fqn}.down_proj.expert_0" in layers
    assert not any(r["layer"] == block.router_gemm for r in rows)  # routers: router statistics instead
    metrics = _metrics(mon.run_dir)[2]
    assert math.isfinite(metrics["fp8/router/aux_loss"])
    assert all(math.isfinite(r["stats"]["sqnr_db"]) or r["stats"]["sqnr_db"] == math.inf for r in rows)


@pytest.mark.parametrize("impl", ["eager", "batched_mm"])
def test_fp8_flop_share_counts_high_precision_experts_of_every_implementation(tmp_path, impl):
    """Experts kept in BF16 under transformers' ``eager`` / ``batched_mm`` implementations run no
    ``grouped_mm`` the spy could see; their FLOPs still count (from the routing), so the share is
    the executed one (it said 0.97 here, and the low-share warning stayed silent)."""
    ids = batch(5)
    reference = tiny_moe("mixtral")  # grouped_mm: the independent count sees every expert GEMM
    owners = {
        p.untyped_storage().data_ptr(): mod_name
        for mod_name, module in reference.named_modules()
        for p_name, p in module.named_parameters(recurse=False)
        if p.dim() >= 2 and "embed" not in mod_name
    }
    counter = _GemmFlops(owners)
    with counter, torch.no_grad():
        forward_loss(reference, "mixtral", ids)
    model = tiny_moe("mixtral")
    model.set_experts_implementation(impl)
    report = apply_fp8(model, "current", bf16_layers="experts", backend="emulated")
    fp8 = sum(f for o, f in counter.flops.items() if o in report.fp8_layers)
    expected = fp8 / sum(counter.flops.values())
    with pytest.warns(UserWarning, match="only 24.8% of the GEMM FLOPs ran in FP8"), fp8track.Monitor(
        model, fp8track.MonitorConfig(every_n_steps=1), log_dir=tmp_path, apply_report=report
    ) as mon:
        forward_loss(model, "mixtral", ids).backward()
        mon.step(loss=torch.tensor(1.0))
    assert expected == pytest.approx(0.248, abs=1e-3)  # attention and head in FP8, experts and routers not
    assert mon.fp8_flop_share == pytest.approx(expected, rel=1e-6)


def test_unconverted_experts_on_transformers_grouped_mm_fallback_get_their_rows(tmp_path, monkeypatch):
    """transformers runs its ``grouped_mm`` implementation through its own custom op where
    ``torch._grouped_mm`` cannot run (under torch.compile with float32 weights, unaligned CPU
    tensors on torch <= 2.10): the spy must see that op too, or a BF16 control has no expert rows."""
    import transformers.integrations.moe as hf_moe

    monkeypatch.setattr(hf_moe, "_can_use_grouped_mm", lambda *a: False)
    model = _Block(tiny_moe("mixtral").model.layers[0].mlp.experts)
    torch.manual_seed(8)
    tokens = 10
    hidden = torch.randn(tokens, H)
    idx, weights = _routing(tokens)
    with fp8track.Monitor(model, fp8track.MonitorConfig(every_n_steps=1), log_dir=tmp_path) as mon:
        model(hidden, idx, weights).sum().backward()
        mon.step(loss=torch.tensor(1.0))
    rows = {(r["layer"], r["tensor"]): r for r in _rows(mon.run_dir)}
    for e in range(3):  # expert 3 gets no token (no row), checked in the grouped_mm test above
        tok = torch.where((idx == e).any(-1))[0]
        act = rows[(f"experts.gate_up_proj.expert_{e}", "activation")]
        assert act["variant"] == "shadow" and act["stats"]["tokens"] == tok.numel()
        _close(act["stats"], quant_stats(hidden[tok], "e4m3"))
        slot_w = torch.cat([weights[t][idx[t] == e] for t in tok.tolist()])
        _close(rows[(f"experts.down_proj.expert_{e}", "gradient")]["stats"],
               quant_stats(slot_w.unsqueeze(1).expand(-1, H), "e5m2"))
    assert ("experts.gate_up_proj.expert_3", "activation") not in rows
    assert mon.fp8_flop_share == 0.0  # nothing in FP8, but the expert GEMMs were counted


def test_blocks_outside_the_selected_layers_get_no_router_capture(tmp_path):
    """``layers=`` naming one MoE block: the other block's router has no metrics, and the share is
    that of the selected layers' GEMMs alone (its router counted no FLOPs)."""
    ids = batch(5)
    model = tiny_moe("mixtral")
    report = apply_fp8(model, "current", backend="emulated")
    blocks = find_moe(model).blocks
    with fp8track.Monitor(
        model, fp8track.MonitorConfig(every_n_steps=1), log_dir=tmp_path, apply_report=report,
        layers=f"re:^{blocks[1].fqn.replace('.', '[.]')}[.]",
    ) as mon:
        forward_loss(model, "mixtral", ids).backward()
        mon.step(loss=torch.tensor(1.0))
    metrics = _metrics(mon.run_dir)[0]
    routers = {k.split("/")[2] for k in metrics if k.startswith("fp8/router/") and k.count("/") == 3}
    assert routers == {blocks[1].fqn}
    # block 1's experts (FP8) and its router (high precision): 6 T K H I per projection pair
    # against 6 T H E for the router, T tokens, K routed experts each.
    tokens = ids.numel()
    experts_flops = 6 * tokens * K * (H * 2 * 64 + 64 * H)
    router_flops = 6 * tokens * H * E
    assert mon.fp8_flop_share == pytest.approx(experts_flops / (experts_flops + router_flops), rel=1e-6)


@pytest.mark.parametrize(("name", "share"), [("dbrx", 0.2558), ("jetmoe", 0.1385)])
def test_fp8_flop_share_counts_experts_of_an_unrecognised_layout(tmp_path, name, share):
    """DBRX's and JetMoE's experts (a layout no backend converts, listed as unconverted) run in high
    precision: the monitor counts their GEMMs (torch's FLOP counter over their forward), so the share
    equals an independent count of every parameter GEMM (it read 1.0 on DBRX)."""
    from test_moe_execution import _unrecognised_moe

    ids = batch(5)
    reference = _unrecognised_moe(name)
    owners = {
        p.untyped_storage().data_ptr(): mod_name
        for mod_name, module in reference.named_modules()
        for p_name, p in module.named_parameters(recurse=False)
        if p.dim() >= 2 and "wte" not in mod_name and "embed" not in mod_name
    }
    counter = _GemmFlops(owners)
    with counter, torch.no_grad():
        reference(input_ids=ids, labels=ids)
    model = _unrecognised_moe(name)
    with pytest.warns(UserWarning, match="not converted"):
        report = apply_fp8(model, "current", backend="emulated")
    fp8 = sum(f for o, f in counter.flops.items() if o in report.fp8_layers)
    expected = fp8 / sum(counter.flops.values())
    with fp8track.Monitor(
        model, fp8track.MonitorConfig(every_n_steps=1), log_dir=tmp_path, apply_report=report
    ) as mon:
        model(input_ids=ids, labels=ids).loss.backward()
        mon.step(loss=torch.tensor(1.0))
    assert expected == pytest.approx(share, abs=1e-4)
    assert mon.fp8_flop_share == pytest.approx(expected, rel=1e-6)
