"""The sweep program: train the example GPT under one FP8 recipe and BF16-layer choice and score it
by its held-out loss gap to the BF16 control.

    python -m fp8track.examples.train --recipe=delayed:hybrid:h16:max --bf16_layers=auto:2
    wandb agent <sweep id>          # integrations/wandb/fp8_sweep.yaml runs this module with ${args}
    fp8track sweep integrations/wandb/fp8_sweep.yaml --trials 6    # the same YAML, no W&B server

Options are flat names (``--steps=120 --eval_every=20``) so a W&B sweep's ``${args}`` reaches every
rank. The trial's ``recipe``/``bf16_layers`` are read by :func:`fp8track.trial.trial_settings`
(command line, else the YAML at ``WANDB_SWEEP_PARAM_PATH``).

What one trial does (:func:`train`):

1. The BF16 control (same model, data, seed, steps, evaluation) is trained once, with
   ``control_seeds`` seeds, and cached (:func:`control_run`): its held-out loss per evaluation
   and the spread of its final held-out loss across seeds (the noise any FP8 gap is judged against).
2. ``auto:K``: a short FP8 probe under the trial's recipe with every linear in FP8, watched by the
   monitor; :func:`fp8track.analysis.ranking.rank_layers` ranks the layers and the K riskiest stay
   in BF16 (:func:`probe_ranking`, cached per recipe).
3. Training with :class:`fp8track.lightning.FP8Monitor` (baseline: the control's run directory, so
   spikes are classified shared / FP8-only); every ``eval_every`` steps the held-out loss on fixed
   batches is compared to the control's at the same step: ``fp8/val_loss_gap`` (nats, FP8 minus
   control; one value per evaluation) and ``fp8/val_loss_gap_best`` (running minimum).

``--plant_outlier LAYER`` plants a fragile layer (for tests and demos): input channel 0 of that
linear is overwritten by a constant of 1e6 while its weight column is held at zero, so the BF16
model is unchanged but per-tensor FP8 scaling of the layer's input is wrecked by the outlier.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fp8track.errors import ConfigError
from fp8track.examples.trial_config import (
    GAP_BEST_METRIC,
    GAP_METRIC,
    VAL_LOSS_METRIC,
    Evaluation,
    TrainConfig,
    TrialResult,
)
from fp8track.execution import faults
from fp8track.execution.faults import OUTLIER_VALUE, Fault
from fp8track.monitoring.naming import run_metric
from fp8track.trial import (
    JsonCache,
    TrialSettings,
    add_trial_arguments,
    layer_costs,
    ranking_table,
    trial_settings,
)


def plant_outlier(model: nn.Module, layer: str, value: float = OUTLIER_VALUE) -> None:
    """Make ``layer`` fragile under per-tensor FP8 without changing the BF16 model's function:
    its input channel 0 becomes ``value`` on every forward (evaluation too) and its weight column 0
    is zeroed and kept at zero (the kit's ``sink`` fault, :mod:`fp8track.execution.faults`).

    Raises:
        ConfigError: ``layer`` names no layer of ``model``.
    """
    faults.plant(model, Fault("sink", value=value, channels=(0,), in_eval=True), [layer])


def train(
    cfg: TrainConfig,
    recipe: Any,
    bf16_layers: Any = "none",
    *,
    log_dir: str | Path,
    ranking: Sequence[str] | None = None,
    control: Mapping[str, Any] | None = None,
    on_eval: Callable[[Evaluation], bool] | None = None,
    loggers: Sequence[Any] = (),
    run_name: str = "trial",
    settings: TrialSettings | None = None,
) -> TrialResult:
    """Train the example GPT once (module docstring, step 3).

    Args:
        cfg: model, data and schedule.
        recipe, bf16_layers: the trial's recipe and fallback spec.
        log_dir: parent of the monitor's run directory.
        ranking: layer names riskiest first, for ``auto:K``.
        control: a :func:`control_run` result (held-out losses per step, run directory); ``None``
            trains without a gap (the control itself).
        on_eval: pruning hook (:class:`HeldOutEval`).
        loggers: Lightning loggers (W&B, MLflow) that receive the held-out metrics; the monitor
            logs into them too (``trackers="auto"``).
        settings: a sweep trial's settings: the layer table (FP8 FLOP share, BF16 layer names) is
            recorded in its MLflow run (:meth:`fp8track.trial.TrialSettings.record_layers`).
    """
    from fp8track.examples.gpt_lightning import build_example
    from fp8track.examples.held_out import HeldOutEval
    from fp8track.lightning import FP8Monitor
    from fp8track.monitoring.records import RunReader

    module, data, report = build_example(
        recipe=recipe, bf16_layers=bf16_layers, seed=cfg.seed, n_layer=cfg.n_layer, n_embd=cfg.n_embd,
        n_head=cfg.n_head, block_size=cfg.block_size, batch_size=cfg.batch_size, lr=cfg.lr,
        data_path=cfg.data or None, max_bytes=cfg.max_bytes, backend="emulated", ranking=ranking,
    )
    if cfg.plant_outlier:
        plant_outlier(module.model, cfg.plant_outlier.removeprefix("model."))
    if settings is not None and settings.in_sweep:
        settings.record_layers(report, layer_costs(module), tokens_per_step=cfg.batch_size * cfg.block_size)
    held_out = HeldOutEval(data, cfg.eval_every, cfg.eval_batches, cfg.steps,
                           control["val_loss"] if control else None, cfg.precision, on_eval)
    monitor = FP8Monitor(
        every_n_steps=cfg.every_n_steps,
        trackers="auto" if loggers else "none",
        log_dir=log_dir,
        baseline=control["run_dir"] if control else None,
        # The what-if rows the sweep asks of its control (auto:K from what-if rows, no probe run).
        config={"whatif": list(settings.whatif)} if settings is not None and settings.whatif else None,
    )
    trainer, seconds = _fit(cfg, module, data, [monitor, held_out], loggers, log_dir)
    elapsed = seconds - held_out.eval_seconds
    run_dir = monitor.monitor.run_dir if monitor.monitor is not None else None
    if run_dir is None:
        raise RuntimeError("the monitor did not open a run directory")
    fp8 = tuple(report.fp8_layers)
    bf16 = tuple(n for n, _ in report.bf16_layers)
    result = TrialResult(
        held_out.evals, held_out.pruned, Path(run_dir), elapsed / max(trainer.global_step, 1), fp8, bf16
    )
    result.metrics = run_metrics(RunReader(run_dir), result)
    return result


def _fit(cfg: TrainConfig, module: Any, data: Any, callbacks: list[Any], loggers: Sequence[Any],
         log_dir: str | Path) -> tuple[Any, float]:
    """A quiet CPU Lightning ``Trainer`` fitted on ``module``: ``(trainer, wall seconds of fit)``."""
    import lightning as L

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=cfg.steps,
        precision=cfg.precision,
        logger=list(loggers) or False,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        log_every_n_steps=cfg.every_n_steps,
        default_root_dir=str(log_dir),
    )
    L.seed_everything(cfg.seed, verbose=False)
    t0 = time.perf_counter()
    trainer.fit(module, datamodule=data)
    return trainer, time.perf_counter() - t0


def run_metrics(reader: Any, result: TrialResult) -> dict[str, float]:
    """Run-level numbers of a trial, one value each (no NaN: absent counts are 0):

    ``fp8/val_loss_gap`` (final) and ``fp8/val_loss_gap_best`` (nats), ``fp8/spikes/fp8_only`` and
    ``fp8/spikes/shared`` (counts, from the monitor's control comparison), ``fp8/worst/underflow_pct``
    and ``fp8/worst/overflow_pct`` (max over sampled steps and the FP8 layers' tensors, percent; 0
    without FP8 layers), ``fp8/fp8_layer_share`` (FP8 linears / all linears), ``fp8/step_time_s``
    (seconds per optimizer step, evaluations excluded), ``fp8/val_loss`` (final held-out loss)."""
    last: dict[str, float] = {}
    for rec in reader.metrics():
        last.update(rec.metrics)
    worst = {"underflow_pct": 0.0, "overflow_pct": 0.0}
    for row in reader.tensor_stats():
        # "actual" rows are the FP8 layers' (BF16 layers record "shadow" rows). Their names are
        # canonical (no LightningModule `model.` holder), unlike the ApplyReport's.
        if row.variant == "actual":
            for k in worst:
                v = float(row.stats.get(k, 0.0))
                if math.isfinite(v):
                    worst[k] = max(worst[k], v)
    n = len(result.fp8_layers) + len(result.bf16_layers)
    out = {
        run_metric("spikes", "fp8_only"): float(last.get(run_metric("spikes", "fp8_only"), 0.0)),
        run_metric("spikes", "shared"): float(last.get(run_metric("spikes", "shared"), 0.0)),
        run_metric("worst", "underflow_pct"): worst["underflow_pct"],
        run_metric("worst", "overflow_pct"): worst["overflow_pct"],
        run_metric("fp8_layer_share"): len(result.fp8_layers) / n if n else 0.0,
        run_metric("step_time_s"): result.seconds_per_step,
    }
    if result.evals:
        out[VAL_LOSS_METRIC] = result.evals[-1].val_loss
    if math.isfinite(result.final_gap):
        out[GAP_METRIC] = result.final_gap
        out[GAP_BEST_METRIC] = result.best_gap
    return out


def control_run(cfg: TrainConfig, cache: JsonCache, log_dir: str | Path) -> tuple[dict[str, Any], bool]:
    """The BF16 control, trained once per (model, data, seed, steps, evaluation) and cached:
    ``({"val_loss": {step: nats}, "final_by_seed": [...], "spread": nats, "run_dir": str,
    "seconds": s}, cached)``. ``spread`` is max - min of the final held-out loss over the
    ``control_seeds`` seeds (0 with one seed)."""

    def compute() -> dict[str, Any]:
        t0 = time.perf_counter()
        runs = [train(dataclasses.replace(cfg, seed=cfg.seed + i), "bf16", "none", log_dir=log_dir,
                      run_name=f"bf16-control-seed{cfg.seed + i}") for i in range(cfg.control_seeds)]
        finals = [r.evals[-1].val_loss for r in runs if r.evals]
        return {
            "val_loss": {str(e.step): e.val_loss for e in runs[0].evals},
            "final_by_seed": finals,
            "spread": (max(finals) - min(finals)) if finals else 0.0,
            "run_dir": str(runs[0].run_dir),
            "seconds": time.perf_counter() - t0,
        }

    result, cached = cache.get_or_compute("control", cfg.control_key(), compute)
    result["val_loss"] = {int(k): float(v) for k, v in result["val_loss"].items()}
    return result, cached


def probe_ranking(
    cfg: TrainConfig, recipe: Any, cache: JsonCache, log_dir: str | Path
) -> tuple[dict[str, Any], bool]:
    """The ``auto:K`` ranking under ``recipe``: a ``probe_steps``-step run with every linear in FP8
    and the monitor sampling every step, ranked by :func:`fp8track.analysis.ranking.rank_layers`.
    Cached per (control key, recipe, probe steps): ``({"ranking": [layer, ...], "table": rows}, cached)``."""
    from fp8track.analysis.ranking import rank_layers
    from fp8track.execution.recipes import Recipe
    from fp8track.monitoring.records import RunReader

    r = Recipe.parse(recipe)
    probe_cfg = dataclasses.replace(
        cfg, steps=cfg.probe_steps, eval_every=0, every_n_steps=max(1, cfg.probe_steps // 10)
    )

    def compute() -> dict[str, Any]:
        res = train(probe_cfg, r, "none", log_dir=log_dir, run_name=f"probe-{r.name}")
        # Names as apply_fp8 saw them (the Lightning module's, "model.lm_head"): what auto:K resolves.
        table = ranking_table(rank_layers(RunReader(res.run_dir).tensor_stats()))
        return {"ranking": [row["layer"] for row in table], "table": table, "run_dir": str(res.run_dir)}

    key = {"control": cfg.control_key(), "recipe": r.to_string(), "probe_steps": cfg.probe_steps}
    return cache.get_or_compute("probe", key, compute)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fp8track.examples.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_trial_arguments(p)
    for f in dataclasses.fields(TrainConfig):
        p.add_argument(f"--{f.name}", type=type(f.default), default=f.default)
    p.add_argument("--out", default="fp8track-train", help="output folder (run directories, cache)")
    p.add_argument("--cache_dir", default=None, help="control/probe cache (default <out>/cache)")
    p.add_argument(
        "--wandb", action="store_true", help="log to W&B (offline unless a sweep agent started us)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (tiny GEMMs run best on 1)")
    return p


def _sweep_control(ref: str) -> dict[str, Any]:
    """The control the sweep names (``mlflow:<run_id>``, read through ``MLFLOW_TRACKING_URI``) or an
    older JSON file: held-out losses by step and the monitor's baseline reference."""
    if ref.startswith("mlflow:"):
        from fp8track.analysis.baseline import load_run

        return {"val_loss": dict(load_run(ref).metrics.get(VAL_LOSS_METRIC, {})), "run_dir": ref}
    control = json.loads(Path(ref).read_text())
    control["val_loss"] = {int(k): float(v) for k, v in control["val_loss"].items()}
    return control


def main(argv: Sequence[str] | None = None) -> int:
    """One trial. Under ``fp8track sweep`` (``MLFLOW_RUN_ID`` set) it logs into the trial's MLflow
    run, compares with the control the sweep trained (``FP8TRACK_SWEEP_CONTROL``) and takes the
    ``auto:K`` ranking the sweep measured; alone it trains and caches its own control and probe."""

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        settings = trial_settings(argv)
        cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    out = Path(args.out).resolve()
    cache = JsonCache(args.cache_dir or out / "cache")
    control = None
    if settings.control:
        control = _sweep_control(settings.control)
    elif not settings.in_sweep and settings.recipe.quantizes:
        control, _ = control_run(cfg, cache, out / "runs")
    ranking, table = (list(settings.ranking), None) if settings.ranking else (None, None)
    if ranking is None and settings.bf16_layers.needs_ranking:
        probe, _ = probe_ranking(cfg, settings.recipe, cache, out / "runs")
        ranking, table = probe["ranking"], probe["table"]
    loggers: list[Any] = []
    if settings.in_sweep:
        loggers.append(settings.mlflow_logger())
    if args.wandb:
        import os

        from lightning.pytorch.loggers import WandbLogger

        # Under `wandb agent` (WANDB_SWEEP_ID set) the agent decides the mode; alone, stay offline.
        mode = None if os.environ.get("WANDB_SWEEP_ID") else "offline"
        loggers.append(WandbLogger(project="fp8track-sweep", save_dir=str(out), mode=mode))
    try:
        result = train(cfg, settings.recipe, settings.bf16_layers, log_dir=out / "runs", ranking=ranking,
                       control=control, loggers=loggers, settings=settings)
    except ConfigError as err:  # a fallback spec that does not fit the model: refused before training
        print(f"error: {err}", file=sys.stderr)
        return 2
    summary = {"recipe": str(settings.recipe), "bf16_layers": settings.spec, **result.metrics,
               "bf16_layer_names": list(result.bf16_layers), "auto_ranking": table}
    for lg in loggers:
        lg.log_metrics({k: v for k, v in result.metrics.items() if k not in (GAP_METRIC, VAL_LOSS_METRIC)},
                       step=result.evals[-1].step if result.evals else 0)
    print(json.dumps(summary, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
