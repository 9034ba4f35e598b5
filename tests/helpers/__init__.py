"""Shared test kit: small models and set-ups that several test files use (import as ``helpers.<module>``;
``tests/`` is on ``sys.path`` through its ``conftest.py``)."""
