"""Loopback helpers for tests that start servers (importable by name: several conftest.py exist)."""

from __future__ import annotations

from pdserve_worker.util.free_ports import free_port

__all__ = ["free_port"]
