"""A trial's command line, built as ``wandb agent`` builds it, and the hash of the program it runs.

W&B's agent (``wandb/wandb_agent.py``, ``Agent._command_run``; ``sweeps`` macros in
``wandb/sdk/launch/sweeps/utils.py``, ``create_sweep_command_args``) expands each item of the YAML's
``command`` (default :data:`DEFAULT_COMMAND`) that is a whole ``${macro}`` into a list of words:

* ``${env}`` -> ``/usr/bin/env``; ``${interpreter}`` -> ``python`` (W&B: whatever ``python`` the
  ``PATH`` finds; here the interpreter running ``fp8track``, so a trial sees the same packages);
* ``${program}`` -> the YAML's ``program`` as written;
* ``${args}`` -> ``--name=value`` per parameter, ``${args_no_hyphens}`` -> ``name=value``,
  ``${args_no_boolean_flags}`` -> ``--name`` for true booleans, false ones left out,
  ``${args_json}`` -> one JSON word, ``${args_json_file}`` -> the path of a file holding that JSON;
  values are Python's ``str()`` (``True``, ``0.001``), as W&B writes them;
* ``${envvar:NAME}`` inside a word -> the value of the environment variable ``NAME``.

Any other word is kept. An unknown ``${...}`` macro is refused (W&B silently drops it). A DDP
program runs under ``torchrun`` by writing the command, e.g.
``[torchrun, --standalone, --nproc_per_node=2, ${program}, ${args}]``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fp8track.errors import ConfigError, invalid_choice

DEFAULT_COMMAND = ("${env}", "${interpreter}", "${program}", "${args}")
"""W&B's ``Agent.DEFAULT_SWEEP_COMMAND``."""
MACROS = ("env", "interpreter", "program", "args", "args_no_hyphens", "args_no_boolean_flags", "args_json",
          "args_json_file")
ENVVAR_RE = re.compile(r"\$\{envvar:([A-Za-z0-9_]*)\}")


def check_command(command: Sequence[Any], where: str) -> tuple[str, ...]:
    """The YAML's ``command`` as strings; an unknown whole-word macro raises :class:`ConfigError`."""
    if isinstance(command, (str, bytes)) or not isinstance(command, Sequence) or not command:
        raise ConfigError(f"{where}: command must be a non-empty list of words, got {command!r}")
    words = tuple(str(c) for c in command)
    for w in words:
        if w.startswith("${") and w.endswith("}") and not ENVVAR_RE.fullmatch(w) and w[2:-1] not in MACROS:
            raise invalid_choice(
                f"{where}: command macro", w, tuple(f"${{{m}}}" for m in MACROS) + ("${envvar:NAME}",)
            )
    return words


def expand(command: Sequence[str], program: str, params: Mapping[str, Any], json_file: Path | None = None,
           env: Mapping[str, str] | None = None) -> list[str]:
    """The argv of one trial (module docstring); ``json_file`` receives ``${args_json}`` when the
    command asks for ``${args_json_file}``.

    Example:
        >>> expand(["${env}", "${interpreter}", "${program}", "${args}"], "train.py",
        ...        {"lr": 0.1, "amp": True})[2:]
        ['train.py', '--lr=0.1', '--amp=True']
    """
    env = os.environ if env is None else env
    as_json = json.dumps(dict(params))
    words: dict[str, list[str]] = {
        "env": ["/usr/bin/env"],
        "interpreter": [sys.executable],
        "program": [program],
        "args": [f"--{k}={v}" for k, v in params.items()],
        "args_no_hyphens": [f"{k}={v}" for k, v in params.items()],
        "args_no_boolean_flags": [
            f"--{k}" if v is True else f"--{k}={v}" for k, v in params.items() if v is not False
        ],
        "args_json": [as_json],
        "args_json_file": [str(json_file)] if json_file else [],
    }
    if json_file is not None and "${args_json_file}" in command:
        json_file.write_text(as_json)
    out: list[str] = []
    for w in command:
        if w.startswith("${") and w.endswith("}") and w[2:-1] in words:
            out += words[w[2:-1]]
        else:
            out.append(ENVVAR_RE.sub(lambda m: env.get(m.group(1), ""), w))
    return out


def program_source(program: str, cwd: Path) -> Path | None:
    """The file the program's code is in: ``program`` as a path (relative to ``cwd``), else as a
    module name (``python -m``); ``None`` when neither exists."""
    p = Path(program)
    p = p if p.is_absolute() else cwd / p
    if p.is_file():
        return p
    try:
        spec = importlib.util.find_spec(program)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin and Path(spec.origin).is_file() else None


def program_hash(program: str, command: Sequence[str], cwd: Path) -> str:
    """16 hex digits over the program's source bytes and the command: a changed program or command
    is a new control (and new cached results).

    Raises:
        ConfigError: the program is neither a file nor an importable module.
    """
    src = program_source(program, cwd)
    if src is None:
        raise ConfigError(
            f"program {program!r} is neither a file (relative to {cwd}) nor an importable module"
        )
    h = hashlib.sha256(src.read_bytes())
    h.update(json.dumps([program, list(command)]).encode())
    return h.hexdigest()[:16]


__all__ = ["DEFAULT_COMMAND", "MACROS", "check_command", "expand", "program_source", "program_hash"]
