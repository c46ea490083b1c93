"""Fixtures shared by the POC modules (each module defines its own module-scoped ``fed`` federation)."""

import pytest


@pytest.fixture()
def sess(fed):
    """An admin Session to the module's federation, closed after the test."""
    s = fed.session()
    yield s
    s.close()
