"""``fp8track diagnose FP8_RUN --control BF16_RUN [--out DIR] [--tracking-uri URI]``: the
diagnosis of :func:`fp8track.report.run.diagnose_runs`, printed, with ``diagnosis.json`` and
``report.html`` in ``--out``."""

from __future__ import annotations

import argparse
from typing import Any

from fp8track.cli.checks import bound_mlflow_retries, check_out_dir, check_store_uris


def add_parser(sub: Any) -> argparse.ArgumentParser:
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
    return p


def check(args: argparse.Namespace) -> None:
    check_store_uris(args, "tracking_uri")
    check_out_dir("--out", args.out)


def run(args: argparse.Namespace) -> int:
    from fp8track.analysis.pairing import run_label
    from fp8track.report.console import print_diagnosis
    from fp8track.report.html import describe_problems
    from fp8track.report.run import diagnose_runs

    bound_mlflow_retries()
    # Unusable input raises ConfigError: main() prints it as one line and exits 2.
    res = diagnose_runs(args.fp8_run, args.control, args.out, tracking_uri=args.tracking_uri)
    print_diagnosis(res.diagnosis, res.html_path, runs=(run_label(res.fp8), run_label(res.control)))
    for what, run_ in (("FP8 run", res.fp8), ("control", res.control)):
        if run_.problems:
            print(f"damaged records in the {what} {run_.source}: {describe_problems(run_.problems)}")
    print(f"diagnosis.json: {res.json_path}")
    for where in res.logged:
        print(f"logged: {where}")
    return 0
