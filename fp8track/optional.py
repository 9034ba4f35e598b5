"""Optional dependencies: import on first use, and say how to install what is missing."""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRAS = {
    "wandb": "wandb",
    "mlflow": "mlflow",
    "torchao": "torchao",
    "optuna": "sweep",
    "sweeps": "sweep",
    "matplotlib": "report",
    "transformers": "hf",
    "accelerate": "hf",
}
"""Top-level module -> the fp8track extra that installs it."""


def require(module: str, what: str) -> ModuleType:
    """Import ``module`` or raise ImportError naming the pip command that installs it.

    Args:
        module: the module to import (``"wandb"``, ``"mlflow"``, ...).
        what: the feature that needs it, for the message (e.g. ``"the W&B tracker"``).
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        extra = EXTRAS.get(module.split(".")[0], "all")
        raise ImportError(f"{what} needs {module}: pip install 'fp8track[{extra}]'") from exc
