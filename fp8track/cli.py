"""Command-line interface: ``fp8track <command>``."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fp8track.errors import ConfigError, redacted_output

EXIT_BAD_INPUT = 2
"""Exit status for refused input, the same as argparse's for a bad option."""

MLFLOW_HTTP_RETRIES = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}
"""MLflow's HTTP retry settings for the commands (MLflow's defaults: 7 retries, factor 2, 120 s
timeout, about 4 minutes before an unreachable server is an error)."""


MLFLOW_URI_SCHEMES = ("sqlite", "http", "https", "postgresql", "mysql", "mssql", "databricks")
"""Tracking-URI schemes of the MLflow stores fp8track accepts (MLflow >= 3.13 refuses ``file:``
stores, and a bare path means one)."""


def check_tracking_uri(option: str, uri: str | None) -> None:
    """Refuse an MLflow tracking URI whose scheme no supported store has, before anything runs
    (``bogus://x`` would otherwise fail deep inside MLflow's store registry)."""
    if uri is None:
        return
    scheme = uri.split("://", 1)[0].split("+", 1)[0].lower() if "://" in uri else ""
    if scheme not in MLFLOW_URI_SCHEMES:
        valid = ", ".join(f"{s}://" for s in MLFLOW_URI_SCHEMES)
        raise ConfigError(
            f"{option} {uri!r} is not an MLflow tracking URI fp8track can use; valid schemes are: {valid} "
            "(e.g. sqlite:///mlflow.db or http://127.0.0.1:5000)"
        )


DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql", "oracle")
"""Database schemes (SQLAlchemy dialects) of an MLflow store or an Optuna storage."""


def check_database_uri(option: str, uri: str | None) -> None:
    """Refuse a database URI SQLAlchemy cannot open here: an unknown dialect, or a known one whose
    driver is not installed (``postgresql://`` without psycopg), before anything is created.
    SQLAlchemy's own dialect registry decides, so every driver it knows is accepted."""
    if uri is None or "://" not in uri:
        return
    scheme = uri.split("://", 1)[0].split("+", 1)[0].lower()
    if scheme not in DATABASE_SCHEMES and option == "--storage":
        valid = ", ".join(f"{s}://" for s in DATABASE_SCHEMES)
        raise ConfigError(f"{option} {uri!r} is not a database URL; valid schemes are: {valid}")
    if scheme not in DATABASE_SCHEMES:
        return  # an http(s) or databricks tracking server: no driver here
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        make_url(uri).get_dialect().import_dbapi()
    except (ArgumentError, NoSuchModuleError, ValueError) as err:
        raise ConfigError(f"{option} {uri!r} is not a database URL SQLAlchemy can open: {err}") from None
    except ImportError as err:
        raise ConfigError(
            f"{option} {uri!r} needs a database driver that is not installed ({err}); install it "
            "(e.g. pip install psycopg for postgresql://) or use sqlite:///<path>"
        ) from None


def check_number(option: str, value: float | None, low: float) -> None:
    """Refuse a number option that is NaN, infinite or below ``low``."""
    if value is not None and not (math.isfinite(value) and value >= low):
        raise ConfigError(f"{option} must be a finite number >= {low:g}, got {value!r}")


def check_out_dir(option: str, path: str | None) -> None:
    """Refuse an output folder that exists as something other than a folder (a file)."""
    if path is not None and Path(path).exists() and not Path(path).is_dir():
        raise ConfigError(f"{option} {path!r} exists and is not a folder; give a new or existing folder")


def check_args(args: argparse.Namespace) -> None:
    """The argument checks argparse cannot express, per command, before the command runs
    (each raises :class:`ConfigError`: one line, exit 2)."""
    if args.command == "sweep" and args.trials is not None and args.trials < 1:
        raise ConfigError(f"--trials must be an integer >= 1, got {args.trials}")
    for option in ("tracking_uri", "mlflow_uri"):
        check_tracking_uri(f"--{option.replace('_', '-')}", getattr(args, option, None))
    for option in ("tracking_uri", "mlflow_uri", "storage"):
        check_database_uri(f"--{option.replace('_', '-')}", getattr(args, option, None))
    if args.command in ("diagnose", "check-inference", "sweep", "demo"):
        check_out_dir("--out", getattr(args, "out", None))
    if args.command == "integrations":
        check_out_dir("--copy", args.copy)
    if args.command == "sync":
        check_out_dir("--wandb-dir", args.wandb_dir)
    if args.command == "check-inference" and args.batches < 1:
        raise ConfigError(f"--batches must be an integer >= 1, got {args.batches}")
    if args.command == "sweep":
        check_number("--tolerance-factor", args.tolerance_factor, 0.0)
        check_number("--tolerance-floor", args.tolerance_floor, 0.0)
        check_number("--kill-grace", args.kill_grace, 0.0)


def _cmd_stats(args: argparse.Namespace) -> int:
    """Quantisation statistics of a real tensor: the weights of a seeded linear layer and its
    activations on real text bytes (this file's own source), under each FP8 format."""
    import torch

    from fp8track.numerics.stats import block_quant_stats, quant_stats

    torch.manual_seed(0)
    rows, width = 64, 256
    text = Path(__file__).read_bytes()
    # Repeat the source to fill the matrix: the file may be shorter than rows * width bytes.
    text = (text * (rows * width // max(len(text), 1) + 1))[: rows * width]
    x = torch.tensor(list(text), dtype=torch.float32).reshape(rows, width) / 255.0
    layer = torch.nn.Linear(256, 512)
    act = layer(x).detach()
    out = {
        "activation_e4m3": quant_stats(act, "e4m3"),
        "activation_mxfp8": block_quant_stats(act, "mxfp8"),
        "weight_e4m3": quant_stats(layer.weight, "e4m3"),
        "weight_e5m2": quant_stats(layer.weight, "e5m2"),
    }
    print(json.dumps(out, indent=2))
    return 0


def _cmd_diagnose(args: argparse.Namespace) -> int:
    from fp8track.analysis.pairing import run_label
    from fp8track.report.console import print_diagnosis
    from fp8track.report.html import describe_problems
    from fp8track.report.run import diagnose_runs

    # Unusable input raises ConfigError: main() prints it as one line and exits 2.
    res = diagnose_runs(args.fp8_run, args.control, args.out, tracking_uri=args.tracking_uri)
    print_diagnosis(res.diagnosis, res.html_path, runs=(run_label(res.fp8), run_label(res.control)))
    for what, run in (("FP8 run", res.fp8), ("control", res.control)):
        if run.problems:
            print(f"damaged records in the {what} {run.source}: {describe_problems(run.problems)}")
    print(f"diagnosis.json: {res.json_path}")
    for where in res.logged:
        print(f"logged: {where}")
    return 0


def _cmd_check_inference(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from fp8track.demo import check_example_checkpoint

    res = check_example_checkpoint(args.checkpoint, batches=args.batches)  # bad input: ConfigError -> main()
    console = Console()
    table = Table(title=f"inference chain: {res.metric_name} per variant (same {args.batches} batches)")
    table.add_column("variant")
    table.add_column(res.metric_name)
    for k, v in res.metrics.items():
        table.add_row(k, "n/a" if v is None else f"{v:.4f}")
    console.print(table)
    worst = sorted((r for r in res.layers if r.variant == "fp8_trained_scales"), key=lambda r: r.sqnr_db)[:5]
    for r in worst:
        console.print(
            f"  {r.layer}: output SQNR vs BF16 {r.sqnr_db:.1f} dB, cos {r.cos:.5f} (trained scales)"
        )
    console.print("checkpoint restores weights and scaling state exactly" if not res.checkpoint
                  else f"[red]checkpoint differs in {len(res.checkpoint)} entries[/red]")
    for p in res.problems:
        console.print(f"[red]{p.kind}[/red] {p.layer}{'/' + p.tensor if p.tensor else ''}: {p.detail}")
    if args.out:
        import json
        from pathlib import Path

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "inference.json").write_text(json.dumps(res.to_dict(), indent=2))
        console.print(f"inference.json: {out / 'inference.json'}")
    return 1 if res.problems else 0


def integrations_root() -> Path:
    """The ``integrations/`` folder: inside the installed package (a wheel build copies it to
    ``fp8track/integrations``, see setup.py), else the source checkout's top-level folder."""
    package = Path(__file__).resolve().parent
    for candidate in (package / "integrations", package.parent / "integrations"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"fp8track's integrations/ folder is missing (looked in {package} and its parent)"
    )


def integration_files(root: Path | None = None) -> list[Path]:
    """Every file under ``integrations/``, as paths relative to it, sorted."""
    root = root or integrations_root()
    return sorted(
        p.relative_to(root) for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    )


def _cmd_integrations(args: argparse.Namespace) -> int:
    """List the integration files, or copy them (keeping their folders) into ``--copy DIR``."""
    root = integrations_root()
    files = integration_files(root)
    if args.copy is None:
        for rel in files:
            print(rel.as_posix())
        return 0
    dest = Path(args.copy)
    clashes = [rel for rel in files if (dest / rel).exists()]
    if clashes and not args.force:
        print(
            f"not copying: {len(clashes)} file(s) exist in {dest} ({clashes[0].as_posix()}, ...); "
            "use --force",
            file=sys.stderr,
        )
        return 1
    for rel in files:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / rel, dest / rel)
        print((dest / rel).as_posix())
    return 0


DESCRIPTION = "fp8track: watch, compare and diagnose FP8 training runs against their BF16 control."

COMMANDS = {
    "demo": "train a BF16 control, FP8 and a planted problem; diagnose",
    "diagnose": "diagnose an FP8 run against its BF16 control",
    "sweep": "search recipes and BF16 layers from a W&B sweep YAML",
    "sync": "replay a run directory's missed steps into MLflow or W&B",
    "check-inference": "compare FP8 and BF16 inference of a checkpoint",
    "stats": "FP8 quantisation statistics of a sample tensor",
    "integrations": "list or copy the files for LightningCLI, TE, W&B",
}
"""Every command with its one line of ``fp8track --help``, in the order shown (each fits the
80-column help listing; the subcommand modules' own help strings are replaced by these)."""


class _HelpFormatter(argparse.HelpFormatter):
    """argparse measures the command names at their group's indent but prints them one indent
    deeper, which pushed ``check-inference``'s help onto a second line: widen the column by that."""

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        if action.nargs == argparse.PARSER:
            self._action_max_length += self._indent_increment


class _Commands:
    """The sub-parsers object as the subcommand modules see it: their ``add_parser`` gets the
    command's line of :data:`COMMANDS` as its help and plain text (no reST ``````) as its description."""

    def __init__(self, sub: Any) -> None:
        self._sub = sub

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        kwargs["help"] = COMMANDS.get(name, kwargs.get("help"))
        description = (kwargs.get("description") or kwargs["help"] or "").replace("``", "")
        kwargs["description"] = description[:1].upper() + description[1:]
        return self._sub.add_parser(name, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp8track", description=DESCRIPTION, formatter_class=_HelpFormatter)
    sub = _Commands(parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND"))
    from fp8track.demo import add_subparser as add_demo
    from fp8track.sweep.cli import add_subparser as add_sweep
    from fp8track.trackers.replay import add_subparser as add_sync

    add_demo(sub)
    p = sub.add_parser(
        "diagnose",
        description="Diagnose an FP8 run against its BF16 control: findings, the layer "
        "ranking, diagnosis.json and report.html. Runs that do not belong together (swapped, the same "
        "run twice, other layers, too few common steps) are refused with one line and exit status 2.",
    )
    p.add_argument(
        "fp8_run", metavar="FP8_RUN", help="run directory, mlflow:<run_id> or W&B offline run directory"
    )
    p.add_argument("--control", "--baseline", dest="control", required=True, metavar="BF16_RUN",
                   help="the BF16 control, same forms (--baseline: its former name)")
    p.add_argument("--out", default="fp8track-diagnosis", help="output folder (default ./fp8track-diagnosis)")
    p.add_argument(
        "--tracking-uri", default=None, help="MLflow tracking URI for mlflow: runs (else MLFLOW_TRACKING_URI)"
    )
    p.set_defaults(func=_cmd_diagnose)
    add_sweep(sub)
    add_sync(sub)
    p = sub.add_parser(
        "check-inference",
        description="FP8 inference with the trained scales, with fresh scales "
        "and BF16 inference of a checkpoint on the same batches; checks that it reloads exactly.",
    )
    p.add_argument(
        "checkpoint", help="a checkpoint written by fp8track.inference.save_checkpoint (the demo writes one)"
    )
    p.add_argument("--batches", type=int, default=8, help="validation batches to evaluate (default 8)")
    p.add_argument("--out", default=None, help="folder for inference.json")
    p.set_defaults(func=_cmd_check_inference)
    p = sub.add_parser(
        "stats",
        description="Quantisation statistics of a real tensor (a seeded linear layer's "
        "weights and its activations on text bytes) under each FP8 format, as JSON.",
    )
    p.set_defaults(func=_cmd_stats)
    p = sub.add_parser(
        "integrations",
        description="List the files fp8track hands to other tools (LightningCLI "
        "config, TE debug API YAML, W&B sweep YAML), or copy them into a folder.",
    )
    p.add_argument(
        "--copy", metavar="DIR", default=None, help="copy every file into DIR, keeping its folders"
    )
    p.add_argument("--force", action="store_true", help="overwrite files that exist in DIR")
    p.set_defaults(func=_cmd_integrations)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Refused input (a :class:`~fp8track.errors.ConfigError`: a bad recipe, a run
    directory that does not exist...) prints one line, ``fp8track <command>: error: <message>``, on
    stderr and returns 2, like argparse's own errors; anything else is a bug and keeps its traceback."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # MLflow retries an unreachable server for about 4 minutes by default; a command says so sooner
    # (the user's own MLFLOW_HTTP_REQUEST_* settings win).
    if args.command in ("sync", "diagnose"):  # not the sweep: its trials inherit the environment
        for name, value in MLFLOW_HTTP_RETRIES.items():
            os.environ.setdefault(name, value)
    with redacted_output():  # MLflow's own lines ("View run ... at <URI>") carry the URI's password
        try:
            check_args(args)
            return int(args.func(args))
        except ConfigError as exc:
            message = " ".join(str(exc).split())  # one line, whatever the cause's text held
            print(f"{parser.prog} {args.command}: error: {message}", file=sys.stderr)
            return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
