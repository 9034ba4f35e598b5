"""The diagnosis on a terminal (rich): what ``fp8track diagnose`` and the demo print. Tables are at
most :data:`TABLE_WIDTH` columns wide, whatever the terminal."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

TABLE_WIDTH = 80
"""Widest table printed, in terminal columns (cells wrap inside it)."""

COLORS = {"high": "red", "medium": "yellow", "low": "cyan", "info": "green"}


def print_diagnosis(
    d: Any, html_path: Any = None, console: Any = None, runs: Sequence[str] | None = None
) -> None:
    """A short summary of a diagnosis on the terminal: which runs, the verdict (first: one answer
    per pair) and its notes, the findings (a table at most :data:`TABLE_WIDTH` wide), the first next
    experiment, the top-ranked layer of the causal order, the report's path. ``runs``: how to name
    the FP8 run and the control (:func:`fp8track.analysis.pairing.run_label`)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    if runs:
        console.print(f"[bold]{runs[0]}[/bold] against the control [bold]{runs[1]}[/bold]", highlight=False)
    if d.kinds() == ["mismatched_runs"]:
        console.print(f"[red]not compared:[/red] {d.top.text}", highlight=False)
        return
    console.print(verdict_line(d, markup=True), highlight=False)
    for note in d.verdict.notes:
        console.print(f"  note: {note}", highlight=False)
    table = Table(width=min(console.width, TABLE_WIDTH), box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("severity", no_wrap=True)
    table.add_column("finding", ratio=5)
    table.add_column("layers", ratio=3, overflow="fold")
    table.add_column("conf.", justify="right", no_wrap=True)
    for f in d.findings:
        c = COLORS[f.severity]
        table.add_row(
            f"[{c}]{f.severity}[/{c}]",
            f"[bold]{f.kind}[/bold]\n{f.title}",
            "\n".join(f.layers[:3]),
            f"{f.confidence:.2f}",
        )
    console.print(table)
    if d.top.next_experiments:
        console.print(f"[bold]Next for {d.top.kind}:[/bold] " + d.top.next_experiments[0], highlight=False)
    if d.layer_ranking:
        top = d.layer_ranking[0]
        role = d.roles.get(top.layer)
        console.print(
            f"[bold]Top-ranked layer:[/bold] {top.layer} ({top.tensor}, risk score {top.score:.1f}"
            + (f", anomalous from step {role.onset}" if role else "")
            + (f", tied with {', '.join(top.tied[:3])}" + (" ..." if len(top.tied) > 3 else "")
               if top.tied else "") + ")",
            highlight=False,
        )
    if html_path is not None:
        console.print(f"[bold]Report:[/bold] {html_path}", highlight=False, soft_wrap=True)


VERDICT_COLORS = {"healthy": "green", "fp8_problem": "red", "inconclusive": "yellow"}


def verdict_line(d: Any, markup: bool = False) -> str:
    """The pair's answer in one line: ``Verdict: fp8_problem: <reason> (cause: <layer>)``; the
    console, the demo's answers and the report's headline say the same."""
    v = d.verdict
    word = f"[bold {VERDICT_COLORS[v.verdict]}]{v.verdict}[/]" if markup else v.verdict
    cause = f" (cause: {v.layers[0]})" if v.verdict == "fp8_problem" and v.layers else ""
    return f"Verdict: {word}: {v.reason}{cause}"


__all__ = ["print_diagnosis", "verdict_line", "TABLE_WIDTH"]
