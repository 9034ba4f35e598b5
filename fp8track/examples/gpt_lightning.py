"""The example GPT as Lightning wants it: a ``LightningModule``, a ``LightningDataModule``, and
:func:`build_example`, which converts the module with :func:`fp8track.apply_fp8`
(the plain-PyTorch model and data: :mod:`fp8track.examples.gpt`)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import torch

from fp8track.examples.gpt import GPT, CharData, GPTConfig


class GPTLightningModule(L.LightningModule):
    """Lightning wrapper: logs ``train_loss`` (each step) and ``val_loss`` (per epoch), in nats.

    Args:
        config: a :class:`GPTConfig` or a mapping of its fields.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
    """

    def __init__(
        self,
        config: GPTConfig | Mapping[str, Any] | None = None,
        lr: float = 3e-3,
        weight_decay: float = 0.0,
        betas: Sequence[float] = (0.9, 0.95),
    ) -> None:
        super().__init__()
        cfg = config if isinstance(config, GPTConfig) else GPTConfig(**dict(config or {}))
        self.save_hyperparameters(
            {"config": asdict(cfg), "lr": lr, "weight_decay": weight_decay, "betas": list(betas)}
        )
        self.model = GPT(cfg)
        self.lr, self.weight_decay, self.betas = lr, weight_decay, tuple(betas)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.model.loss(x, y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.model.loss(x, y)
        self.log("val_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            self.parameters(), lr=self.lr, weight_decay=self.weight_decay, betas=self.betas
        )


class CharDataModule(CharData, L.LightningDataModule):
    """:class:`~fp8track.examples.gpt.CharData` as a ``LightningDataModule`` (same arguments)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        L.LightningDataModule.__init__(self)
        CharData.__init__(self, *args, **kwargs)


def build_example(
    recipe: Any = "bf16",
    bf16_layers: Any = "none",
    seed: int = 0,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    block_size: int = 64,
    batch_size: int = 16,
    lr: float = 3e-3,
    data_path: str | Path | None = None,
    max_bytes: int = 1_000_000,
    backend: str = "emulated",
    ranking: Any = None,
) -> tuple[GPTLightningModule, CharDataModule, Any]:
    """A seeded :class:`GPTLightningModule` converted by :func:`fp8track.apply_fp8`, its data module,
    and the :class:`~fp8track.execution.apply.ApplyReport`.

    The same ``seed`` gives the same initial weights for every recipe, so runs compare like for like.
    """
    from fp8track.execution.apply import apply_fp8

    torch.manual_seed(seed)
    cfg = GPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=n_head, block_size=block_size)
    module = GPTLightningModule(cfg, lr=lr)
    report = apply_fp8(module, recipe, bf16_layers=bf16_layers, backend=backend, ranking=ranking)
    data = CharDataModule(
        data_path, block_size=block_size, batch_size=batch_size, max_bytes=max_bytes, seed=seed
    )
    return module, data, report


def train_loop(
    module: GPTLightningModule,
    data: CharDataModule,
    steps: int,
    eval_batches: int = 4,
    bf16_autocast: bool = True,
) -> dict[str, Any]:
    """Train without Lightning's loop (plain PyTorch, for tests and benchmarks).

    Runs ``steps`` AdamW steps under CPU BF16 autocast (what ``precision="bf16-mixed"`` does),
    then evaluates the mean loss over the first ``eval_batches`` validation batches in eval mode.

    Returns:
        ``{"train_loss": [per-step float], "val_loss": float, "seconds_per_step": float}``.
    """
    import time

    data.setup()
    opt = module.configure_optimizers()
    module.train()
    losses: list[float] = []
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16_autocast else contextlib_null
    t0 = time.perf_counter()
    for x, y in itertools.islice(data.endless_batches(), steps):
        with ctx():
            loss = module.model.loss(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    elapsed = time.perf_counter() - t0
    module.eval()
    val = []
    with torch.no_grad():
        for i, (x, y) in enumerate(data.val_dataloader()):
            if i >= eval_batches:
                break
            with ctx():
                val.append(float(module.model.loss(x, y)))
    module.train()
    return {
        "train_loss": losses,
        "val_loss": sum(val) / len(val),
        "seconds_per_step": elapsed / max(steps, 1),
    }


def contextlib_null() -> Any:
    import contextlib

    return contextlib.nullcontext()
