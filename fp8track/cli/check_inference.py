"""``fp8track check-inference CKPT [--batches N] [--out DIR]``: the inference chain of a demo
checkpoint (:func:`fp8track.demo.check_example_checkpoint`) as a table; exit status 1 when it
finds a problem."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from fp8track.cli.checks import check_count, check_out_dir


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "check-inference",
        description="FP8 inference with the trained scales, with fresh scales "
        "and BF16 inference of a checkpoint on the same batches; checks that it reloads exactly.",
    )
    p.add_argument(
        "checkpoint", help="a checkpoint written by fp8track.inference.save_checkpoint (the demo writes one)"
    )
    p.add_argument("--batches", type=int, default=8, help="validation batches to evaluate (default 8)")
    p.add_argument("--out", default=None, help="folder for inference.json")
    return p


def check(args: argparse.Namespace) -> None:
    check_out_dir("--out", args.out)
    check_count("--batches", args.batches)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from fp8track.demo import check_example_checkpoint

    res = check_example_checkpoint(args.checkpoint, batches=args.batches)  # bad input: ConfigError -> main()
    console = Console()
    table = Table(title=f"inference chain: {res.metric_name} per variant (same {args.batches} batches)")
    table.add_column("variant")
    table.add_column(res.metric_name)
    for k, v in res.metrics.items():
        table.add_row(k, "n/a" if v is None else f"{v:.4f}")
    console.print(table)
    worst = sorted((r for r in res.layers if r.variant == "fp8_trained_scales"), key=lambda r: r.sqnr_db)[:5]
    for r in worst:
        console.print(
            f"  {r.layer}: output SQNR vs BF16 {r.sqnr_db:.1f} dB, cos {r.cos:.5f} (trained scales)"
        )
    console.print("checkpoint restores weights and scaling state exactly" if not res.checkpoint
                  else f"[red]checkpoint differs in {len(res.checkpoint)} entries[/red]")
    for p in res.problems:
        console.print(f"[red]{p.kind}[/red] {p.layer}{'/' + p.tensor if p.tensor else ''}: {p.detail}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "inference.json").write_text(json.dumps(res.to_dict(), indent=2))
        console.print(f"inference.json: {out / 'inference.json'}")
    return 1 if res.problems else 0
