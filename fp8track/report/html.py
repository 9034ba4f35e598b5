"""``report.html``: the diagnosis in one self-contained page (inline CSS and PNG figures, no script,
no network), readable offline and attachable to a tracker run.

Sections: the verdict (healthy, fp8_problem or inconclusive, with its notes), summary (runs),
findings with their evidence and next experiments, the loss
and evaluation figures, the layer ranking (table and chart), and per-layer heatmaps of underflow,
relative error (-SQNR), cosine and scale drift over steps. A "Method" note says how every
judgement is made relative to the run's own layers and its control, not by fixed thresholds.
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fp8track.analysis.baseline import RunData
from fp8track.analysis.diagnose import Diagnosis, Finding
from fp8track.analysis.pairing import run_name, run_recipe
from fp8track.report.figures import all_figures, finite_or, stats_line
from fp8track.report.variants import variants_table

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2rem auto;
max-width:1100px;color:#222}
h1{font-size:1.6rem}h2{border-bottom:1px solid #ddd;padding-bottom:.2rem;margin-top:2rem}
.finding{border-left:6px solid #999;padding:.5rem 1rem;margin:1rem 0;background:#fafafa}
.finding.high{border-color:#d62728}.finding.medium{border-color:#ff7f0e}.finding.low{border-color:#bcbd22}
.finding.info{border-color:#2ca02c}.kind{font-family:monospace;background:#eee;padding:0 .3rem}
table{border-collapse:collapse;font-size:.85rem}
td,th{border:1px solid #ddd;padding:.2rem .5rem;text-align:left}
figure{margin:1rem 0}figure img{max-width:100%}figcaption{font-size:.85rem;color:#555}
.source{font-size:.75rem;color:#777;font-family:monospace}
pre{background:#f4f4f4;padding:.5rem;overflow-x:auto;font-size:.8rem}.method{font-size:.9rem;color:#444}
.verdict{font-size:1.1rem;padding:.6rem 1rem;margin:1rem 0;border-left:8px solid #999}
.verdict.healthy{border-color:#2ca02c}.verdict.fp8_problem{border-color:#d62728}
.verdict.inconclusive{border-color:#ff7f0e}
"""

METHOD = (
    "No metric here has a universal threshold. The loss gap is measured in units of the BF16 control's own "
    "step-to-step noise (1.4826 x MAD of its relative step-to-step differences / sqrt 2): the gap, smoothed "
    "by a running median of w steps, counts when it stays above k standard errors of such a median (k x "
    "1.2533 x noise / sqrt w); spikes are judged by a robust rolling detector on each run and matched by "
    "step; evaluation metrics use the same noise unit (or the control's own evaluation noise). Layers are "
    "scored by robust z-scores against the model's other layers (relative error as -SQNR, 1 - cosine, "
    "underflow, overflow, scale drift), flagged only where they stand out more than in the control, and "
    "their onset is found against their own history. Metrics nominate candidate layers; controlled "
    "experiments decide."
)


def _run_cell(run: RunData, source: str) -> str:
    """A run as a person knows it: its name and recipe, then where it was read from (small)."""
    e = html.escape
    recipe = run_recipe(run)
    return (
        f'<b class="run-name">{e(run_name(run))}</b>'
        + (f' <span class="kind">{e(recipe)}</span>' if recipe else "")
        + f'<br><span class="source">{e(source)}</span>'
    )


def _finding_html(f: Finding) -> str:
    e = html.escape
    items = "".join(f"<li>{e(x)}</li>" for x in f.next_experiments)
    meta = []
    if f.steps:
        meta.append(f"steps: {', '.join(map(str, f.steps))}")
    if f.layers:
        meta.append(f"layers: {', '.join(f.layers)}")
    if f.tensors:
        meta.append(f"tensors: {', '.join(f.tensors)}")
    evidence = json.dumps(f.to_dict()["evidence"], indent=1, default=str)
    return (
        f'<div class="finding {e(f.severity)}" data-kind="{e(f.kind)}">'
        f'<h3><span class="kind">{e(f.kind)}</span> {e(f.title)}</h3>'
        f"<p>severity <b>{e(f.severity)}</b>, confidence {f.confidence:.2f}"
        + (f" &middot; {e('; '.join(meta))}" if meta else "")
        + f"</p><p>{e(f.text)}</p><p>Next experiments, in order:</p><ol>{items}</ol>"
        f"<details><summary>evidence</summary><pre>{e(evidence)}</pre></details></div>"
    )


def _ranking_table(d: Diagnosis, top: int = 30) -> str:
    e = html.escape
    flagged = {f.layers[0] for f in d.findings if f.kind in ("layer_outlier", "latent_damage") and f.layers}
    rows = []
    for i, r in enumerate(d.layer_ranking[:top], 1):
        mark = " &#9888;" if r.layer in flagged else ""
        role = d.roles.get(r.layer)
        where = ("" if role is None else f"cause (from step {role.onset})" if role.role == "cause"
                 else f"consequence (from step {role.onset}): downstream of {role.downstream_of}")
        rows.append(
            f"<tr><td>{i}</td><td>{e(r.layer)}{mark}</td><td>{r.score:.2f}</td><td>{e(r.tensor)}</td>"
            f"<td>{e(where)}</td><td>{e(stats_line(r.stats.get(r.tensor, {})))}</td></tr>"
        )
    window = f" over steps {d.ranking_window[0]}-{d.ranking_window[1]}" if d.ranking_window else ""
    return (
        f"<p>Every monitored layer{window}, in causal order: candidate causes first (anomalous no later "
        "than the loss departed from the control), then the layers without anomaly by risk, then the "
        "consequences (anomalous only after the damage reached them) "
        f"(first {min(top, len(d.layer_ranking))} of {len(d.layer_ranking)}).</p>"
        '<table id="layer-ranking"><tr><th>#</th><th>layer</th><th>risk score</th><th>worst tensor</th>'
        "<th>role</th><th>its statistics (median over steps; overflow: max)</th></tr>"
        + "".join(rows) + "</table>"
    )


def describe_problems(problems: Sequence[Mapping[str, Any]]) -> str:
    """One line per run for the terminal and the report: ``metrics.jsonl: 3 damaged lines (12, 15,
    40); tensor_stats.jsonl: missing``; empty when nothing was skipped."""
    parts = []
    for p in problems:
        if p.get("missing"):
            parts.append(f"{p['file']}: missing")
            continue
        lines = ", ".join(str(n) for n in p["lines"][:10]) + (", ..." if p["damaged_lines"] > 10 else "")
        parts.append(f"{p['file']}: {p['damaged_lines']} damaged line(s) skipped ({lines})")
    return "; ".join(parts)


def _problems_html(fp8: RunData, control: RunData) -> str:
    """The records the readers skipped, per run (nothing when both were read whole)."""
    runs = (("FP8 run", fp8), ("BF16 control", control))
    rows = [(name, text) for name, run in runs if (text := describe_problems(run.problems))]
    if not rows:
        return ""
    cells = "".join(f"<tr><th>{html.escape(n)}</th><td>{html.escape(t)}</td></tr>" for n, t in rows)
    return (
        "<h2>Damaged records</h2><p>What the reader could not use was skipped; the diagnosis is drawn "
        "from the rest (diagnosis.json: <code>data_problems</code>).</p>"
        f'<table id="data-problems">{cells}</table>'
    )


def render_report(d: Diagnosis, fp8: RunData, control: RunData) -> str:
    """The report as one HTML string (figures inline as base64 PNG)."""
    e = html.escape
    figures = all_figures(d, fp8, control)
    figs = {fid: (cap, png) for fid, cap, png in figures}

    def fig(fid: str) -> str:
        if fid not in figs:
            return ""
        cap, png = figs[fid]
        return (f'<figure id="{fid}"><img alt="{e(cap)}" src="data:image/png;base64,{png}">'
                f"<figcaption>{e(cap)}</figcaption></figure>")

    lc = d.loss
    summary = (
        f'<table id="runs"><tr><th>FP8 run</th><td>{_run_cell(fp8, d.fp8_source)}</td></tr>'
        f"<tr><th>BF16 control</th><td>{_run_cell(control, d.control_source)}</td></tr>"
        f"<tr><th>common loss steps</th><td>{len(lc.steps)}</td></tr>"
        f"<tr><th>final loss gap</th><td>{100 * lc.final_gap:+.2f}% (control noise {100 * lc.noise:.2f}%, "
        f"tolerance {100 * lc.tolerance:.2f}%)</td></tr>"
        f"<tr><th>top finding</th><td>{e(d.top.kind)}: {e(d.top.title)}</td></tr>"
        "<tr><th>top-ranked layer</th>"
        f"<td>{e(d.layer_ranking[0].layer) if d.layer_ranking else 'n/a'}</td></tr>"
        "</table>"
    )
    v = d.verdict
    notes = "".join(f"<li>{e(n)}</li>" for n in v.notes)
    verdict = (
        f'<div id="verdict" class="verdict {e(v.verdict)}" data-verdict="{e(v.verdict)}">'
        f"<b>Verdict: {e(v.verdict)}</b>: {e(v.reason)}"
        + (f" (cause: <b>{e(v.layers[0])}</b>)" if v.verdict == "fp8_problem" and v.layers else "")
        + (f"<ul>{notes}</ul>" if notes else "")
        + "</div>"
    )
    heatmaps = "".join(fig(fid) for fid in figs if fid.startswith("fig-heatmap-"))
    evals = ""
    if d.eval_metrics:
        rows = "".join(
            f"<tr><td>{e(k)}</td><td>{finite_or(v['fp8'])}</td><td>{finite_or(v['control'])}</td>"
            f"<td>{100 * v['worse_rel']:+.2f}%</td><td>{finite_or(v['z'])}</td></tr>"
            for k, v in d.eval_metrics.items()
        )
        evals = ("<table><tr><th>metric</th><th>FP8</th><th>control</th><th>worse by</th>"
                 f"<th>in noise units</th></tr>{rows}</table>")
    body = (
        f"<h1>fp8track diagnosis: {e(run_name(fp8))} vs {e(run_name(control))}</h1>{verdict}{summary}"
        f"{_problems_html(fp8, control)}"
        f'<h2>Findings</h2><div id="findings">{"".join(_finding_html(f) for f in d.findings)}</div>'
        f"<h2>Loss and gap</h2>{fig('fig-loss')}"
        "<h2>Validation and downstream metrics</h2>"
        f"{evals or '<p>No evaluation metrics recorded in both runs.</p>'}"
        f"{fig('fig-eval')}"
        f"<h2>Layer ranking</h2>{_ranking_table(d)}{fig('fig-ranking')}"
        f"<h2>Per-layer heatmaps</h2>{heatmaps or '<p>No tensor statistics recorded.</p>'}"
        "<h2>What-if and column-wise statistics</h2>"
        f"{variants_table([(run_name(fp8), fp8.tensor_rows), (run_name(control), control.tensor_rows)])}"
        f'<h2>Method</h2><p class="method">{e(METHOD)}</p>'
    )
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>fp8track diagnosis: {e(run_name(fp8))}: {e(d.verdict.verdict)}</title>"
        f"<style>{CSS}</style></head>"
        f"<body>{body}</body></html>"
    )


def write_report(path: str | os.PathLike[str], d: Diagnosis, fp8: RunData, control: RunData) -> Path:
    """Write :func:`render_report` to ``path`` (parents created); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_report(d, fp8, control), encoding="utf-8")
    return out


__all__ = ["render_report", "write_report", "describe_problems", "METHOD"]
