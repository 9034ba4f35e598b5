"""The sweep's last step: the finalists rerun on the control's seeds, judged in the seed noise, and
the summary (:mod:`fp8track.sweep.summary`) written to the parent run: ``sweep_summary.json``,
``pareto.png``, ``recommendation.json``, ``summary.txt`` and ``fp8track.recommendation.*`` tags;
:func:`read_summary` reads the text back (:func:`stored_summary`: from a store's URI)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fp8track.errors import ConfigError
from fp8track.sweep.controls import Controls
from fp8track.sweep.mlflow_runs import GAP_METRIC, find_parent
from fp8track.sweep.summary import (
    Recommendation,
    TrialRow,
    format_text,
    judge,
    pareto_figure,
    pick_finalists,
    recommend,
    signed_gap,
    spread,
    summary_table,
    tolerance,
)


def finish_sweep(
    controls: Controls, status: Callable[[str], None], failed: Sequence[Any] = ()
) -> tuple[list[TrialRow], Recommendation]:
    """Rerun the finalists on the control's seeds, judge them, write the summary to the parent.
    ``failed``: the study's failed trials (Optuna ``FrozenTrial``), listed with their reasons."""
    runs, options, goal = controls.runs, controls.options, controls.spec.goal
    rows = with_failed(runs.trial_rows(), failed, controls)
    seed0 = next((controls.seed_of(params_of(controls, r)) for r in rows if r.finished), None)
    seeds = [seed0] if seed0 is None else [seed0 + i for i in range(options.control_seeds)]
    base = next((params_of(controls, r) for r in rows if r.finished), None)
    finals = (
        {s: controls.control(base if s is None else controls.with_seed(base, s)).final for s in seeds}
        if base
        else {}
    )
    cspread = spread(list(finals.values()))
    tol = tolerance(cspread, options.tolerance_factor, options.tolerance_floor)
    judged = []
    for r in pick_finalists(rows, tol, options.finalists):
        gaps = {seeds[0] if seeds[0] is not None else 0: r.gap}
        for s in seeds[1:]:
            status(f"finalist trial {r.trial} on seed {s}")
            params = controls.with_seed(params_of(controls, r), s)
            out = controls.run(params, "finalist", f"finalist trial-{r.trial:03d} seed={s}")
            if out.state == "COMPLETE":
                gaps[s] = signed_gap(out.final, finals[s], goal)
                runs.client.log_metric(out.run_id, GAP_METRIC, gaps[s])
        judged.append(judge(r, gaps, cspread, options.tolerance_factor, options.tolerance_floor))
    layers = {j.row.run_id: runs.layers(j.row.run_id, controls.launcher.logs) for j in judged}
    rec = recommend(judged, cspread, options.tolerance_factor, options.tolerance_floor, layers)
    write_summary(runs.client, runs.parent_run_id, rows, rec)
    return rows, rec


def with_failed(rows: list[TrialRow], failed: Sequence[Any], controls: Controls) -> list[TrialRow]:
    """``rows`` plus a FAIL row for each failed trial that has no child run (it failed before its
    program started: its control or ``auto:K`` run failed), each FAIL row with the trial's reason
    when its run has none; by trial number."""
    reasons = {t.number: str(t.user_attrs.get("error", "")) for t in failed}
    out = [dataclasses.replace(r, error=r.error or reasons.get(r.trial, "")) if r.state == "FAIL" else r
           for r in rows]
    have = {r.trial for r in rows}
    for t in failed:
        if t.number in have:
            continue
        params = {p.name: str(p.value if p.kind == "constant" else t.params.get(p.name, ""))
                  for p in controls.spec.params}
        out.append(TrialRow(t.number, "FAIL", params.get("recipe", ""), params.get("bf16_layers", ""), -1,
                            math.nan, params={k: params[k] for k in t.params}, error=reasons[t.number]))
    return sorted(out, key=lambda r: r.trial)


def params_of(controls: Controls, row: TrialRow) -> dict[str, Any]:
    """A trial's full parameters: the constants plus its varying values (typed from the spec)."""
    params: dict[str, Any] = {}
    for p in controls.spec.params:
        if p.kind == "constant":
            params[p.name] = p.value
        else:
            text = row.params.get(p.name, "")
            params[p.name] = (
                next((v for v in p.values if str(v) == text), text)
                if p.kind == "categorical"
                else (int(text) if p.kind == "int_uniform" else float(text))
            )
    return params


def write_summary(client: Any, rid: str, rows: list[TrialRow], rec: Recommendation) -> None:
    """The summary's artifacts, metrics and tags on the parent run ``rid``, which it terminates."""
    client.log_table(rid, summary_table(rows), "sweep_summary.json")
    client.log_figure(rid, pareto_figure(rows, rec), "pareto.png")
    client.log_dict(rid, rec.to_dict(), "recommendation.json")
    client.log_text(rid, format_text(rows, rec), "summary.txt")
    client.log_metric(rid, "recommendation/tolerance", rec.tolerance)
    client.log_metric(rid, "control/spread", rec.spread)
    if rec.trial is not None:
        t = rec.trial
        for k, v in {"recipe": t.recipe, "bf16_layers": t.bf16_layers, "trial": str(t.trial),
                     "bf16_layer_names": ",".join(t.bf16_names) or "none", "verdict": rec.verdict,
                     "apply_fp8": rec.apply_call}.items():
            client.set_tag(rid, f"fp8track.recommendation.{k}", v[:8000])
        client.log_metric(rid, "recommendation/mean_gap", rec.mean_gap)
        client.log_metric(rid, "recommendation/band", rec.band)
        if math.isfinite(t.fp8_flop_share):
            client.log_metric(rid, "recommendation/fp8_flop_share", t.fp8_flop_share)
    client.set_tag(rid, "fp8track.recommendation", rec.reason[:5000])
    client.set_terminated(rid, "FINISHED")


def read_summary(client: Any, parent_run_id: str) -> str | None:
    """The ``summary.txt`` the sweep wrote to its parent run (``None`` before it finished)."""
    import tempfile

    try:
        with tempfile.TemporaryDirectory() as tmp:
            return Path(client.download_artifacts(parent_run_id, "summary.txt", tmp)).read_text()
    except Exception:  # noqa: BLE001 - not written yet
        return None


def stored_summary(mlflow_uri: str, name: str) -> tuple[str, str | None]:
    """``(parent_run_id, summary text)`` of the sweep ``name`` in the store at ``mlflow_uri``
    (:func:`read_summary`; ``None`` before the sweep finished). A store or sweep that does not exist
    is a :class:`~fp8track.errors.ConfigError`."""
    from mlflow.tracking import MlflowClient

    store = mlflow_uri.removeprefix("sqlite:///")
    if store != mlflow_uri and not Path(store).is_file():  # MLflow would create an empty one
        raise ConfigError(
            f"no sweep store at {mlflow_uri}: sweep {name!r} has not run there "
            "(run it first, or pass the --tracking-uri and --out it used)"
        )
    client = MlflowClient(mlflow_uri)
    _exp_id, parent = find_parent(client, name)
    return parent, read_summary(client, parent)


__all__ = ["finish_sweep", "with_failed", "params_of", "write_summary", "read_summary", "stored_summary"]
