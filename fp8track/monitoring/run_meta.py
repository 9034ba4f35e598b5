"""Run metadata: what a run is and what it enabled around precision, as the frontends record it
(:class:`fp8track.monitoring.records.RunMeta`): the recipe and FP8/BF16 layer sets of
:func:`fp8track.apply_fp8`'s report, the precision set-up read from the model and its optimizers,
the data fingerprint, and which logged metrics are evaluation metrics."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from fp8track.errors import ConfigError
from fp8track.execution.apply import ApplyReport, applied_report
from fp8track.monitoring.records import RunMeta


def run_meta_for(
    model: nn.Module,
    name: str = "fp8track",
    config: Mapping[str, Any] | None = None,
    report: ApplyReport | None = None,
) -> RunMeta:
    """Run metadata for ``model``: the recipe and FP8/BF16 layer sets of ``report`` (else of an
    :func:`fp8track.apply_fp8` call on the model or a submodule, if any), plus ``config``."""
    report = report if report is not None else applied_report(model)
    config = {"precision": precision_setup(model, report=report), **dict(config or {})}
    if report is None:
        return RunMeta(name=name, config=config)
    return RunMeta(
        name=name,
        recipe=report.recipe.to_dict(),
        fp8_layers=tuple(report.fp8_layers),
        bf16_layers=tuple(n for n, _ in report.bf16_layers),
        config={**config, "apply": report.to_dict()},
    )


EVAL_NAME_PREFIXES = ("val", "valid", "eval", "test", "downstream")
"""Logged metric names that count as evaluation metrics by default (:func:`select_eval_metrics`)."""


def select_eval_metrics(logged: Mapping[str, Any], names: str | Sequence[str] = "auto") -> dict[str, Any]:
    """The evaluation metrics among ``logged`` (e.g. Lightning's ``trainer.callback_metrics`` at
    validation end): ``names`` itself when a list (missing ones are skipped), or for ``"auto"``
    every name whose first word is one of :data:`EVAL_NAME_PREFIXES` (``val_loss``, ``val/acc``,
    ``eval_accuracy``, ``test_f1``...)."""
    if names != "auto":
        return {n: logged[n] for n in names if n in logged}
    out = {}
    for name, value in logged.items():
        head = str(name).lower().replace("/", "_").split("_")[0]
        if head in EVAL_NAME_PREFIXES:
            out[name] = value
    return out


def precision_setup(
    model: nn.Module, optimizers: Sequence[Any] = (), report: ApplyReport | None = None, **extra: Any
) -> dict[str, Any]:
    """What the run enabled around precision, as read from the model and its optimizers, so a
    diagnosis can list what the FP8 run newly enabled relative to its control.

    Keys: ``recipe`` (name, from :func:`fp8track.apply_fp8`'s report, else ``None``),
    ``fp8_weights`` (a parameter is stored in an FP8 dtype or an FP8 tensor subclass),
    ``activation_checkpointing`` (a checkpoint wrapper module or a Hugging Face model with
    gradient checkpointing on), ``torch_compile`` (a compiled module), ``fused_optimizer``
    (``"fused"``/``"foreach"``/``None``), plus ``extra`` (the frontends add ``precision_plugin``,
    ``precision``, ``strategy``, ``cpu_offloading``).
    """
    fp8_dtypes = {
        getattr(torch, n)
        for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
        if hasattr(torch, n)
    }
    report = report if report is not None else applied_report(model)
    fp8_weights = any(
        p.dtype in fp8_dtypes or "float8" in type(p.data).__name__.lower() for p in model.parameters()
    )
    checkpointing = any(
        # Hugging Face layers carry a bool ``gradient_checkpointing`` (the model's own property that
        # sums it up was renamed in transformers 5 and warns under its old name)
        "checkpointwrapper" in type(m).__name__.lower() or getattr(m, "gradient_checkpointing", False) is True
        for m in model.modules()
    )
    compiled = any(
        type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None
        for m in model.modules()
    )
    fused = None
    for opt in optimizers:
        defaults = getattr(opt, "defaults", {}) or {}
        if defaults.get("fused"):
            fused = "fused"
        elif defaults.get("foreach") and fused is None:
            fused = "foreach"
    out = {
        "recipe": str(report.recipe) if report is not None else None,
        "fp8_weights": fp8_weights,
        "activation_checkpointing": checkpointing,
        "torch_compile": compiled,
        "fused_optimizer": fused,
    }
    out.update(extra)
    return out


def data_fingerprint(
    seed: int | None = None, order: Iterable[Any] | None = None, **extra: Any
) -> dict[str, Any]:
    """What data a run saw, for :class:`fp8track.Monitor`'s ``data_fingerprint``: two runs whose
    fingerprints are equal saw the same batches in the same order, and their losses compare step
    by step (:func:`fp8track.analysis.loss_gap.same_batches`).

    Args:
        seed: the data seed (shuffling, sampling).
        order: the sample indices (or batch ids) in the order the run consumes them, e.g.
            ``list(sampler)`` for the first epoch; hashed (SHA-256 of their ``repr``), so a long
            order costs 64 characters in the metadata. Tensors are hashed from their values.
        extra: other JSON scalars that identify the data (dataset name, sequence length).

    Raises:
        ConfigError: when neither ``seed`` nor ``order`` is given.

    Example:
        >>> data_fingerprint(seed=0, order=[2, 0, 1])["n_order"]
        3
    """
    import hashlib

    if seed is None and order is None:
        raise ConfigError("data_fingerprint needs the data seed, the batch order, or both")
    out: dict[str, Any] = {}
    if seed is not None:
        out["seed"] = int(seed)
    if order is not None:
        h = hashlib.sha256()
        n = 0
        for item in order:
            value = item.detach().cpu().tolist() if isinstance(item, torch.Tensor) else item
            h.update(repr(value).encode())
            h.update(b"\x00")
            n += 1
        out["order_sha256"] = h.hexdigest()
        out["n_order"] = n
    out.update(extra)
    return out


def with_data(meta: RunMeta, fingerprint: Mapping[str, Any]) -> RunMeta:
    """``meta`` with the data fingerprint (:func:`data_fingerprint`) as ``config["data"]``.

    Raises:
        ConfigError: a fingerprint that is not a non-empty mapping of JSON scalars.
    """
    if not isinstance(fingerprint, Mapping) or not fingerprint:
        raise ConfigError(f"data fingerprint must be a non-empty mapping, got {fingerprint!r}")
    bad = [k for k, v in fingerprint.items() if not isinstance(v, (str, int, float, bool, type(None)))]
    if bad:
        raise ConfigError(
            f"data fingerprint values must be str/int/float/bool/None; bad keys: {', '.join(map(str, bad))}"
        )
    return replace(meta, config={**dict(meta.config), "data": dict(fingerprint)})


__all__ = [
    "with_data",
    "run_meta_for",
    "select_eval_metrics",
    "precision_setup",
    "data_fingerprint",
    "EVAL_NAME_PREFIXES",
]
