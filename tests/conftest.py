"""Shared fixtures: free loopback ports and process hygiene for tests that start servers."""

from __future__ import annotations

import pytest

from netutil import free_port


@pytest.fixture
def port() -> int:
    return free_port()
