"""Command-line interface: ``fp8track <command>``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from fp8track.errors import ConfigError

EXIT_BAD_INPUT = 2
"""Exit status for refused input, the same as argparse's for a bad option."""


def _cmd_stats(args: argparse.Namespace) -> int:
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp8track", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("stats", help="FP8 quantisation statistics of a real tensor")
    p.set_defaults(func=_cmd_stats)
    from fp8track.demo import add_subparser as add_demo
    from fp8track.trackers.replay import add_subparser as add_sync

    add_demo(sub)
    add_sync(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Refused input (a :class:`~fp8track.errors.ConfigError`: a bad recipe, a run
    directory that does not exist...) prints one line, ``fp8track <command>: error: <message>``, on
    stderr and returns 2, like argparse's own errors; anything else is a bug and keeps its traceback."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
