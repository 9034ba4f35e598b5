"""Command-line interface: ``fp8track <command>``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def _cmd_stats(args: argparse.Namespace) -> int:
    """Quantisation statistics of a real tensor: the weights of a seeded linear layer and its
    activations on real text bytes (this file's own source), under each FP8 format."""
    import torch

    from fp8track.numerics.stats import block_quant_stats, quant_stats

    torch.manual_seed(0)
    text = open(__file__, "rb").read()
    x = torch.tensor(list(text[: 64 * 256]), dtype=torch.float32).reshape(-1, 256) / 255.0
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
    from fp8track.sweep.cli import add_subparser as add_sweep
    from fp8track.trackers.replay import add_subparser as add_sync

    add_demo(sub)
    add_sync(sub)
    add_sweep(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
