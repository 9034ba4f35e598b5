"""``torch.compile(fullgraph=True)`` and the emulated backend: the docs' limit says where it fails.

A third-party script compiling an emulated-FP8 model with ``fullgraph=True`` fails at its first
forward/backward without any monitor attached (the FP8 layers' autograd Function writes the
layer's scale state); README and docs/limits.md once blamed the monitor's capture alone ("fails on
the first sampled step").
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from fp8track.execution.apply import apply_fp8

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_emulated_fp8_fails_fullgraph_without_a_monitor(recipe):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    apply_fp8(model, recipe, backend="emulated")
    compiled = torch.compile(model, fullgraph=True)
    with pytest.raises(Exception, match="Unsupported|side effect|non-Tensor"):
        compiled(torch.randn(8, 32)).sum().backward()


def test_the_docs_say_so():
    readme = " ".join((ROOT / "README.md").read_text().split())
    limits = " ".join((ROOT / "docs" / "limits.md").read_text().split())
    assert "emulated FP8 at the first forward, monitored or not" in readme
    assert "on the emulated backend at the first forward, monitored or not" in limits
