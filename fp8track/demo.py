"""``fp8track demo``: the main job, ending with answers.

It trains the example GPT three times, each run monitored by :class:`fp8track.lightning.FP8Monitor`
and logged to MLflow (and W&B offline with ``--wandb``):

1. ``bf16-control``: the BF16 control;
2. ``fp8-<recipe>``: the same model, data and seed in emulated FP8;
3. ``fp8-planted``: the FP8 run with a documented planted problem (:func:`planted_fault`): from
   step ``0.6 x steps`` on, an outlier of ``PLANT_AMAX`` (1e6) enters the activation amax history
   of one layer (``blocks.1.mlp.fc``) at every training step, as if one token carried a huge
   value. Delayed scaling sets that layer's activation scale for the outlier, so its ordinary
   activations underflow to zero; the BF16 control cannot notice.

Then it diagnoses both FP8 runs against the control (:func:`fp8track.report.run.diagnose_runs`)
and prints the findings, the top-ranked layer, where each ``report.html`` is, the command that
opens the MLflow UI on the store and the URL of its compare view for the three runs.

Everything lands in one folder (default ``./fp8track-demo``): ``mlflow.db`` (MLflow SQLite store,
experiment ``fp8track-demo``, artifacts in ``mlartifacts/``), ``fp8track-runs/<run_id>/`` (fp8track's run
directories), ``diagnosis-fp8/`` and ``diagnosis-planted/`` (``diagnosis.json``, ``report.html``),
``fp8.ckpt`` (the FP8 run's weights and scaling state, for ``fp8track check-inference``),
``demo.json`` (the runs, their ids and final losses, the finding kinds) and, with ``--wandb``,
``wandb/`` (one offline run per training run). The console says which run is training, then
where everything is, then each diagnosis, and ends with one answer line per FP8 run: its verdict, the
causal finding and layer.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fp8track.config import DEFAULT_LOG_DIR
from fp8track.errors import ConfigError, check_int

DEMO_EXPERIMENT = "fp8track-demo"
"""The demo's MLflow experiment (and W&B project)."""
SUMMARY_FILE = "demo.json"
"""The demo's summary (runs, run ids, final losses, finding kinds), written to its output folder."""
PLANT_LAYER = "blocks.1.mlp.fc"
PLANT_AMAX = 1e6
PLANT_FRACTION = 0.6
QUIET_LOGGERS = (
    "lightning",
    "lightning.pytorch",
    "lightning.fabric",
    "pytorch_lightning",
    "mlflow",
    "alembic",
    "wandb",
)


@dataclass(frozen=True)
class DemoRun:
    """One finished demo run: its name, recipe, fp8track run directory, MLflow run id and W&B run id."""

    name: str
    recipe: str
    run_dir: Path
    mlflow_run_id: str | None
    final_loss: float
    seconds: float
    wandb_run_id: str | None = None


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """Keep the console for fp8track's progress and answers: library info logs (Lightning's
    "GPU available" lines and tips, MLflow/alembic set-up, W&B banners) and their warnings are
    silenced for the duration; errors still show."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # Lightning and MLflow set their loggers' levels when first imported: import them first.
        import lightning.pytorch  # noqa: F401
        import mlflow  # noqa: F401

        saved = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
        # W&B prints its banners and setting warnings itself (not through logging); WANDB_SILENT is
        # its documented switch. Set for the demo's duration only and restored after.
        wandb_silent = os.environ.get("WANDB_SILENT")
        os.environ["WANDB_SILENT"] = "true"
        try:
            yield
        finally:
            for name, level in saved.items():
                logging.getLogger(name).setLevel(level)
            if wandb_silent is None:
                os.environ.pop("WANDB_SILENT", None)
            else:
                os.environ["WANDB_SILENT"] = wandb_silent


def planted_fault(steps: int) -> Any:
    """The planted problem of a run of ``steps`` steps: from step ``PLANT_FRACTION * steps`` on,
    every training forward of ``PLANT_LAYER`` records an outlier of ``PLANT_AMAX`` in its activation
    amax history before quantising, as if one token carried a huge value (the kit's
    ``amax_outlier`` fault, :mod:`fp8track.execution.faults`). Delayed scaling then sets the layer's
    activation scale for the outlier and its ordinary activations underflow. The BF16 control has
    no such state, so it is an FP8-only problem of one layer, starting mid-training."""
    from fp8track.execution.faults import Fault

    return Fault("amax_outlier", "activation", ((int(PLANT_FRACTION * steps), None),), value=PLANT_AMAX)


def run_progress_bar(label: str) -> Any:
    """Lightning's tqdm bar titled with the run it trains (``"[2/3] fp8-delayed"``) over the
    run's optimizer steps, instead of Lightning's "Epoch 0/-2" (``max_epochs=-1``); validation
    passes draw no bar of their own."""
    from lightning.pytorch.callbacks import TQDMProgressBar
    from tqdm import tqdm

    class RunProgressBar(TQDMProgressBar):
        def init_train_tqdm(self) -> Any:
            bar = super().init_train_tqdm()
            bar.set_description(label, refresh=False)
            return bar

        def on_train_epoch_start(self, trainer: Any, *args: Any) -> None:
            super().on_train_epoch_start(trainer, *args)
            self.train_progress_bar.set_description(label)

        def init_validation_tqdm(self) -> Any:
            return tqdm(disable=True)

        def get_metrics(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
            metrics = super().get_metrics(trainer, pl_module)
            metrics.pop("v_num", None)  # the logger's run version: not something to watch
            return metrics

    return RunProgressBar()


def run_one(
    out: Path,
    name: str,
    recipe: str,
    *,
    steps: int,
    every_n_steps: int,
    baseline: Path | None,
    use_wandb: bool,
    progress: bool,
    seed: int = 0,
    plant: bool = False,
    checkpoint: Path | None = None,
    label: str | None = None,
) -> DemoRun:
    """Train one demo run of the example GPT under ``recipe`` (``plant``: with the planted problem
    of :func:`planted_fault`), monitored by :class:`fp8track.lightning.FP8Monitor` against
    ``baseline`` and logged to the demo's MLflow store (and W&B offline with ``use_wandb``)."""
    import lightning.pytorch as pl

    from fp8track.examples.gpt_lightning import build_example
    from fp8track.execution import faults
    from fp8track.lightning import FP8Monitor
    from fp8track.monitoring.records import RunReader

    module, data, _report = build_example(recipe=recipe, seed=seed)
    if plant:
        faults.plant(module.model, planted_fault(steps), [PLANT_LAYER], clock=lambda: module.global_step)
    loggers = _loggers(out, name, use_wandb)
    monitor = FP8Monitor(
        every_n_steps=every_n_steps,
        log_dir=out / DEFAULT_LOG_DIR,
        baseline=baseline,
        config={"run_name": name},
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=loggers,
        callbacks=[monitor, run_progress_bar(label or name)] if progress else [monitor],
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=progress,
        log_every_n_steps=every_n_steps,
        limit_val_batches=8,
        val_check_interval=max(1, steps // 5) if steps >= 5 else None,
        num_sanity_val_steps=0,
        default_root_dir=out,
    )
    t0 = time.perf_counter()
    wandb_id = None
    try:
        trainer.fit(module, datamodule=data)
    finally:
        if use_wandb:
            run = loggers[1].experiment
            wandb_id = run.id
            run.finish()  # the next run's WandbLogger must not find this one still active
    seconds = time.perf_counter() - t0
    run_dir = monitor.run_dir
    if run_dir is None:
        raise RuntimeError("the monitor did not open a run directory")
    if checkpoint is not None:
        from fp8track.inference import save_checkpoint

        save_checkpoint(module, checkpoint, example="gpt", recipe=recipe, seed=seed)
    losses = RunReader(run_dir).series()
    return DemoRun(name, recipe, run_dir, loggers[0].run_id, losses[max(losses)], seconds, wandb_id)


def _loggers(out: Path, name: str, use_wandb: bool) -> list[Any]:
    """The run's Lightning loggers: MLflow on the demo's SQLite store, then (``use_wandb``) W&B offline."""
    from lightning.pytorch.loggers import MLFlowLogger

    loggers: list[Any] = [
        MLFlowLogger(
            experiment_name=DEMO_EXPERIMENT,
            run_name=name,
            tracking_uri=f"sqlite:///{out / 'mlflow.db'}",
            # MLflow's default artifact root is ./mlruns in the working directory; keep it here.
            artifact_location=(out / "mlartifacts").as_uri(),
        )
    ]
    if use_wandb:
        import wandb
        from lightning.pytorch.loggers import WandbLogger

        # mode="offline" goes to wandb.init for this run only (offline=True would set WANDB_MODE
        # for the whole process); reinit="create_new" gives every training run its own W&B run.
        # The run is opened here and handed to the logger: WandbLogger's own wandb.init passes
        # anonymous=None, which W&B 0.31 answers with a deprecation line on the console.
        run = wandb.init(
            project="fp8track-demo",
            name=name,
            dir=str(out),
            mode="offline",
            reinit="create_new",
            settings=wandb.Settings(silent=True),
        )
        loggers.append(WandbLogger(experiment=run, save_dir=str(out)))
    return loggers


def compare_url(tracking_uri: str, run_ids: list[str], host: str = "http://127.0.0.1:5000") -> str:
    """The MLflow UI's compare view of ``run_ids`` (as served by ``mlflow ui`` on ``host``)."""
    from mlflow import MlflowClient

    exp = {MlflowClient(tracking_uri).get_run(r).info.experiment_id for r in run_ids}
    runs = quote(json.dumps(run_ids, separators=(",", ":")))
    exps = quote(json.dumps(sorted(exp), separators=(",", ":")))
    return f"{host}/#/compare-runs?runs={runs}&experiments={exps}"


def retire_previous_runs(tracking_uri: str, names: Sequence[str]) -> int:
    """Delete (MLflow's soft delete) the runs of experiment ``fp8track-demo`` named ``names``, so a
    demo run again into the same folder leaves one run per name; how many were deleted."""
    store = tracking_uri.removeprefix("sqlite:///")
    if store == tracking_uri or not Path(store).is_file():
        return 0
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(DEMO_EXPERIMENT)
    if exp is None:
        return 0
    found = client.search_runs([exp.experiment_id], max_results=1000)
    old = [r for r in found if r.info.run_name in set(names)]
    for r in old:
        client.delete_run(r.info.run_id)
    return len(old)


def run_demo(
    out: str | Path = "fp8track-demo",
    *,
    steps: int = 300,
    recipe: str = "delayed:hybrid:h16:max",
    every_n_steps: int = 10,
    use_wandb: bool = False,
    progress: bool = True,
    plant: bool = True,
) -> list[DemoRun]:
    """Train the BF16 control, the FP8 run and (``plant``) the planted-problem run; return the
    runs, control first."""
    from fp8track.execution.recipes import Recipe

    parsed = Recipe.parse(recipe)  # a bad recipe fails here, before any training
    if plant and parsed.scaling != "delayed":
        raise ConfigError(
            f"the planted problem needs a delayed-scaling recipe, got {recipe!r}; or pass --no-plant"
        )
    if steps < 10:
        raise ConfigError(f"steps (--steps) must be >= 10, got {steps!r}")
    check_int("every_n_steps", every_n_steps, 1)  # before the output folder exists
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    names = ["bf16-control", f"fp8-{recipe.split(':')[0]}", *(["fp8-planted"] if plant else [])]
    retired = retire_previous_runs(f"sqlite:///{out / 'mlflow.db'}", names)
    if retired:
        print(f"[fp8track] the previous demo's {retired} MLflow runs in {out} were deleted (same names; "
              "MlflowClient().restore_run(id) brings one back)", flush=True)
    common: dict[str, Any] = {
        "steps": steps,
        "every_n_steps": every_n_steps,
        "use_wandb": use_wandb,
        "progress": progress,
    }
    plan: list[tuple[str, str, dict[str, Any]]] = [
        ("bf16-control", "bf16", {"baseline": None}),
        (f"fp8-{recipe.split(':')[0]}", recipe, {"checkpoint": out / "fp8.ckpt"}),
    ]
    if plant:
        plan.append(("fp8-planted", recipe, {"plant": True}))
    runs: list[DemoRun] = []
    for i, (name, run_recipe, extra) in enumerate(plan, 1):
        what = "the BF16 control" if i == 1 else "the planted problem" if extra.get("plant") else "FP8"
        label = f"[{i}/{len(plan)}] {name}"
        print(f"[fp8track] training {label}: {what}, recipe {run_recipe}, {steps} steps", flush=True)
        extra.setdefault("baseline", runs[0].run_dir if runs else None)
        runs.append(run_one(out, name, run_recipe, label=label, **extra, **common))
        print(f"[fp8track] trained {name} in {runs[-1].seconds:.0f} s", flush=True)
    return runs


def check_example_checkpoint(path: str | Path, batches: int = 8) -> Any:
    """``fp8track check-inference``: rebuild the example GPT a demo checkpoint names, load it
    (``weights_only=True``), verify it holds the checkpoint exactly, and run the inference chain
    on ``batches`` validation batches (:func:`fp8track.inference.check_inference`)."""
    import itertools

    from fp8track.inference import check_inference, load_checkpoint, read_checkpoint

    ckpt = read_checkpoint(path)
    build = dict(ckpt.get("build") or {})
    if build.pop("example", None) != "gpt":
        raise ConfigError(
            f"{path}: check-inference rebuilds the example GPT only; this checkpoint names {build!r}"
        )
    from fp8track.examples.gpt_lightning import build_example  # Lightning: only once the checkpoint is good

    module, data, _ = build_example(**build)
    load_checkpoint(module, path)
    data.setup()
    val = list(itertools.islice(data.val_dataloader(), batches))
    return check_inference(module.model, val, checkpoint=_prefixed(ckpt["state_dict"]))


def _prefixed(state: dict[str, Any]) -> dict[str, Any]:
    """The Lightning module's state dict seen from its inner ``model`` (``model.`` prefix dropped)."""
    return {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}


def _experiment_id(tracking_uri: str) -> str:
    from mlflow import MlflowClient

    exp = MlflowClient(tracking_uri).get_experiment_by_name(DEMO_EXPERIMENT)
    return exp.experiment_id if exp is not None else "0"


@dataclass(frozen=True)
class DemoOutcome:
    """What :func:`run_and_diagnose` made: the runs (control first), the diagnosis of each FP8 run
    against the control (``"fp8"``, ``"planted"``: :class:`fp8track.report.run.DiagnoseResult`), the
    MLflow store, the UI links to its runs and their compare view, and the summary file."""

    out: Path
    tracking_uri: str
    runs: list[DemoRun]
    results: dict[str, Any]
    runs_url: str
    compare_url: str
    summary_path: Path


def run_and_diagnose(out: str | Path = "fp8track-demo", **train: Any) -> DemoOutcome:
    """``fp8track demo``: :func:`run_demo` (``train``: its keywords), then each FP8 run diagnosed
    against the control (:func:`fp8track.report.run.diagnose_runs`, into ``diagnosis-fp8/`` and
    ``diagnosis-planted/``, published to the run's MLflow run and W&B run) with library logs
    silenced (:func:`quiet_libraries`); the summary written to :data:`SUMMARY_FILE`."""
    from fp8track.report.run import diagnose_runs
    from fp8track.sweep.links import DEFAULT_UI, experiment_runs_url

    out = Path(out).resolve()
    uri = f"sqlite:///{out / 'mlflow.db'}"
    with quiet_libraries():
        runs = run_demo(out, **train)
        control = runs[0]
        results = {}
        for run in runs[1:]:
            label = "planted" if run.name == "fp8-planted" else "fp8"
            # a W&B run id only with use_wandb
            wandb_run = ("fp8track-demo", run.wandb_run_id, out) if run.wandb_run_id else None
            results[label] = diagnose_runs(
                run.run_dir,
                control.run_dir,
                out / f"diagnosis-{label}",
                tracking_uri=uri,
                mlflow_run_id=run.mlflow_run_id,
                wandb_run=wandb_run,
            )
        url = compare_url(uri, [r.mlflow_run_id for r in runs if r.mlflow_run_id])
        runs_url = experiment_runs_url(DEFAULT_UI, _experiment_id(uri))
    summary = {
        "runs": [
            {
                "name": r.name,
                "recipe": r.recipe,
                "run_dir": str(r.run_dir),
                "mlflow_run_id": r.mlflow_run_id,
                "wandb_run_id": r.wandb_run_id,
                "final_loss": r.final_loss,
                "seconds": round(r.seconds, 1),
            }
            for r in runs
        ],
        "final_loss_gap": runs[1].final_loss - runs[0].final_loss,
        "findings": {k: [f.kind for f in v.diagnosis.findings] for k, v in results.items()},
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
    return DemoOutcome(out, uri, runs, results, runs_url, url, out / SUMMARY_FILE)

