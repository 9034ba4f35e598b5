"""Train the example character-level GPT with Lightning under an FP8 recipe (CPU emulation by default).

    python examples/train_gpt.py --recipe delayed:hybrid:h16:max --bf16-layers first_last --steps 300
    python examples/train_gpt.py --recipe bf16            # the BF16 control
    python examples/train_gpt.py --data my_corpus.txt     # any text file instead of the stdlib source

Recipes: bf16, delayed, current, mxfp8, block, fp8_input_bf16_gemm (grammar in fp8track.execution.recipes).
"""

from __future__ import annotations

import argparse

import lightning as L
import torch

from fp8track.examples.gpt import build_example


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="delayed", help="FP8 recipe string (default: delayed)")
    p.add_argument("--bf16-layers", default="none", help="fallback spec: none, first_last, last:2, re:lm_head, ...")
    p.add_argument("--backend", default="emulated", choices=["auto", "emulated", "torchao", "te"])
    p.add_argument("--data", default=None, help="text file (default: the Python standard library's source)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (tiny GEMMs run best on 1)")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    L.seed_everything(args.seed, verbose=False)
    module, data, report = build_example(
        recipe=args.recipe, bf16_layers=args.bf16_layers, seed=args.seed, n_layer=args.n_layer,
        n_embd=args.n_embd, data_path=args.data, backend=args.backend,
    )
    print(f"backend={report.backend} recipe={report.recipe} fp8={len(report.fp8_layers)} layers, "
          f"bf16={[n for n, _ in report.bf16_layers]}")
    precision = "bf16-mixed"
    if report.backend == "te":
        from fp8track.execution.backends.te import lightning_precision

        precision = lightning_precision(report.recipe)
    trainer = L.Trainer(
        max_steps=args.steps, accelerator="auto", devices=1, logger=False, enable_checkpointing=False,
        val_check_interval=min(100, args.steps), limit_val_batches=8, enable_model_summary=False,
        **({"plugins": [precision]} if not isinstance(precision, str) else {"precision": precision}),
    )
    trainer.fit(module, datamodule=data)
    print({k: round(float(v), 4) for k, v in trainer.callback_metrics.items()})


if __name__ == "__main__":
    main()
