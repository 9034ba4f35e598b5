"""A small character-level GPT and its data over text every machine has offline, in plain PyTorch
(the Lightning wrappers: :mod:`fp8track.examples.gpt_lightning`).

By default the text is the Python standard library's own source: the sorted ``*.py`` files at the
top of ``sysconfig.get_paths()["stdlib"]``, concatenated up to ``max_bytes``, so the data set is
deterministic for a given Python version and needs no download. ``data_path`` points at any
text file instead. Tokens are bytes (vocabulary 256, a multiple of 16), so every character of
ASCII source is one token.

All linear dimensions are multiples of 16 so the model also runs under Transformer Engine and
``torch._scaled_mm``. Linear layers (qualified names inside :class:`GPT`):
``blocks.<i>.attn.qkv``, ``blocks.<i>.attn.proj``, ``blocks.<i>.mlp.fc``, ``blocks.<i>.mlp.proj``
and ``lm_head``.
"""

from __future__ import annotations

import math
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fp8track.errors import ConfigError, check_int

VOCAB_SIZE = 256


@dataclass(frozen=True)
class GPTConfig:
    """GPT shape. Every dimension that reaches a linear layer is a multiple of 16.

    Attributes:
        vocab: vocabulary size (256 byte tokens by default).
        n_layer: transformer blocks.
        n_head: attention heads (``n_embd / n_head`` is the head size).
        n_embd: model width.
        block_size: context length in tokens.
        mlp_ratio: MLP hidden width = ``mlp_ratio * n_embd``.
    """

    vocab: int = VOCAB_SIZE
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 64
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        for name in ("vocab", "n_embd"):
            value = getattr(self, name)
            check_int(name, value, 16)
            if value % 16:
                raise ConfigError(f"{name} must be a positive multiple of 16, got {value!r}")
        for name in ("n_layer", "n_head", "block_size", "mlp_ratio"):
            check_int(name, getattr(self, name), 1)
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Pre-norm decoder-only transformer; ``forward(idx) -> logits [B, T, vocab]``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab, bias=False)
        self.apply(self._init)
        # GPT-2: scale residual projections by 1/sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.config.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy in nats (float32)."""
        logits = self(idx)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def stdlib_text(max_bytes: int = 1_000_000) -> bytes:
    """The sorted top-level ``*.py`` files of the standard library, concatenated, cut at ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = bytearray()
    for path in sorted(root.glob("*.py")):
        out += path.read_bytes()
        if len(out) >= max_bytes:
            break
    if not out:
        raise ConfigError(f"no *.py files under the standard library path {root}; pass data_path")
    return bytes(out[:max_bytes])


class _Windows(Dataset):
    """Consecutive, non-overlapping windows: item i is (tokens[i*T : i*T+T], the same shifted by 1)."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        self.tokens, self.block_size = tokens, block_size
        self.n = (len(tokens) - 1) // block_size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = i * self.block_size
        chunk = self.tokens[s : s + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class CharData:
    r"""Byte-level next-token data: the stdlib's source by default, or any text file. Plain
    PyTorch ``DataLoader``\ s; :class:`~fp8track.examples.gpt_lightning.CharDataModule` is the same as
    a ``LightningDataModule``.

    Args:
        data_path: a text file; ``None`` = standard-library source (see the module docstring).
        block_size: context length.
        batch_size: windows per batch.
        max_bytes: cap on the text read.
        val_fraction: share of the text (its tail) held out for validation.
        seed: seed of the training-order shuffle.
        num_workers: DataLoader workers.
    """

    def __init__(
        self,
        data_path: str | Path | None = None,
        block_size: int = 64,
        batch_size: int = 16,
        max_bytes: int = 1_000_000,
        val_fraction: float = 0.1,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        if not 0.0 < val_fraction < 1.0:
            raise ConfigError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
        if data_path is not None and not Path(data_path).is_file():
            raise ConfigError(f"data_path {str(data_path)!r} is not a file")
        self.data_path = Path(data_path) if data_path is not None else None
        self.block_size, self.batch_size, self.max_bytes = block_size, batch_size, max_bytes
        self.val_fraction, self.seed, self.num_workers = val_fraction, seed, num_workers
        self.train_set: _Windows | None = None
        self.val_set: _Windows | None = None

    def text(self) -> bytes:
        if self.data_path is None:
            return stdlib_text(self.max_bytes)
        return self.data_path.read_bytes()[: self.max_bytes]

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        tokens = torch.frombuffer(bytearray(self.text()), dtype=torch.uint8).to(torch.long)
        split = int(len(tokens) * (1.0 - self.val_fraction))
        self.train_set = _Windows(tokens[:split], self.block_size)
        self.val_set = _Windows(tokens[split:], self.block_size)
        if len(self.train_set) == 0 or len(self.val_set) == 0:
            raise ConfigError(f"text of {len(tokens)} bytes is too short for block_size {self.block_size}")

    def train_dataloader(self) -> DataLoader:
        self.setup()
        gen = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, generator=gen,
                          drop_last=True, num_workers=self.num_workers)

    def endless_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Training batches epoch after epoch (each epoch :meth:`train_dataloader`'s order), for
        loops that count steps rather than epochs."""
        while True:
            empty = True
            for batch in self.train_dataloader():
                empty = False
                yield batch
            if empty:
                raise ConfigError(f"batch_size {self.batch_size} exceeds the {len(self.train_set or ())} "
                                  "training windows: no full batch")

    def data_fingerprint(self) -> dict[str, Any]:
        """What this data module feeds (:func:`fp8track.monitoring.monitor.data_fingerprint`): the
        shuffle seed, the first epoch's sample order (the same ``RandomSampler`` draw
        :meth:`train_dataloader` makes), the text's hash and the batch shape. Two runs with equal
        fingerprints saw the same batches, so their losses compare step by step. ``FP8Monitor``
        records it in the run metadata."""
        import hashlib

        from torch.utils.data import RandomSampler

        from fp8track.monitoring.run_meta import data_fingerprint

        self.setup()
        assert self.train_set is not None
        order = RandomSampler(self.train_set, generator=torch.Generator().manual_seed(self.seed))
        return data_fingerprint(
            seed=self.seed, order=list(order), text_sha256=hashlib.sha256(self.text()).hexdigest(),
            block_size=self.block_size, batch_size=self.batch_size,
        )

    def val_dataloader(self) -> DataLoader:
        self.setup()
        return DataLoader(
            self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers
        )
