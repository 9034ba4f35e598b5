"""Mixture-of-experts execution: discovery, the FP8 grouped GEMM, conversion, selectors, FLOP costs.

References are computed here with plain torch (a loop over experts, the FP8 cast by hand), never with
the grouped code under test.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from fp8track import apply_fp8
from fp8track.errors import ConfigError
from fp8track.execution.emulated_linear import EmulatedFP8Linear
from fp8track.execution.experts import ROUTER_REASON, find_moe
from fp8track.execution.fp8_experts import EmulatedFP8Experts
from fp8track.execution.grouped import GroupQuantizers, fp8_grouped_linear, grouped_mm
from fp8track.execution.recipes import Recipe
from fp8track.trial import fp8_flop_share, layer_costs

from helpers.moe import ALL_FAMILIES, FUSED_FAMILIES, E, H, K, batch, forward_loss, tiny_moe

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _fq(x: torch.Tensor, dtype: torch.dtype, fmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Current-scaling fake quantisation of one tensor by hand: ``(q values, scale)``."""
    amax = x.abs().max().to(torch.float32)
    s = (torch.tensor(fmax, dtype=torch.float64) / amax.double()).float() if amax > 0 else torch.tensor(1.0)
    return (x.float() * s).clamp(-fmax, fmax).to(dtype).float(), s


def _groups(offs: list[int]) -> list[slice]:
    bounds = [0, *offs]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


# --- the grouped GEMM ----------------------------------------------------------------------------


def test_grouped_mm_equals_a_loop_for_odd_widths_and_empty_groups():
    torch.manual_seed(0)
    offs = [3, 3, 10]  # group 1 is empty
    x, w = torch.randn(10, 7), torch.randn(3, 7, 5)  # widths the raw kernel refuses (strides % 16 bytes)
    got = grouped_mm(x, w, torch.tensor(offs, dtype=torch.int32))
    ref = torch.cat([x[g] @ w[e] for e, g in enumerate(_groups(offs))])
    assert torch.allclose(got, ref, atol=1e-5)
    a, b = torch.randn(5, 10), torch.randn(10, 7)  # grouped along the contraction: wgrad's form
    got_w = grouped_mm(a, b, torch.tensor(offs, dtype=torch.int32))
    ref_w = torch.stack([a[:, g] @ b[g] for g in _groups(offs)])
    assert got_w.shape == (3, 5, 7) and torch.allclose(got_w, ref_w, atol=1e-5)
    assert torch.equal(got_w[1], torch.zeros(5, 7))


def test_fp8_grouped_linear_current_scaling_is_per_expert_quantisation_forward_and_backward():
    torch.manual_seed(1)
    offs = [4, 4, 9, 16]
    # expert 2's rows are 1000x larger: a shared scale would flush experts 0 and 3 to zero
    x = torch.randn(16, 8)
    x[4:9] *= 1000
    x.requires_grad_(True)
    w = (torch.randn(4, 12, 8) * 0.1).requires_grad_(True)
    quant = GroupQuantizers(Recipe("current", "hybrid", gemm="fp8"), 4)
    y = fp8_grouped_linear(x, w, torch.tensor(offs, dtype=torch.int32), quant, training=True)
    dy = torch.randn_like(y)
    y.backward(dy)
    ref_y, ref_dx, ref_dw = [], [], []
    for e, g in enumerate(_groups(offs)):
        if g.stop == g.start:
            ref_dw.append(torch.zeros(12, 8))
            continue
        qx, sx = _fq(x[g].detach(), E4M3, 448.0)
        qw, sw = _fq(w[e].detach(), E4M3, 448.0)
        qg, sg = _fq(dy[g], E5M2, 57344.0)
        ref_y.append(qx @ qw.t() / (sx * sw))
        ref_dx.append(qg @ qw / (sg * sw))
        ref_dw.append(qg.t() @ qx / (sg * sx))
    assert torch.allclose(y, torch.cat(ref_y), rtol=1e-5, atol=1e-6)
    assert torch.allclose(x.grad, torch.cat(ref_dx), rtol=1e-5, atol=1e-6)
    assert torch.allclose(w.grad, torch.stack(ref_dw), rtol=1e-5, atol=1e-7)
    # the rounding is there: not the high-precision product
    assert not torch.allclose(
        y,
        torch.cat(
            [x[g].detach() @ w[e].detach().t() for e, g in enumerate(_groups(offs)) if g.stop > g.start]
        ),
        rtol=1e-6,
        atol=0,
    )


def test_delayed_scaling_keeps_one_amax_history_per_expert():
    torch.manual_seed(2)
    offs = torch.tensor([3, 3, 8], dtype=torch.int32)  # expert 1 gets no token
    quant = GroupQuantizers(Recipe("delayed", "hybrid", amax_history_len=4), 3)
    x = torch.randn(8, 16)
    x[3:] *= 50
    w = torch.randn(3, 4, 16)
    fp8_grouped_linear(x, w, offs, quant, training=True)  # step 0: scale 1 (TE's initial scale)
    assert torch.equal(quant.last_scales["activation"], torch.ones(3))
    fp8_grouped_linear(x, w, offs, quant, training=True)
    amax = torch.stack([x[:3].abs().max(), torch.tensor(0.0), x[3:].abs().max()])
    expected = torch.where(amax > 0, (448.0 / amax.double()).float(), torch.tensor(1.0))
    assert torch.equal(quant.last_scales["activation"], expected)  # expert 1 keeps 1: amax 0 is unusable
    state = quant.state_dict()
    fresh = GroupQuantizers(Recipe("delayed", "hybrid", amax_history_len=4), 3)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.delayed["activation"].amax_history, quant.delayed["activation"].amax_history)
    assert fresh.delayed["activation"].amax_history.shape == (4, 3)


# --- conversion ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mixtral", "gptoss"])
def test_converted_experts_equal_an_independent_per_expert_reference(name):
    """Mixtral ([E, out, in], SiLU gate) and gpt-oss ([E, in, out] with biases, its own clamped gate)."""
    model = tiny_moe(name)
    experts = model.model.layers[0].mlp.experts
    torch.manual_seed(3)
    tokens = 12
    hidden = torch.randn(tokens, H)
    top_k_index = torch.stack([torch.randperm(E)[:K] for _ in range(tokens)])
    top_k_weights = torch.softmax(torch.randn(tokens, K), -1)
    with torch.no_grad():
        plain = experts(hidden, top_k_index, top_k_weights)
    apply_fp8(model, "current:e4m3", backend="emulated")
    assert isinstance(experts, EmulatedFP8Experts)
    with torch.no_grad():
        got = experts(hidden, top_k_index, top_k_weights)
    up_name = "gate_up_proj"
    ref = torch.zeros(tokens, H)
    for e in range(E):
        tok, slot = torch.where(top_k_index == e)
        if tok.numel() == 0:
            continue
        w_up = getattr(experts, up_name)[e].detach()
        w_down = experts.down_proj[e].detach()
        if experts.is_transposed:
            w_up, w_down = w_up.t(), w_down.t()
        qx, sx = _fq(hidden[tok], E4M3, 448.0)
        qw, sw = _fq(w_up, E4M3, 448.0)
        h = qx @ qw.t() / (sx * sw)
        if experts.has_bias:
            h = h + experts.gate_up_proj_bias[e].detach()
        h = experts._apply_gate(h)
        qh, sh = _fq(h, E4M3, 448.0)
        qd, sd = _fq(w_down, E4M3, 448.0)
        o = qh @ qd.t() / (sh * sd)
        if experts.has_bias:
            o = o + experts.down_proj_bias[e].detach()
        ref.index_add_(0, tok, o * top_k_weights[tok, slot, None])
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-5)
    rel = ((got - plain).norm() / plain.norm()).item()
    assert 1e-4 < rel < 0.1  # FP8 rounding is in the output, and only rounding


@pytest.mark.parametrize("name", ALL_FAMILIES)
def test_every_family_converts_its_experts_keeps_routers_high_precision_and_trains(name):
    model = tiny_moe(name)
    moe = find_moe(model)
    assert moe.blocks, name
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left out silently, and nothing to warn about either
        report = apply_fp8(model, "current", backend="emulated")
    bf16 = dict(report.bf16_layers)
    for router in moe.router_gemms():
        if router in bf16 or router in dict(report.unconverted):
            assert bf16.get(router) == ROUTER_REASON
    assert not report.unconverted
    for g in moe.groups:
        if g.kind == "module_list":
            assert all(n in report.fp8_layers for n in report.fp8_layers if n.startswith(g.fqn + "."))
            assert any(n.startswith(g.fqn + ".") for n in report.fp8_layers)
        else:
            assert g.fqn in report.fp8_layers
            assert isinstance(model.get_submodule(g.fqn), EmulatedFP8Experts)
    loss = forward_loss(model, name, batch(0))
    loss.backward()
    assert torch.isfinite(loss)
    for g in moe.groups:
        for n, p in model.get_submodule(g.fqn).named_parameters():
            if g.kind != "module_list":
                assert p.grad is not None and torch.isfinite(p.grad).all(), (g.fqn, n)


def test_router_linears_are_converted_only_when_asked():
    model = tiny_moe("switch")
    classifier = "encoder.block.0.layer.1.mlp.router.classifier"
    report = apply_fp8(model, "current", backend="emulated", fp8_routers=True)
    assert classifier in report.fp8_layers
    model = tiny_moe("qwen2moe")
    report = apply_fp8(model, "current", backend="emulated")
    assert dict(report.bf16_layers)["model.layers.0.mlp.shared_expert_gate"] == ROUTER_REASON


def test_block_recipes_and_other_backends_list_experts_with_a_warning():
    model = tiny_moe("mixtral")
    with pytest.warns(UserWarning, match="not converted"):
        report = apply_fp8(model, "nvfp4", backend="emulated")
    why = dict(report.unconverted)["model.layers.0.mlp.experts"]
    assert "its grouped GEMM is not emulated" in why
    assert "model.layers.0.mlp.experts" not in report.fp8_layers
    assert not isinstance(model.model.layers[0].mlp.experts, EmulatedFP8Experts)
    model = tiny_moe("mixtral")
    with pytest.warns(UserWarning, match="not converted"):
        report = apply_fp8(model, "current", backend="torchao")
    assert "rowwise scales only" in dict(report.unconverted)["model.layers.1.mlp.experts"]


def _unrecognised_moe(name: str) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name == "dbrx":  # experts as 2-D w1 / v1 / w2 [E * F, H], run by x.matmul per expert
            return tf.DbrxForCausalLM(tf.DbrxConfig(
                vocab_size=64, d_model=H, n_heads=4, n_layers=2, max_seq_len=64,
                attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                ffn_config={"ffn_hidden_size": 64, "moe_num_experts": E, "moe_top_k": K})).float()
        return tf.JetMoeForCausalLM(tf.JetMoeConfig(  # 3-D `weight` [E, out, in] in ParallelExperts
            vocab_size=64, hidden_size=H, num_hidden_layers=2, num_key_value_heads=2, kv_channels=8,
            intermediate_size=64, num_local_experts=E, num_experts_per_tok=K,
            max_position_embeddings=64)).float()


@pytest.mark.parametrize(("name", "expected"), [
    ("dbrx", ["transformer.blocks.0.ffn.experts.mlp", "transformer.blocks.1.ffn.experts.mlp"]),
    ("jetmoe", [f"model.layers.{i}.{m}.{p}" for i in (0, 1) for m in ("mlp", "self_attention.experts")
                for p in ("input_linear", "output_linear")]),
])
def test_expert_weights_of_an_unrecognised_layout_are_listed_not_skipped(name, expected):
    """DBRX and JetMoE hold their experts in no layout find_moe knows: nothing converts or sees them,
    so apply_fp8 lists each such module in ``unconverted`` and warns (it said nothing before)."""
    model = _unrecognised_moe(name)
    assert find_moe(model).blocks == ()
    with pytest.warns(UserWarning, match="not converted"):
        report = apply_fp8(model, "current", backend="emulated")
    why = dict(report.unconverted)
    assert sorted(why) == sorted(expected)
    assert all("layout fp8track does not recognise" in why[n] for n in expected)
    assert not any(n.startswith(tuple(expected)) for n in report.fp8_layers)


def test_experts_overriding_the_dispatching_forward_are_listed_not_replaced():
    """Ergo's ErgoExperts overrides the decorated forward: one row per route, a per-expert RMSNorm,
    then the routing weights. The FP8 grouped forward would replace all of it (the norm's weight got
    no gradient, the block computed another function), so the experts stay as they are, listed."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.ErgoForCausalLM(tf.ErgoConfig(
        vocab_size=64, hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        first_dense_intermediate_size=64, num_dense_blocks=1, moe_intermediate_size=16,
        shared_intermediate_size=32, num_experts=E, num_experts_per_tok=K, max_position_embeddings=64,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"], head_dim=8)).float()
    experts = model.model.layers[1].mlp.experts
    cls = type(experts)
    with pytest.warns(UserWarning, match="not converted"):
        report = apply_fp8(model, "current", backend="emulated")
    why = dict(report.unconverted)["model.layers.1.mlp.experts"]
    assert "ErgoExperts.forward runs code of its own" in why
    assert type(experts) is cls and "model.layers.1.mlp.experts" not in report.fp8_layers
    ids = batch(3)
    model(ids, labels=ids).loss.backward()
    assert experts.post_expert_norm.weight.grad is not None  # the model's own forward ran
    mixtral = tiny_moe("mixtral")  # the decorated forward itself is converted as before
    assert not apply_fp8(mixtral, "current", backend="emulated").unconverted


def test_inplace_ops_on_a_converted_linear_output():
    torch.manual_seed(4)
    base = torch.nn.Linear(16, 8)
    layer = EmulatedFP8Linear.from_linear(base, "current")
    x = torch.randn(2, 3, 16)
    y = layer(x)
    y.add_(1.0)  # Llama 4's shared expert: out.add_(routed)
    y.sum().backward()
    g_inplace = layer.weight.grad.clone()
    layer.weight.grad = None
    (layer(x) + 1.0).sum().backward()
    assert torch.equal(g_inplace, layer.weight.grad)


# --- selectors -----------------------------------------------------------------------------------


def test_moe_keywords_and_projection_names_select_expert_parts():
    model = tiny_moe("qwen2moe")
    report = apply_fp8(model, "current", bf16_layers="experts", backend="emulated")
    bf16 = dict(report.bf16_layers)
    assert bf16["model.layers.1.mlp.experts"] == "experts (mixture-of-experts keyword)"
    assert "model.layers.0.mlp.shared_expert.up_proj" in report.fp8_layers

    model = tiny_moe("qwen2moe")
    report = apply_fp8(model, "current", bf16_layers="shared_experts", backend="emulated")
    assert "model.layers.0.mlp.shared_expert.up_proj" in dict(report.bf16_layers)
    assert "model.layers.0.mlp.experts" in report.fp8_layers

    model = tiny_moe("mixtral")
    report = apply_fp8(
        model, "current", bf16_layers="model.layers.1.mlp.experts.down_proj", backend="emulated"
    )
    assert "model.layers.1.mlp.experts.gate_up_proj" in report.fp8_layers
    assert dict(report.bf16_layers)["model.layers.1.mlp.experts.down_proj"].startswith("named")
    assert model.model.layers[1].mlp.experts.fp8_params == ("gate_up_proj",)

    model = tiny_moe("mixtral")
    report = apply_fp8(model, "current", bf16_layers="first:1", backend="emulated")
    assert "model.layers.0.mlp.experts" in dict(report.bf16_layers)
    assert "model.layers.1.mlp.experts" in report.fp8_layers


def test_bad_selectors_name_the_keywords():
    with pytest.raises(ConfigError, match="spec keywords: .*first_last.*experts"):
        apply_fp8(tiny_moe("mixtral"), "current", bf16_layers="first_and_last", backend="emulated")
    dense = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.raises(ConfigError, match="no mixture-of-experts experts"):
        apply_fp8(dense, "current", bf16_layers="experts", backend="emulated")


# --- FLOP costs ----------------------------------------------------------------------------------


def _mixtral_macs_per_token() -> tuple[int, int, int]:
    """(attention + head, routed experts, routers) multiply-accumulates per token of the tiny Mixtral,
    from its config: q/o 32x32, k/v 16x32 per layer; gate_up 128x32 and down 32x64 per routed slot;
    router 4x32 per layer; lm_head 64x32."""
    attention = 2 * (32 * 32 + 16 * 32 + 16 * 32 + 32 * 32) + 64 * 32
    experts = 2 * K * (128 * 32 + 32 * 64)
    routers = 2 * E * H
    return attention, experts, routers


def test_sweep_flop_costs_count_routed_slots_and_routers():
    model = tiny_moe("mixtral")
    costs = layer_costs(model)
    attention, experts, routers = _mixtral_macs_per_token()
    assert sum(c.macs_per_token for c in costs) == attention + experts + routers
    report = apply_fp8(model, "current", backend="emulated")
    assert fp8_flop_share(costs, report.fp8_layers) == pytest.approx(
        (attention + experts) / (attention + experts + routers)
    )
    model = tiny_moe("mixtral")
    report = apply_fp8(model, "current", bf16_layers="experts", backend="emulated")
    assert fp8_flop_share(costs, report.fp8_layers) == pytest.approx(
        attention / (attention + experts + routers)
    )


@pytest.mark.parametrize("name", FUSED_FAMILIES)
def test_layer_costs_cover_every_fused_projection(name):
    model = tiny_moe(name)
    names = {c.name for c in layer_costs(model)}
    for g in find_moe(model).groups:
        assert {f"{g.fqn}.{p.name}" for p in g.params} <= names


def test_compiled_converted_experts_train_as_the_eager_ones():
    """torch.compile of experts running the emulated FP8 grouped GEMM: torch's meta kernel of
    ``_grouped_mm`` takes BF16 only, so its float32 calls run outside the graph (a graph break, as
    the docs allow), with the eager experts' outputs and gradients. ``aot_eager`` traces the graph
    with fake tensors as inductor does (where the meta kernel failed), without inductor's codegen."""
    torch._dynamo.reset()
    experts = []
    for _ in range(2):
        model = tiny_moe("mixtral")
        apply_fp8(model, "current", backend="emulated")
        experts.append(model.model.layers[0].mlp.experts)
    torch.manual_seed(4)
    hidden = torch.randn(12, H)
    top_k_index = torch.stack([torch.randperm(E)[:K] for _ in range(12)])
    top_k_weights = torch.softmax(torch.randn(12, K), -1)
    outs = []
    runs = (lambda m: m, lambda m: torch.compile(m, backend="aot_eager"))
    for module, run in zip(experts, runs, strict=True):
        x = hidden.clone().requires_grad_()
        out = run(module)(x, top_k_index, top_k_weights)
        out.square().sum().backward()
        outs.append((out.detach(), x.grad, module.gate_up_proj.grad))
    (want, want_dx, want_dw), (got, got_dx, got_dw) = outs
    assert want_dw.abs().sum() > 0
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-7)
    assert torch.allclose(got_dx, want_dx, rtol=1e-5, atol=1e-7)
    assert torch.allclose(got_dw, want_dw, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_a_converted_model_pickles_whole_and_trains_on(recipe):
    """``torch.save(model)`` of the whole model: converted experts are of a class made at run time,
    and a delayed-scaling forward without its backward leaves a weak reference waiting."""
    import io

    model = tiny_moe("mixtral")
    apply_fp8(model, recipe, backend="emulated")
    forward_loss(model, "mixtral", batch(0)).backward()
    forward_loss(model, "mixtral", batch(1))  # no backward: its scales wait for one
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded.model.layers[0].mlp.experts) is type(model.model.layers[0].mlp.experts)
    a, b = forward_loss(model, "mixtral", batch(2)), forward_loss(loaded, "mixtral", batch(2))
    assert torch.equal(a, b)  # same weights and, under delayed scaling, the same amax histories
    b.backward()
    experts = loaded.model.layers[0].mlp.experts
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in experts.parameters())


def test_segment_amax_skips_nan_and_keeps_inf_as_the_dense_amax():
    from fp8track.execution.grouped import segment_amax

    x = torch.tensor([[1.0, float("nan")], [-3.0, 2.0], [float("nan"), float("nan")], [0.5, -float("inf")]])
    got = segment_amax(x, torch.tensor([0, 0, 1, 2]), 3)
    assert got.tolist() == [3.0, 0.0, float("inf")]
