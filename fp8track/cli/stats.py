"""``fp8track stats``: FP8 quantisation statistics (:mod:`fp8track.numerics.stats`) of a real
tensor, as JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> argparse.ArgumentParser:
    return sub.add_parser(
        "stats",
        description="Quantisation statistics of a real tensor (a seeded linear layer's "
        "weights and its activations on text bytes) under each FP8 format, as JSON.",
    )


def check(args: argparse.Namespace) -> None:
    """Nothing to check: the command takes no arguments."""


def run(args: argparse.Namespace) -> int:
    """Quantisation statistics of a real tensor: the weights of a seeded linear layer and its
    activations on real text bytes (this file's own source), under each FP8 format."""
    import torch

    from fp8track.numerics.stats import block_quant_stats, quant_stats

    torch.manual_seed(0)
    rows, width = 64, 256
    text = Path(__file__).read_bytes()
    # Repeat the source to fill the matrix: the file may be shorter than rows * width bytes.
    text = (text * (rows * width // max(len(text), 1) + 1))[: rows * width]
    x = torch.tensor(list(text), dtype=torch.float32).reshape(rows, width) / 255.0
    layer = torch.nn.Linear(256, 512)
    act = layer(x).detach()
    out = {
        "activation_e4m3": quant_stats(act, "e4m3"),
        "activation_mxfp8": block_quant_stats(act, "mxfp8"),
        "weight_e4m3": quant_stats(layer.weight, "e4m3"),
        "weight_e5m2": quant_stats(layer.weight, "e5m2"),
    }
    print(json.dumps(out, indent=2))
    return 0
