"""Shared test kit: small models, a quiet Trainer, tracked runs, synthetic run pairs, servers and
readers that several test files use (``from helpers.models import mlp``). ``tests/`` is on pytest's
``pythonpath`` (pyproject.toml); programs the tests start get it through
:func:`helpers.subprocesses.python_env`."""
