"""The argument checks argparse cannot express, shared by the subcommands: each raises
:class:`~fp8track.errors.ConfigError` (``main`` prints it as one line and exits 2) before the
command creates anything."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from fp8track.errors import ConfigError

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

DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql", "oracle")
"""Database schemes (SQLAlchemy dialects) of an MLflow store or an Optuna storage."""


def bound_mlflow_retries() -> None:
    """MLflow retries an unreachable server for about 4 minutes by default; a command that reads or
    writes a store says so sooner. The user's own ``MLFLOW_HTTP_REQUEST_*`` settings win."""
    for name, value in MLFLOW_HTTP_RETRIES.items():
        os.environ.setdefault(name, value)


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


def check_store_uris(args: argparse.Namespace, *options: str) -> None:
    """:func:`check_tracking_uri` on the tracking-URI options among ``options`` (attribute names),
    then :func:`check_database_uri` on all of them."""
    for option in options:
        if option != "storage":
            check_tracking_uri(f"--{option.replace('_', '-')}", getattr(args, option))
    for option in options:
        check_database_uri(f"--{option.replace('_', '-')}", getattr(args, option))


def check_number(option: str, value: float | None, low: float) -> None:
    """Refuse a number option that is NaN, infinite or below ``low``."""
    if value is not None and not (math.isfinite(value) and value >= low):
        raise ConfigError(f"{option} must be a finite number >= {low:g}, got {value!r}")


def check_count(option: str, value: int | None) -> None:
    """Refuse a count option below 1."""
    if value is not None and value < 1:
        raise ConfigError(f"{option} must be an integer >= 1, got {value}")


def check_out_dir(option: str, path: str | None) -> None:
    """Refuse an output folder that exists as something other than a folder (a file)."""
    if path is not None and Path(path).exists() and not Path(path).is_dir():
        raise ConfigError(f"{option} {path!r} exists and is not a folder; give a new or existing folder")


SEED_MAX = 2**32 - 1
"""The largest seed Optuna's samplers take (numpy's ``RandomState``)."""


def check_seed(option: str, value: int | None) -> None:
    """Refuse a sampler seed numpy's ``RandomState`` refuses (outside 0 .. 2**32 - 1)."""
    if value is not None and not 0 <= value <= SEED_MAX:
        raise ConfigError(f"{option} must be an integer from 0 to {SEED_MAX} (2**32 - 1), got {value}")


def check_sqlite_folder(option: str, uri: str | None) -> None:
    """Refuse a ``sqlite:///<path>`` whose folder does not exist (Optuna's storage does not create
    it, and would end in a traceback after the sweep's folder was made)."""
    if uri is None or not uri.lower().startswith("sqlite:"):
        return
    from sqlalchemy.engine import make_url

    path = make_url(uri).database
    if path and path != ":memory:" and not Path(path).parent.is_dir():
        raise ConfigError(
            f"{option} {uri!r}: folder {str(Path(path).parent)!r} does not exist; create it or give "
            "another sqlite:///<path>"
        )
