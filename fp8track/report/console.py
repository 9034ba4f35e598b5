"""The diagnosis on a terminal (rich): what ``fp8track diagnose`` and the demo print."""

from __future__ import annotations

from typing import Any


def print_diagnosis(d: Any, html_path: Any = None, console: Any = None) -> None:
    """A short summary of a diagnosis on the terminal: findings, top-ranked layers, the report."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    colors = {"high": "red", "medium": "yellow", "low": "cyan", "info": "green"}
    table = Table(title="fp8track diagnosis", show_lines=False)
    for col in ("severity", "kind", "finding", "layers", "confidence"):
        table.add_column(col)
    for f in d.findings:
        c = colors[f.severity]
        table.add_row(f"[{c}]{f.severity}[/{c}]", f.kind, f.title, ", ".join(f.layers[:3]), f"{f.confidence:.2f}")
    console.print(table)
    if d.top.next_experiments:
        console.print(f"[bold]Next for {d.top.kind}:[/bold] " + d.top.next_experiments[0])
    if d.layer_ranking:
        top = d.layer_ranking[0]
        console.print(f"[bold]Top-ranked layer:[/bold] {top.layer} ({top.tensor}, risk score {top.score:.1f})")
    if html_path is not None:
        console.print(f"[bold]Report:[/bold] {html_path}")


__all__ = ["print_diagnosis"]
