"""FP8 emulation in a plain PyTorch loop (no Lightning): BF16 control vs each recipe, side by side.

    python examples/plain_loop.py --steps 200
"""

from __future__ import annotations

import argparse

import torch

from fp8track.examples.gpt import build_example, train_loop


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--recipes", default="bf16,delayed,current,mxfp8,block,fp8_input_bf16_gemm")
    p.add_argument("--bf16-layers", default="none")
    args = p.parse_args()
    torch.set_num_threads(1)
    control = None
    for recipe in args.recipes.split(","):
        module, data, report = build_example(recipe=recipe, bf16_layers=args.bf16_layers, seed=0)
        out = train_loop(module, data, args.steps)
        control = out["val_loss"] if control is None else control
        print(f"{recipe:22s} val_loss {out['val_loss']:.4f}  gap {out['val_loss'] - control:+.4f}  "
              f"{out['seconds_per_step'] * 1e3:.1f} ms/step  fp8 layers {len(report.fp8_layers)}")


if __name__ == "__main__":
    main()
