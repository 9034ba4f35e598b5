"""Fallback specs by fraction of blocks (``first:P%`` / ``last:P%``): torchtitan's NVFP4 recipe
keeps the last ~15 % of blocks and the LM head in BF16."""

from __future__ import annotations

import pytest
from torch import nn

from fp8track.errors import ConfigError
from fp8track.execution.fallback import FallbackSpec, resolve_fallback
from fp8track.execution.fallback_resolve import block_count


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.mlp = nn.Linear(8, 8)


class _LM(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(n))
        self.lm_head = nn.Linear(8, 16)


@pytest.mark.parametrize(
    ("count", "total", "want"),
    [
        ("15%", 32, 5),
        ("15%", 20, 3),
        ("15%", 2, 1),
        ("100%", 7, 7),
        ("50%", 3, 2),
        ("1%", 40, 1),
        ("3", 9, 3),
    ],
)
def test_block_count_rounds_up(count: str, total: int, want: int) -> None:
    assert block_count(count, total) == want


def test_last_fraction_and_head_like_torchtitan() -> None:
    model = _LM(20)
    kept = resolve_fallback(model, "last:15%,head")
    blocks = sorted({n.split(".")[1] for n in kept if n.startswith("layers.")}, key=int)
    assert blocks == ["17", "18", "19"] and "lm_head" in kept
    assert kept["layers.17.attn"].startswith("last:15%")
    first = resolve_fallback(model, "first:10%")
    assert sorted(first) == ["layers.0.attn", "layers.0.mlp", "layers.1.attn", "layers.1.mlp"]


def test_fraction_without_repeated_blocks_counts_linears() -> None:
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(10)))
    assert sorted(resolve_fallback(model, "last:20%")) == ["8", "9"]


@pytest.mark.parametrize("term", ["last:0%", "last:101%", "last:x%", "first:-5%", "auto:10%"])
def test_bad_fractions_name_the_term(term: str) -> None:
    with pytest.raises(ConfigError, match=term.replace("%", "%")):
        FallbackSpec.parse(term).resolve(_LM(4))
