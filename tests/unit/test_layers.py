"""The one GEMM-layer predicate and the one layer selector (execution/layers.py)."""

import pytest
import torch
from torch import nn

from fp8track.errors import ConfigError
from fp8track.execution.blocks import linear_names
from fp8track.execution.emulated_linear import EmulatedFP8Conv1D, EmulatedFP8Linear
from fp8track.execution.fallback import resolve_fallback
from fp8track.execution.layers import gemm_layers, gemm_weight, is_convertible, is_gemm_layer, match_layers
from fp8track.monitoring.selection import select_layers

Conv1D = pytest.importorskip("transformers.pytorch_utils").Conv1D


def _te_like(name: str) -> type:
    """A stand-in with Transformer Engine's module path and class name (TE needs CUDA to import)."""
    return type(name, (nn.Module,), {"__module__": "transformer_engine.pytorch.module.x"})


def test_predicate_knows_every_gemm_layer_by_class():
    te_linear = _te_like("Linear")
    fallback = type("TEBF16Linear", (te_linear,), {"__module__": "fp8track.execution.backends.te"})
    yes = [
        nn.Linear(4, 4),
        EmulatedFP8Linear.from_linear(nn.Linear(4, 4), "current"),
        Conv1D(8, 4),
        EmulatedFP8Conv1D.from_conv1d(Conv1D(8, 4), "current"),
        te_linear(),
        fallback(),  # fp8track's BF16 fallback built on te.Linear
        _te_like("LayerNormLinear")(),
        _te_like("LayerNormMLP")(),
        _te_like("GroupedLinear")(),
    ]
    no = [
        nn.Conv1d(4, 4, 1),
        nn.Embedding(4, 4),
        nn.LayerNorm(4),
        _te_like("LayerNorm")(),
        nn.Sequential(nn.Linear(2, 2)),
    ]
    assert [is_gemm_layer(m) for m in yes] == [True] * len(yes)
    assert [is_gemm_layer(m) for m in no] == [False] * len(no)
    assert [is_convertible(m) for m in yes[:4]] == [True, False, True, False]


def test_gemm_weight_is_out_by_in():
    conv = Conv1D(8, 4)  # nf=8 outputs, nx=4 inputs; stored [4, 8]
    assert conv.weight.shape == (4, 8)
    assert gemm_weight(conv).shape == (8, 4) and gemm_weight(conv).data_ptr() == conv.weight.data_ptr()
    emu = EmulatedFP8Conv1D.from_conv1d(conv, "current")
    assert torch.equal(gemm_weight(emu), conv.weight.t())
    lin = nn.Linear(4, 8)
    assert gemm_weight(lin) is lin.weight
    assert gemm_weight(nn.ReLU()) is None


def _gpt2_like() -> nn.Module:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c_attn, self.c_proj, self.ln = Conv1D(12, 4), Conv1D(4, 4), nn.LayerNorm(4)

    m = nn.Module()
    m.h = nn.ModuleList([Block(), Block()])
    m.lm_head = nn.Linear(4, 8)
    return m


def test_selector_is_shared_by_monitor_and_fallback():
    m = _gpt2_like()
    names = linear_names(m)
    assert names == ["h.0.c_attn", "h.0.c_proj", "h.1.c_attn", "h.1.c_proj", "lm_head"]
    # the same terms pick the same layers in both places
    for term in ("re:c_attn", "h.1", "lm_head"):
        assert (
            [n for n, _ in select_layers(m, term)]
            == match_layers(m, term, names)
            == list(resolve_fallback(m, term))
        )
    assert list(resolve_fallback(m, "first")) == ["h.0.c_attn", "h.0.c_proj"]  # Conv1D blocks count
    with pytest.raises(
        ConfigError, match="layer selector names a missing module 'h.7'; linear layers: h.0.c_attn"
    ):
        select_layers(m, ["h.7"])
    with pytest.raises(ConfigError, match="module 'h.0.ln' holds no linear layer"):
        select_layers(m, "h.0.ln")
    with pytest.raises(ConfigError, match="regex '\\[' does not compile"):
        select_layers(m, "re:[")
    assert [n for n, _ in gemm_layers(nn.Linear(2, 2))] == [""]  # a bare layer is its own root
