"""One call from two run references to ``diagnosis.json`` + ``report.html`` (and the trackers):
what ``fp8track diagnose`` and the demo run."""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8track.analysis.baseline import RunData, load_run
from fp8track.analysis.diagnose import Diagnosis, DiagnosisConfig
from fp8track.analysis.diagnose import diagnose as diagnose_pair
from fp8track.analysis.pairing import require_pairing
from fp8track.report.html import write_report


@dataclass(frozen=True)
class DiagnosisOutput:
    """The diagnosis, the files written and where the report was logged."""

    diagnosis: Diagnosis
    json_path: Path
    html_path: Path
    fp8: RunData
    control: RunData
    logged: tuple[str, ...] = field(default_factory=tuple)


def data_problems(fp8: RunData, control: RunData) -> dict[str, list[dict[str, Any]]]:
    """``{"fp8": [...], "control": [...]}``: per run, what its reader skipped
    (:attr:`fp8track.analysis.baseline.RunData.problems`); empty lists when both were read whole."""
    return {"fp8": [dict(p) for p in fp8.problems], "control": [dict(p) for p in control.problems]}


def diagnose_runs(
    fp8_ref: str | os.PathLike[str],
    baseline_ref: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    tracking_uri: str | None = None,
    config: DiagnosisConfig | None = None,
    mlflow_run_id: str | None = None,
    wandb_run: tuple[str, str, str | os.PathLike[str]] | None = None,
) -> DiagnosisOutput:
    """Load both runs (:func:`fp8track.analysis.baseline.load_run`), diagnose, write
    ``<out_dir>/diagnosis.json`` and ``<out_dir>/report.html``.

    The report goes to MLflow as artifacts of ``mlflow_run_id`` (default: the FP8 run itself when
    it is an ``mlflow:`` reference) and, with ``wandb_run=(project, run_id, dir)``, into that W&B
    run as HTML. A tracker that fails is warned about; the files are written regardless.

    Raises:
        ConfigError: an unusable run reference (naming it) or runs that cannot be compared
            (:func:`fp8track.analysis.pairing.check_pairing`: swapped, the same run twice, other
            layers or shapes, too few common steps), in one line.
    """
    fp8 = load_run(fp8_ref, tracking_uri)
    control = load_run(baseline_ref, tracking_uri)
    require_pairing(fp8, control)  # two runs that do not belong together: one line, no report
    d = diagnose_pair(fp8, control, config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "diagnosis.json"
    # What the readers skipped (damaged lines, missing files) travels with the diagnosis drawn from it.
    payload = {**d.to_dict(), "data_problems": data_problems(fp8, control)}
    json_path.write_text(json.dumps(payload, indent=2, allow_nan=False))
    html_path = write_report(out / "report.html", d, fp8, control)
    logged: list[str] = []
    run_id = mlflow_run_id or (str(fp8_ref)[len("mlflow:"):] if str(fp8_ref).startswith("mlflow:") else None)
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if run_id and uri:
        try:
            from fp8track.report.publish import log_report_to_mlflow

            logged += [
                f"mlflow:{run_id}/{p}" for p in log_report_to_mlflow(run_id, uri, [html_path, json_path])
            ]
        except Exception as exc:  # the files exist; a tracker problem must not lose the diagnosis
            warnings.warn(
                f"fp8track: could not log the report to MLflow run {run_id}: {exc!r}",
                RuntimeWarning,
                stacklevel=2,
            )
    if wandb_run is not None:
        try:
            from fp8track.report.publish import log_report_to_wandb

            project, wid, wdir = wandb_run
            logged.append(f"wandb:{log_report_to_wandb(html_path, project=project, run_id=wid, dir=wdir)}")
        except Exception as exc:
            warnings.warn(
                f"fp8track: could not log the report to W&B run {wandb_run[1]}: {exc!r}",
                RuntimeWarning,
                stacklevel=2,
            )
    return DiagnosisOutput(d, json_path, html_path, fp8, control, tuple(logged))


def diagnose(
    fp8_run: str | os.PathLike[str],
    control: str | os.PathLike[str],
    out_dir: str | os.PathLike[str] | None = None,
    *,
    tracking_uri: str | None = None,
    config: DiagnosisConfig | None = None,
) -> Diagnosis:
    """Diagnose an FP8 run against its BF16 control, both given as run references: what
    ``fp8track diagnose`` does, from Python (exported as ``fp8track.diagnose``).

    The diagnosis follows the FP8 troubleshooting path (:mod:`fp8track.analysis.diagnose`): the
    step-aligned loss gap in the control's own noise, spikes in both runs, the evaluation metrics,
    the layers ranked like with like. Nothing is thresholded on a universal constant.

    Args:
        fp8_run: the FP8 run: a local fp8track run directory, ``"mlflow:<run id>"`` or a W&B
            offline run directory (or its ``.wandb`` file).
        control: the BF16 control run, in the same forms.
        out_dir: when given, also write ``<out_dir>/diagnosis.json`` and ``<out_dir>/report.html``
            and log them to the FP8 run's MLflow run when it is an ``mlflow:`` reference
            (:func:`diagnose_runs`); by default nothing is written.
        tracking_uri: the MLflow tracking URI for ``mlflow:`` references (default:
            ``MLFLOW_TRACKING_URI``).
        config: the diagnosis settings (:class:`fp8track.analysis.diagnose.DiagnosisConfig`).

    Returns:
        The :class:`~fp8track.analysis.diagnose.Diagnosis`: ``verdict`` first (``healthy``,
        ``fp8_problem`` with the causal finding and its layers, or ``inconclusive`` with why),
        ``findings`` causal first (``top`` is the first; each with kind, severity, confidence,
        steps, layers and the next experiments in the path's order), ``layer_ranking`` and the
        loss judgement ``loss``;
        ``to_dict()`` is what ``diagnosis.json`` holds.

    Raises:
        ConfigError: an unusable run reference (naming it and the valid forms) or two runs that
            cannot be compared (swapped, the same run twice, other layers or shapes, too few
            common steps), before anything is written.

    Example:
        ```python
        import fp8track

        d = fp8track.diagnose("fp8track-runs/<fp8 run id>", "mlflow:<bf16 control run id>")
        print(d.verdict.verdict, d.verdict.layers)   # e.g. fp8_problem ('blocks.1.mlp.fc',)
        print(d.top.kind, d.top.severity, d.top.layers)   # e.g. mid_training_gap high ('blocks.1.mlp.fc',)
        for finding in d.findings:
            print(finding.title, finding.next_experiments)
        ```
    """
    if out_dir is not None:
        return diagnose_runs(fp8_run, control, out_dir, tracking_uri=tracking_uri, config=config).diagnosis
    fp8 = load_run(fp8_run, tracking_uri)
    ctl = load_run(control, tracking_uri)
    require_pairing(fp8, ctl)
    return diagnose_pair(fp8, ctl, config)


__all__ = ["diagnose", "diagnose_runs", "DiagnosisOutput"]
