"""Tiny models for tests, seeded so that two calls build the same weights."""

from __future__ import annotations

import torch
from torch import nn


def mlp(*widths: int, act: type[nn.Module] | None = nn.ReLU, seed: int = 0) -> nn.Sequential:
    """``Linear(widths[0], widths[1]), act(), Linear(widths[1], widths[2]), ...`` (no activation after
    the last linear; ``act=None``: linears only), built after ``torch.manual_seed(seed)``. With an
    activation the linears are ``model[0]``, ``model[2]``...; without, ``model[0]``, ``model[1]``..."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        if i and act is not None:
            layers.append(act())
        layers.append(nn.Linear(a, b))
    return nn.Sequential(*layers)
