"""A converted layer's output is an ordinary tensor: in-place ops on it work on every backend and
recipe (Hugging Face Llama 4 adds its routed experts into the shared expert's output in place),
and give the gradients of the out-of-place op."""

from __future__ import annotations

import copy

import pytest
import torch

from fp8track import apply_fp8


@pytest.mark.parametrize(("backend", "recipe", "conv1d"), [
    ("emulated", "current", False), ("emulated", "delayed", False), ("emulated", "mxfp8", False),
    ("emulated", "block", False), ("emulated", "nvfp4:no_sr", False), ("emulated", "current", True),
    ("torchao", "current", False), ("torchao", "rowwise", False),
])
def test_inplace_op_on_a_converted_output_matches_the_out_of_place_gradient(backend, recipe, conv1d):
    torch.manual_seed(0)
    if conv1d:
        from transformers.pytorch_utils import Conv1D

        base = torch.nn.Sequential(Conv1D(64, 128))
    else:
        base = torch.nn.Sequential(torch.nn.Linear(128, 64))
    grads = []
    for inplace in (True, False):
        model = copy.deepcopy(base)
        assert apply_fp8(model, recipe, backend=backend).fp8_layers == ("0",)
        x = torch.randn(2, 32, 128, generator=torch.Generator().manual_seed(1), requires_grad=True)
        y = model(x)
        y = y.add_(1.0) if inplace else y + 1.0
        (y * y).sum().backward()
        grads.append((x.grad, model[0].weight.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
