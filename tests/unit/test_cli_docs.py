"""Every ``fp8track`` command written in README.md and docs/ parses with today's parser: the code
blocks' command lines and the inline ``fp8track ...`` spans, usage notation (``[--out DIR]``,
``<run dir>``, ``N``) filled in. An inline mention of a command or one of its options without the
command's required arguments (``fp8track sync --wandb-dir``) must name a command and options that exist."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from fp8track.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# A command line in a code block: optional VAR=value prefixes, then fp8track.
BLOCK_LINE = re.compile(r"^\s*(?:[A-Z_][A-Z0-9_]*=\S+\s+)*(fp8track\s+[a-z].*)$")
INLINE = re.compile(r"`((?:[A-Z_][A-Z0-9_]*=\S+\s+)*fp8track [^`]+)`")
# Metavariables of number options in usage lines, and the value each stands for here.
NUMBERS = {"N": "3", "S": "0"}


def written_commands() -> list[tuple[str, str]]:
    """``(where, command)`` for every fp8track command in the docs, code blocks and inline spans."""
    found = []
    for path in DOCS:
        in_block = False
        for n, line in enumerate(path.read_text().splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{n}"
            if line.lstrip().startswith("```"):
                in_block = not in_block
                continue
            if in_block:
                m = BLOCK_LINE.match(line)
                found += [(where, m.group(1))] if m else []
            else:
                found += [(where, span) for span in INLINE.findall(line)]
    return found


def usage_to_argv(command: str) -> list[str]:
    """The argv after ``fp8track`` of a written command: its comment dropped, optional brackets
    opened, ``<placeholders>`` and ``(notes)`` replaced or dropped, number metavariables filled in."""
    command = re.split(r"\s#\s", command, maxsplit=1)[0]
    command = re.sub(r"^(?:[A-Z_][A-Z0-9_]*=\S+\s+)*", "", command)  # environment prefixes
    command = re.sub(r"<[^>]*>", "x", command)
    command = re.sub(r"\s\([^)]*\)", "", command)
    command = command.replace("[", " ").replace("]", " ").replace("...", " ")
    argv = shlex.split(command)[1:]
    return [NUMBERS.get(a, a) for a in argv]


def _subparser(name: str) -> argparse.ArgumentParser:
    return build_parser()._subparsers._group_actions[0].choices[name]


def _is_mention(argv: list[str]) -> bool:
    """A command named in prose (``fp8track sweep``, ``fp8track sync --all``): no positional
    arguments given to a command that requires some."""
    required = [a for a in _subparser(argv[0])._actions if not a.option_strings and a.required]
    return bool(required) and all(a.startswith("-") for a in argv[1:])


def test_the_docs_write_every_command():
    commands = written_commands()
    assert len(commands) >= 20  # the extraction finds them (57 when written)
    named = {usage_to_argv(c)[0] for _, c in commands if "|" not in c and "fp8track <" not in c}
    assert named == set(COMMANDS)


@pytest.mark.parametrize(("where", "command"), written_commands(), ids=lambda v: v if ".md" in v else "")
def test_written_command_parses(where, command, capsys):
    if "fp8track <command>" in command:  # the refusal message's format, not a command
        return
    if " | " in command:  # a listing of the commands: "fp8track demo | stats | ..."
        assert set(command.removeprefix("fp8track ").split(" | ")) == set(COMMANDS), where
        return
    argv = usage_to_argv(command)
    assert argv and argv[0] in COMMANDS, f"{where}: {command!r} names no command"
    if _is_mention(argv):
        options = _subparser(argv[0])._option_string_actions
        unknown = [a for a in argv[1:] if a not in options]
        assert not unknown, f"{where}: {command!r}: no such option {unknown}"
        return
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: {command!r} does not parse: {capsys.readouterr().err.strip()}")
    assert args.command == argv[0]


def test_a_changed_option_fails_the_check(capsys):
    """The check itself: a command written with an option the parser no longer has fails."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(usage_to_argv("fp8track sync RUN_DIR --mlflow-url sqlite:///m.db"))
    assert "unrecognized arguments: --mlflow-url" in capsys.readouterr().err
    usage = "fp8track sync RUN_DIR [--mlflow-uri URI [--mlflow-run-id ID]] [--all]   # note"
    want = ["sync", "RUN_DIR", "--mlflow-uri", "URI", "--mlflow-run-id", "ID", "--all"]
    assert usage_to_argv(usage) == want
    assert usage_to_argv("fp8track diagnose fp8track-runs/<fp8 run id> --control <run> (a note)") == [
        "diagnose", "fp8track-runs/x", "--control", "x"
    ]
