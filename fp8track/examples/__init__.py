"""Example models used by the demo, the sweep and the tests: :mod:`fp8track.examples.gpt` (the
model and its data in plain PyTorch) and :mod:`fp8track.examples.gpt_lightning` (the same as a
``LightningModule`` / ``LightningDataModule``; imports Lightning)."""

from fp8track.examples.gpt import GPT, CharData, GPTConfig

__all__ = ["GPT", "GPTConfig", "CharData"]
