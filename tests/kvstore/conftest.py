"""Fixtures for the KV store tests: a fake clock (redis_server comes from tests/conftest.py)."""
from __future__ import annotations

import pytest

from .kvstore_helpers import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
