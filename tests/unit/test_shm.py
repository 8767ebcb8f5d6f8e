"""Shared-memory segments: two mappings are one memory; orphans of dead owners are reaped."""

from __future__ import annotations

import ctypes
import os
import secrets

import pytest

from pdserve_worker.transfer.backends.host import shm
from pdserve_worker.transfer.backends.host.shm import NAME_PREFIX, SHM_DIR, ShmSegment, reap_orphans


def test_an_attached_mapping_sees_the_owners_writes() -> None:
    owner = ShmSegment.create(8192)
    peer = ShmSegment.attach(owner.name, 8192)
    try:
        assert peer.addr != owner.addr
        ctypes.memmove(owner.addr + 4000, b"kv-bytes", 8)
        assert ctypes.string_at(peer.addr + 4000, 8) == b"kv-bytes"
        peer.bytes[0:3] = b"abc"
        assert ctypes.string_at(owner.addr, 3) == b"abc"
        with pytest.raises(ValueError, match="announced 4096"):
            ShmSegment.attach(owner.name, 4096)
        with pytest.raises(ValueError, match="not a pdserve"):
            ShmSegment.attach("../etc/passwd", 8192)
    finally:
        peer.close()
        owner.close()
    assert not os.path.exists(os.path.join(SHM_DIR, owner.name))
    with pytest.raises(FileNotFoundError):
        ShmSegment.attach(owner.name, 8192)


def test_orphans_are_reaped_and_live_segments_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm, "ORPHAN_MIN_AGE_S", 0.0)
    live = ShmSegment.create(4096)
    orphan = f"{NAME_PREFIX}0-{secrets.token_hex(8)}"  # as a SIGKILLed owner leaves it: no lock
    fd = os.open(os.path.join(SHM_DIR, orphan), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    try:
        reaped = reap_orphans()
        assert orphan in reaped and live.name not in reaped
        assert not os.path.exists(os.path.join(SHM_DIR, orphan))
        assert os.path.exists(os.path.join(SHM_DIR, live.name))
    finally:
        live.close()
