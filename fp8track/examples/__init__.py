"""Example models used by the demo, the sweep and the tests (:mod:`fp8track.examples.gpt`)."""

from fp8track.examples.gpt import GPT, CharDataModule, GPTConfig, GPTLightningModule, build_example

__all__ = ["GPT", "GPTConfig", "GPTLightningModule", "CharDataModule", "build_example"]
