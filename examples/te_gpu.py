"""Transformer Engine on a GPU: the example GPT's linear layers become ``te.Linear`` (FP8 GEMMs on
the tensor cores), Lightning runs them under ``TransformerEnginePrecision`` with fp8track's recipe,
and FP8Monitor reads the scales TE actually used.

    python examples/te_gpu.py --recipe delayed --steps 300      # Hopper or newer
    python examples/te_gpu.py --recipe mxfp8                     # Blackwell

Needs CUDA and Transformer Engine (pip install "fp8track[te]"); without them it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="delayed", help="delayed, current, mxfp8, block (TE's defaults)")
    p.add_argument("--bf16-layers", default="none")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every-n-steps", type=int, default=10)
    p.add_argument("--out", default="runs-te")
    args = p.parse_args(argv)

    from fp8track.execution.backends import te as te_backend

    if not torch.cuda.is_available() or not te_backend.available():
        print(
            "examples/te_gpu.py needs a CUDA GPU and Transformer Engine (pip install 'fp8track[te]'); "
            "skipping."
        )
        return 0

    import lightning as L

    import fp8track
    from fp8track.demo import quiet_libraries
    from fp8track.examples.gpt_lightning import build_example

    L.seed_everything(0, verbose=False)
    # n_embd and the batch are multiples of 16, as TE's FP8 GEMMs require.
    module, data, report = build_example(recipe=args.recipe, bf16_layers=args.bf16_layers, backend="te",
                                         n_embd=128, batch_size=32)
    print(f"backend={report.backend} recipe={report.recipe} fp8 layers={len(report.fp8_layers)}")
    trainer = L.Trainer(
        max_steps=args.steps, accelerator="gpu", devices=1, logger=False, enable_checkpointing=False,
        plugins=[te_backend.lightning_precision(report.recipe)], default_root_dir=args.out,
        callbacks=[fp8track.FP8Monitor(every_n_steps=args.every_n_steps, trackers="none")],
        limit_val_batches=8, val_check_interval=min(100, args.steps), enable_progress_bar=False,
    )
    with quiet_libraries():  # Lightning's GPU/TPU lines and tips: the console keeps fp8track's output
        trainer.fit(module, datamodule=data)
    monitor = next(c for c in trainer.callbacks if isinstance(c, fp8track.FP8Monitor))
    print(json.dumps(monitor.summary(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
