"""Synthetic FP8/control run pairs for the diagnosis: run directories written with RunWriter, each
with a loss curve, evaluation metrics and per-layer statistics rows in which one layer
(:data:`PLANTED`) can be made to stand out from a given step or on given steps.

:func:`synthetic_pair` is the healthy pair unless told otherwise: ``fp8_loss(control, rng)`` replaces
the FP8 loss, ``fp8_rows(rng)`` its statistics rows (e.g. ``layer_rows(rng, planted_from=150)``)."""

from __future__ import annotations

import numpy as np

from fp8track.analysis.baseline import load_run
from fp8track.analysis.synthetic_loss import Curve, healthy
from fp8track.monitoring.records import MetricsRecord, RunMeta, RunWriter, TensorStatsRow

N = 300
"""Steps of every synthetic run (one loss a step)."""
EVERY = 10
"""Statistics rows on every ``EVERY``-th step."""
LAYERS = [f"blocks.{i}.{m}" for i in range(3) for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")] + [
    "lm_head"
]
PLANTED = "blocks.1.mlp.fc"
"""The layer whose activation can be made to stand out (:func:`layer_rows`)."""


def stats_row(rng, sqnr=30.0, under=1.0, drift=0.0):
    """One row's statistics around SQNR ``sqnr`` dB, underflow ``under`` % and scale drift ``drift``
    (log2), with small noise from ``rng``."""
    sqnr = sqnr + rng.normal(0, 0.4)
    return {
        "sqnr_db": sqnr,
        "cos": 1 - 0.5 * 10 ** (-sqnr / 10),
        "underflow_pct": max(under + rng.normal(0, 0.08), 0),
        "overflow_pct": 0.0,
        "scale_drift_log2": drift + rng.normal(0, 0.1),
        "mse": 1e-4,
        "amax": 1.0,
    }


def layer_rows(rng, variant="actual", planted_from=None, planted_steps=()):
    """Rows of every layer and tensor on the sampled steps; :data:`PLANTED`'s activation is damaged
    (SQNR 12 dB, underflow 18 %, drift -6) from ``planted_from`` on and on ``planted_steps``."""
    rows = []
    for step in range(0, N, EVERY):
        for i, layer in enumerate(LAYERS):
            for t in ("activation", "weight", "gradient"):
                bad = layer == PLANTED and t == "activation" and (
                    (planted_from is not None and step >= planted_from) or step in planted_steps)
                s = (
                    stats_row(rng, 12.0, 18.0, -6.0)
                    if bad
                    else stats_row(rng, 30.0 + 0.1 * i, 1.0 + 0.02 * i)
                )
                rows.append(TensorStatsRow(step, layer, t, s, variant))
    return rows


def write_run(tmp_path, name, loss, rows, evals=None, precision=None, recipe="delayed", data=None):
    """Run directory ``tmp_path/name`` with one loss a step, ``evals`` ({step: {name: value}}) and
    ``rows``, read back with ``load_run``."""
    config = {"precision": precision or {"recipe": None if recipe == "bf16" else recipe,
                                         "fp8_weights": False, "cpu_offloading": False}}
    if data is not None:
        config["data"] = data
    meta = RunMeta(name=name, recipe={"name": recipe}, fp8_layers=tuple(LAYERS) if recipe != "bf16" else (),
                   config=config)
    w = RunWriter(tmp_path / name, meta)
    for s, v in enumerate(loss):
        w.write_metrics(MetricsRecord(s, {"loss": float(v)}))
    for s, metrics in (evals or {}).items():
        w.write_metrics(MetricsRecord(s, {f"fp8/eval/{k}": v for k, v in metrics.items()}))
    w.write_tensor_stats(rows)
    w.close()
    return load_run(tmp_path / name)


def synthetic_pair(
    tmp_path, fp8_loss=None, fp8_rows=None, fp8_evals=None, ctl_evals=None, precision=None, seed=0
):
    """(FP8 run, BF16 control) under ``tmp_path/fp8`` and ``tmp_path/control``; see the module."""
    rng = np.random.default_rng(seed)
    control = healthy(Curve(start=6.0, floor=2.0, tau=60.0, sigma=0.02), N, rng)
    # Same data order: FP8's loss follows the control's step to step, with a little own noise.
    fp8 = control * (1 + rng.normal(0, 0.002, N)) if fp8_loss is None else fp8_loss(control, rng)
    evals = {s: {"val_loss": 2.4 - 0.1 * s / N, "val_acc": 0.60 + 0.1 * s / N} for s in range(59, N, 60)}
    ctl = write_run(
        tmp_path, "control", control, layer_rows(rng, "shadow"), ctl_evals or evals, recipe="bf16"
    )
    run = write_run(
        tmp_path, "fp8", fp8, fp8_rows(rng) if fp8_rows else layer_rows(rng), fp8_evals or evals, precision
    )
    return run, ctl
