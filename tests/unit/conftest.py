"""Fixtures the unit tests share (tests/conftest.py has those of every test)."""

from __future__ import annotations

import fakeredis
import pytest

from llmgw.state.store import Store


@pytest.fixture
def store() -> Store:
    """The one persistence seam over a fakeredis of this test's own."""
    return Store(fakeredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True))
