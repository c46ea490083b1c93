"""The simulator runs' fixtures live in tests/conftest.py: the runs start at the session's first test, before the POC and
unit tests that run while they go on (see that file)."""
