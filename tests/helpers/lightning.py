"""A quiet CPU ``lightning.pytorch.Trainer`` for tests: no logger, checkpoints, progress bar or model
summary unless the test asks for them, writing under the test's folder."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def quiet_trainer(root: str | Path | None = None, callbacks: Sequence[Any] = (), **kw: Any) -> Any:
    """``pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False, default_root_dir=root, callbacks=...)``;
    ``kw`` overrides any of these and adds the rest (``max_steps``, ``precision``...)."""
    import lightning.pytorch as pl

    opts: dict[str, Any] = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if root is not None:
        opts["default_root_dir"] = root
    return pl.Trainer(callbacks=list(callbacks), **{**opts, **kw})
