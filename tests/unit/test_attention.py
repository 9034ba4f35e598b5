"""nn.MultiheadAttention (and the nn.Transformer layers built on it) under apply_fp8 and the monitor:
the rebuilt module computes nn.MultiheadAttention's function, every projection is converted and
monitored, and every monitored layer's counts are the hand-computed sizes of its GEMM operands."""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch
from torch import nn

import fp8track
from fp8track.execution.apply import apply_fp8
from fp8track.execution.attention import LinearMultiheadAttention, linearize_attention
from fp8track.execution.emulated_linear import EmulatedFP8Linear
from fp8track.monitoring.records import RunReader
from fp8track.numerics.stats import get_compile, set_compile

E, H, FF = 16, 4, 32

pytestmark = pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask:UserWarning")


@pytest.fixture(autouse=True)
def _eager_stats():
    mode = get_compile()
    set_compile("eager")
    yield
    set_compile(mode)


@pytest.mark.parametrize(
    "batch_first, bias, add_bias_kv, add_zero_attn, kdim, need_weights, mask, padding, batched",
    [
        c
        for c in itertools.product(
            [False, True],
            [True, False],
            [False, True],
            [False, True],
            [None, 12],
            [True, False],
            [None, "2d", "3d"],
            [False, True],
            [True, False],
        )
        if c[-1] or c[6] != "3d"
    ][::13],  # 50 of the 288 combinations, every value of each argument among them
)
def test_linear_mha_computes_nn_multihead_attention(
    batch_first, bias, add_bias_kv, add_zero_attn, kdim, need_weights, mask, padding, batched
):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(
        E,
        H,
        bias=bias,
        add_bias_kv=add_bias_kv,
        add_zero_attn=add_zero_attn,
        kdim=kdim,
        vdim=kdim,
        batch_first=batch_first,
    )
    if add_bias_kv:
        nn.init.normal_(mha.bias_k)
        nn.init.normal_(mha.bias_v)
    ours = LinearMultiheadAttention.from_mha(mha)
    L, S, B, kd = 5, 7, 3, kdim or E

    def shape(n, d):
        if not batched:
            return (n, d)
        return (B, n, d) if batch_first else (n, B, d)

    q, k = torch.randn(shape(L, E)), torch.randn(shape(S, kd))
    v = k + 0.1
    attn_mask = {None: None, "2d": torch.randn(L, S), "3d": torch.randn(B * H, L, S)}[mask]
    kpm = None
    if padding:
        kpm = torch.rand((B, S) if batched else (S,)) > 0.7
        kpm[..., 0] = False
    want = mha(q, k, v, key_padding_mask=kpm, need_weights=need_weights, attn_mask=attn_mask)
    got = ours(q, k, v, key_padding_mask=kpm, need_weights=need_weights, attn_mask=attn_mask)
    torch.testing.assert_close(got[0], want[0])
    if need_weights:
        torch.testing.assert_close(got[1], want[1])
    else:
        assert got[1] is None and want[1] is None


def test_parameters_state_dict_and_causal_mask():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    ours = LinearMultiheadAttention.from_mha(mha)
    assert ours.out_proj.weight is mha.out_proj.weight and ours.out_proj.bias is mha.out_proj.bias
    torch.testing.assert_close(
        torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]), mha.in_proj_weight
    )
    x = torch.randn(2, 6, E)
    causal = nn.Transformer.generate_square_subsequent_mask(6)
    kw = {"attn_mask": causal, "is_causal": True, "need_weights": False}
    torch.testing.assert_close(ours(x, x, x, **kw)[0], mha(x, x, x, **kw)[0])
    fresh = LinearMultiheadAttention.from_mha(nn.MultiheadAttention(E, H, batch_first=True))
    fresh.load_state_dict(mha.state_dict())  # nn.MultiheadAttention's packed keys load
    torch.testing.assert_close(fresh(x, x, x)[0], mha(x, x, x)[0])
    separate = nn.MultiheadAttention(E, H, kdim=12, vdim=10)
    ours_sep = LinearMultiheadAttention.from_mha(separate)
    assert ours_sep.k_proj.weight is separate.k_proj_weight and ours_sep.v_proj.weight.shape == (E, 10)


class Encoder(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        layer = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(E, 4)

    def forward(self, x):
        return self.head(self.encoder(x))


def test_bf16_recipe_reproduces_the_transformer_encoder():
    torch.manual_seed(0)
    model = Encoder()
    ref = copy.deepcopy(model)
    report = apply_fp8(model, "bf16", backend="emulated")
    assert isinstance(model.encoder.layers[0].self_attn, LinearMultiheadAttention)
    assert any("nn.MultiheadAttention rebuilt" in n for n in report.notes)
    x = torch.randn(3, 5, E)
    torch.testing.assert_close(model(x), ref(x))
    model.eval()
    ref.eval()
    with torch.no_grad():  # nn.TransformerEncoderLayer's fused inference path must not bypass the projections
        torch.testing.assert_close(model(x), ref(x))


def test_transformer_encoder_layers_monitored_are_the_layers_that_ran_a_gemm(tmp_path):
    torch.manual_seed(0)
    model = Encoder(layers=2)
    report = apply_fp8(model, "current", backend="emulated")
    projections = [
        f"encoder.layers.{i}.{p}"
        for i in range(2)
        for p in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.out_proj",
            "linear1",
            "linear2",
        )
    ]
    assert sorted(report.fp8_layers) == sorted([*projections, "head"]) and report.unconverted == ()
    ran: dict[
        str, int
    ] = {}  # independent record: which converted linears actually ran, with their input size
    for name, m in model.named_modules():
        if isinstance(m, EmulatedFP8Linear):
            m.register_forward_pre_hook(lambda _m, args, n=name: ran.__setitem__(n, args[0].numel()))
    mon = fp8track.Monitor(model, fp8track.MonitorConfig(every_n_steps=1), log_dir=tmp_path).attach()
    B, S = 3, 5
    loss = model(torch.randn(B, S, E)).pow(2).mean()
    loss.backward()
    mon.step(loss=loss)
    mon.close()
    rows = {
        (r.layer, r.tensor): r.stats["numel"]
        for r in RunReader(mon.run_dir).tensor_stats()
        if r.variant == "actual"
    }
    assert {layer for layer, _ in rows} == set(ran) == set(report.fp8_layers)
    tokens = B * S
    for i in range(2):
        p = f"encoder.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            assert rows[(p + "self_attn." + proj, "activation")] == tokens * E
            assert rows[(p + "self_attn." + proj, "weight")] == E * E
            assert rows[(p + "self_attn." + proj, "gradient")] == tokens * E
        assert (
            rows[(p + "linear1", "activation")],
            rows[(p + "linear1", "weight")],
            rows[(p + "linear1", "gradient")],
        ) == (tokens * E, FF * E, tokens * FF)
        assert (
            rows[(p + "linear2", "activation")],
            rows[(p + "linear2", "weight")],
            rows[(p + "linear2", "gradient")],
        ) == (tokens * FF, E * FF, tokens * E)
    assert (rows[("head", "activation")], rows[("head", "weight")], rows[("head", "gradient")]) == (
        tokens * E,
        4 * E,
        tokens * 4,
    )
    assert all(ran[n] == rows[(n, "activation")] for n in ran)


def test_cross_attention_decoder_and_fallback_names():
    torch.manual_seed(0)
    dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(E, H, FF, dropout=0.0, batch_first=True), 3)
    ref = copy.deepcopy(dec)
    report = apply_fp8(dec, "current", bf16_layers="first_last", backend="emulated")
    kept = dict(report.bf16_layers)
    assert "layers.0.multihead_attn.k_proj" in kept and "layers.2.self_attn.q_proj" in kept
    assert not any(n.startswith("layers.1.") for n in kept)
    tgt, memory = torch.randn(2, 4, E), torch.randn(2, 6, E)
    out, want = dec(tgt, memory), ref(tgt, memory)
    assert out.shape == want.shape and torch.isfinite(out).all()
    assert 0 < (out - want).abs().max() < 0.5  # FP8 in the middle block: close to, not equal to, BF16


def test_what_no_backend_converts_is_reported_and_warned():
    class MyMHA(nn.MultiheadAttention):
        pass

    class MyLinear(nn.Linear):
        pass

    model = nn.ModuleDict({"attn": MyMHA(E, H), "mine": MyLinear(E, E), "fc": nn.Linear(E, E)})
    with pytest.warns(UserWarning, match="2 modules run their GEMMs outside FP8"):
        report = apply_fp8(model, "current", backend="emulated")
    why = dict(report.unconverted)
    assert set(why) == {"attn", "mine"} and "subclasses nn.MultiheadAttention" in why["attn"]
    assert "not exactly nn.Linear" in why["mine"] and report.fp8_layers == ("fc",)


def test_monitor_warns_about_attention_it_cannot_see(tmp_path):
    model = Encoder(layers=1)  # not converted: nn.MultiheadAttention as built
    with pytest.warns(
        UserWarning, match="1 attention modules .*encoder.layers.0.self_attn.* are not monitored"
    ):
        mon = fp8track.Monitor(model, fp8track.MonitorConfig(every_n_steps=1), log_dir=tmp_path)
    assert "encoder.layers.0.self_attn.out_proj" not in mon.captures  # its hook would never fire
    assert set(mon.captures) == {"encoder.layers.0.linear1", "encoder.layers.0.linear2", "head"}
    replaced, refused = linearize_attention(model)
    assert [n for n, _ in replaced] == ["encoder.layers.0.self_attn"] and refused == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mon2 = fp8track.Monitor(model, fp8track.MonitorConfig(every_n_steps=1), log_dir=tmp_path)
    assert "encoder.layers.0.self_attn.q_proj" in mon2.captures


def test_failed_apply_leaves_attention_as_it_was():
    model = Encoder(layers=1)
    attn = model.encoder.layers[0].self_attn
    with pytest.raises(fp8track.ConfigError):
        apply_fp8(model, "current", bf16_layers="re:^nothing", backend="emulated")
    assert model.encoder.layers[0].self_attn is attn


def test_keyword_call_of_a_converted_linear():
    fc = nn.Linear(E, 8)
    x = torch.randn(2, E)
    want = fc(input=x)
    model = nn.Sequential(fc)
    apply_fp8(model, "bf16", backend="emulated")
    torch.testing.assert_close(model[0](input=x), want)
