"""Command-line interface: ``fp8track <command>`` (also ``python -m fp8track.cli``).

One module per command, each holding its arguments, the checks argparse cannot express and the
call into the library that does the work: :mod:`~fp8track.cli.demo`, :mod:`~fp8track.cli.diagnose`,
:mod:`~fp8track.cli.sweep`, :mod:`~fp8track.cli.sync`, :mod:`~fp8track.cli.check_inference`,
:mod:`~fp8track.cli.stats`, :mod:`~fp8track.cli.integrations`. Each defines ``add_parser(sub)``,
``check(args)`` (raises :class:`~fp8track.errors.ConfigError`) and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from fp8track.cli import check_inference, demo, diagnose, integrations, stats, sweep, sync
from fp8track.errors import ConfigError, redacted_output

EXIT_BAD_INPUT = 2
"""Exit status for refused input, the same as argparse's for a bad option."""

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
80-column help listing)."""

COMMAND_MODULES: dict[str, ModuleType] = {
    "demo": demo,
    "diagnose": diagnose,
    "sweep": sweep,
    "sync": sync,
    "check-inference": check_inference,
    "stats": stats,
    "integrations": integrations,
}
"""The module of each command of :data:`COMMANDS`."""


class _HelpFormatter(argparse.HelpFormatter):
    """argparse measures the command names at their group's indent but prints them one indent
    deeper, which pushed ``check-inference``'s help onto a second line: widen the column by that."""

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        if action.nargs == argparse.PARSER:
            self._action_max_length += self._indent_increment


class _Commands:
    """The sub-parsers object as the command modules see it: their ``add_parser`` gets the
    command's line of :data:`COMMANDS` as its help and plain text (no reST ``````), starting with a
    capital, as its description (that line when the module gives none)."""

    def __init__(self, sub: Any) -> None:
        self._sub = sub

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        kwargs["help"] = COMMANDS[name]
        description = (kwargs.get("description") or kwargs["help"]).replace("``", "")
        kwargs["description"] = description[:1].upper() + description[1:]
        return self._sub.add_parser(name, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """``fp8track``'s parser: every command of :data:`COMMANDS`, in its order."""
    parser = argparse.ArgumentParser(prog="fp8track", description=DESCRIPTION, formatter_class=_HelpFormatter)
    sub = _Commands(parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND"))
    for name in COMMANDS:
        COMMAND_MODULES[name].add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Refused input (a :class:`~fp8track.errors.ConfigError`: a bad recipe, a run
    directory that does not exist...) prints one line, ``fp8track <command>: error: <message>``, on
    stderr and returns 2, like argparse's own errors; anything else is a bug and keeps its traceback."""
    parser = build_parser()
    args = parser.parse_args(argv)
    command = COMMAND_MODULES[args.command]
    with redacted_output():  # MLflow's own lines ("View run ... at <URI>") carry the URI's password
        try:
            command.check(args)  # before the command runs, so a refused command creates nothing
            return int(command.run(args))
        except ConfigError as exc:
            message = " ".join(str(exc).split())  # one line, whatever the cause's text held
            print(f"{parser.prog} {args.command}: error: {message}", file=sys.stderr)
            return EXIT_BAD_INPUT


__all__ = ["COMMANDS", "DESCRIPTION", "EXIT_BAD_INPUT", "build_parser", "main"]
