"""``fp8track integrations [--copy DIR] [--force]``: list the files fp8track hands to other tools
(the top-level ``integrations/`` folder), or copy them into a folder."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

from fp8track.cli.checks import check_out_dir


def integrations_root() -> Path:
    """The ``integrations/`` folder: inside the installed package (a wheel build copies it to
    ``fp8track/integrations``, see setup.py), else the source checkout's top-level folder."""
    package = Path(__file__).resolve().parents[1]
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


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "integrations",
        description="List the files fp8track hands to other tools (LightningCLI "
        "config, TE debug API YAML, W&B sweep YAML), or copy them into a folder.",
    )
    p.add_argument(
        "--copy", metavar="DIR", default=None, help="copy every file into DIR, keeping its folders"
    )
    p.add_argument("--force", action="store_true", help="overwrite files that exist in DIR")
    return p


def check(args: argparse.Namespace) -> None:
    check_out_dir("--copy", args.copy)


def run(args: argparse.Namespace) -> int:
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
