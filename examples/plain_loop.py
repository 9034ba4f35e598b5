"""FP8 emulation in a plain PyTorch loop (no Lightning), watched by ``fp8track.Monitor``.

    python examples/plain_loop.py --recipe delayed --steps 200
    python examples/plain_loop.py --recipe mxfp8 --config my_monitor.yaml   # fp8track.MonitorConfig as YAML

The run directory (``fp8track-runs/<run id>``: metrics, per-layer tensor statistics, events) is the record;
``fp8track sync`` can replay it into W&B or MLflow later.
"""

from __future__ import annotations

import argparse
import json

import torch

import fp8track
from fp8track.config import DEFAULT_LOG_DIR
from fp8track.examples.gpt import GPT, CharData, GPTConfig


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="delayed", help="FP8 recipe string (bf16 = the control)")
    p.add_argument("--bf16-layers", default="none", help="fallback spec: none, first_last, re:lm_head, ...")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every-n-steps", type=int, default=10)
    p.add_argument(
        "--config", default=None, help="an fp8track.MonitorConfig YAML file (thresholds, tensors, ...)"
    )
    p.add_argument(
        "--log-dir", default=DEFAULT_LOG_DIR, help="parent of the run directory (default ./fp8track-runs)"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=64))
    report = fp8track.apply_fp8(model, args.recipe, bf16_layers=args.bf16_layers)
    print(f"recipe={report.recipe} fp8 layers={len(report.fp8_layers)}")

    config = fp8track.MonitorConfig.load(args.config).replace(every_n_steps=args.every_n_steps)
    data = CharData(block_size=64, batch_size=16, seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    batches = iter(data.train_dataloader())
    # The with-block attaches the hooks and closes the monitor (writing the losses not yet flushed).
    with fp8track.Monitor(model, config, log_dir=args.log_dir, apply_report=report) as monitor:
        for _ in range(args.steps):
            try:
                x, y = next(batches)
            except StopIteration:
                batches = iter(data.train_dataloader())
                x, y = next(batches)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model.loss(x, y)
            loss.backward()
            opt.step()
            monitor.step(loss=loss)  # once per optimizer step, before zero_grad (it reads the grad norm)
            opt.zero_grad(set_to_none=True)
    summary = monitor.summary()
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
