"""Sweep your own model: a Hugging Face Llama built from a config (no download), trained by Lightning.

This script is not part of fp8track; it is what a user writes. Under ``fp8track sweep`` it reads
its trial with :func:`fp8track.sweep.trial_settings` (recipe, BF16 layers, the control, the MLflow run),
converts the model with ``settings.apply`` and logs through ``settings.mlflow_logger()``; alone it
trains once in BF16 or with ``--recipe``/``--bf16_layers``.

    python tests/sweep_programs/llama_lightning.py --recipe=current --bf16_layers=last:1 --steps=20
"""

from __future__ import annotations

import argparse

import lightning as L
import torch

from fp8track.lightning import FP8Monitor
from fp8track.sweep import trial_settings


class TinyLM(L.LightningModule):
    def __init__(self, model: torch.nn.Module, lr: float) -> None:
        super().__init__()
        self.model, self.lr = model, lr

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch[0], labels=batch[0]).loss
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.model(input_ids=batch[0], labels=batch[0]).loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def tokens(n: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    """Learnable sequences: x[t+1] = (a * x[t] + b) mod vocab with a per-sequence (a, b)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(1, 8, (n, 1), generator=g)
    b = torch.randint(0, vocab, (n, 1), generator=g)
    x = torch.empty(n, seq, dtype=torch.long)
    x[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    for t in range(1, seq):
        x[:, t] = (a[:, 0] * x[:, t - 1] + b[:, 0]) % vocab
    return x


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--val_every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    args, _ = p.parse_known_args()
    settings = trial_settings()  # --recipe / --bf16_layers, and the sweep's environment

    L.seed_everything(args.seed, verbose=False)
    vocab = 128
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab,
            hidden_size=args.hidden,
            intermediate_size=2 * args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=args.seq,
        )
    )
    settings.apply(model, backend="emulated", tokens_per_step=args.batch * args.seq)

    train = torch.utils.data.TensorDataset(tokens(args.steps * args.batch, args.seq, vocab, seed=args.seed))
    val = torch.utils.data.TensorDataset(tokens(4 * args.batch, args.seq, vocab, seed=10_000))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=args.steps, precision="bf16-mixed",
        logger=settings.mlflow_logger() or False,
        callbacks=[FP8Monitor(every_n_steps=max(1, args.val_every // 2), baseline=settings.control)],
        val_check_interval=args.val_every, check_val_every_n_epoch=None, limit_val_batches=2,
        num_sanity_val_steps=0, log_every_n_steps=max(1, args.val_every // 2), enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(TinyLM(model, args.lr), torch.utils.data.DataLoader(train, batch_size=args.batch),
                torch.utils.data.DataLoader(val, batch_size=args.batch))


if __name__ == "__main__":
    main()
