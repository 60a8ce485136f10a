"""Fixtures for the compaction tests (the fakes live in compaction_fakes.py)."""

from __future__ import annotations

import pytest
from compaction_fakes import FakeClock, FakeSummarizer


@pytest.fixture
def fake() -> FakeSummarizer:
    return FakeSummarizer()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
