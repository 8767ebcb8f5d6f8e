"""The prefix cache's second tier: blocks on local disk, bounded, LRU, checked, kept across restarts.

One file per published block, named by its chained hash (which carries revision, dtype, block
size and tenant scope), under a subfolder keyed by the KV geometry: a restart with the same
model finds its blocks, one with another model finds none.
- Written through, off the compute thread: `spill` takes a copy (never a pin on the RAM
  block); a writer thread writes a temporary file and renames it. The queue is bounded in
  bytes: a spill past it is dropped and counted, never waited for.
- Read off the compute thread: blocks the index lists are loaded from `prefetch` on; a block
  it does not list costs no I/O, so a miss never waits on the disk.
- Never wrong KV: a header with the hash and a BLAKE2b digest keyed with `disk_key`; a file
  whose length, hash or digest does not match is a miss, counted and deleted. Files are 0600
  in 0700 folders.
- Bounded: `capacity_bytes`, least recently used files deleted past it; index rebuilt at start.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from pdserve_common.logs import kv
from pdserve_worker.kv.block_events import BlockEventLog

log = logging.getLogger(__name__)

MAGIC = b"PDSVKVB1"
_HEADER = struct.Struct("<8sQ32s32s")  # magic, payload bytes, block hash, digest(hash || payload)
SPILL_QUEUE_BYTES = 256 << 20  # block copies waiting for the writer; past this, spills are dropped


FILE_MODE, FOLDER_MODE = 0o600, 0o700  # the prompts' KV: readable by the worker's user only


def digest(block_hash: bytes, payload: bytes | memoryview, key: bytes = b"") -> bytes:
    """BLAKE2b of hash and payload, keyed with the service's disk key (`disk_key`): a file
    another service wrote (a shared host path) or one forged without the key is a miss."""
    h = hashlib.blake2b(digest_size=32, key=key)
    h.update(block_hash)
    h.update(payload)
    return h.digest()


@dataclass(frozen=True)
class DiskTierStats:
    files: int
    bytes: int
    capacity_bytes: int
    spilled: int
    spill_dropped: int
    loaded: int
    load_misses: int
    corrupt: int
    evictions: int
    spill_seconds: float  # total time the writer spent writing
    load_seconds: float  # total time the loader spent reading


class DiskTier:
    """One folder of block files; thread-safe. `payload_bytes` is one block's size."""

    def __init__(self, folder: Path, capacity_bytes: int, geometry: str, payload_bytes: int, key: bytes = b"") -> None:
        if capacity_bytes < payload_bytes + _HEADER.size:
            raise ValueError(f"disk tier of {capacity_bytes} bytes cannot hold one block of {payload_bytes} bytes")
        if len(key) > 64:
            raise ValueError(f"a BLAKE2b key is at most 64 bytes, got {len(key)}")
        self.key = key
        self.folder = Path(folder) / hashlib.sha256(geometry.encode()).hexdigest()[:16]
        for made in (Path(folder), self.folder):  # (mkdir's mode is masked by the umask: chmod says it exactly)
            made.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
            os.chmod(made, FOLDER_MODE)
        self.capacity_bytes = capacity_bytes
        self.payload_bytes = payload_bytes
        self._lock = threading.Lock()
        self._lru: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes, least recently used first
        self._bytes = 0
        self._counts = dict.fromkeys(("spilled", "spill_dropped", "loaded", "load_misses", "corrupt", "evictions"), 0)
        self._seconds = {"spill": 0.0, "load": 0.0}
        self.events: BlockEventLog | None = None  # told of every file written or deleted, if set
        self._queue: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue()
        self._queued_bytes = 0  # of the copies in the queue: bounded by SPILL_QUEUE_BYTES
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="prefix-disk-writer", daemon=True)
        self._writer.start()

    # ---- what the store calls --------------------------------------------------------------------
    def has(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._lru

    def spill(self, block_hash: bytes, payload: bytes) -> bool:
        """Queue `payload` (a copy of the block's bytes) to be written. False when it was dropped
        because the writer is SPILL_QUEUE_BYTES behind (never blocks)."""
        with self._lock:
            if block_hash in self._lru:
                return True
            if self._queued_bytes + len(payload) > SPILL_QUEUE_BYTES:
                self._counts["spill_dropped"] += 1
                return False
            self._queued_bytes += len(payload)
        self._queue.put((block_hash, payload))
        return True

    def read(self, block_hash: bytes) -> memoryview | None:
        """The block's bytes (writable) if its file is whole and checks out, else None (a miss:
        recompute)."""
        started = time.perf_counter()
        path = self._path(block_hash)
        data = bytearray(_HEADER.size + self.payload_bytes)
        try:
            with open(path, "rb") as f:
                got = f.readinto(data)
                if f.read(1):  # longer than a block: not ours
                    got = -1
        except OSError:
            got = 0
        payload = self._check(block_hash, data) if got == len(data) else None
        with self._lock:
            self._seconds["load"] += time.perf_counter() - started
            if payload is None:
                self._counts["load_misses" if not got else "corrupt"] += 1
                size = self._lru.pop(block_hash, None)
                if size is not None:
                    self._bytes -= size
                    if self.events is not None:
                        self.events.record(False, True, [block_hash])
            else:
                self._counts["loaded"] += 1
                if block_hash in self._lru:
                    self._lru.move_to_end(block_hash)
        if payload is None and got:
            log.warning(kv(event="prefix_disk_corrupt", block=block_hash.hex()[:16], read=got))
            path.unlink(missing_ok=True)
        return payload

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every queued spill is written (tests, and a graceful stop)."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._writer.join(timeout=10)

    def held(self) -> list[bytes]:
        """Every block on disk now (a snapshot for kv/block_events.py)."""
        with self._lock:
            return list(self._lru)

    def stats(self) -> DiskTierStats:
        with self._lock:
            c = self._counts
            return DiskTierStats(
                len(self._lru),
                self._bytes,
                self.capacity_bytes,
                c["spilled"],
                c["spill_dropped"],
                c["loaded"],
                c["load_misses"],
                c["corrupt"],
                c["evictions"],
                self._seconds["spill"],
                self._seconds["load"],
            )

    # ---- internals -------------------------------------------------------------------------------
    def _path(self, block_hash: bytes) -> Path:
        return self.folder / f"{block_hash.hex()}.kv"

    def _check(self, block_hash: bytes, data: bytearray) -> memoryview | None:
        magic, size, stored_hash, stored_digest = _HEADER.unpack_from(data)
        payload = memoryview(data)[_HEADER.size :]
        if magic != MAGIC or size != self.payload_bytes or stored_hash != block_hash:
            return None
        if digest(block_hash, payload, self.key) != stored_digest:
            return None
        return payload

    def _scan(self) -> None:
        """Rebuild the index from the folder: oldest modification first (the LRU's head)."""
        found = []
        for path in self.folder.glob("*.kv"):
            try:
                block_hash = bytes.fromhex(path.stem)
                stat = path.stat()
                if stat.st_mode & 0o777 != FILE_MODE:  # an earlier version's 0644 file
                    os.chmod(path, FILE_MODE)
            except (ValueError, OSError):
                continue
            found.append((stat.st_mtime_ns, block_hash, stat.st_size))
        for path in self.folder.glob("*.tmp"):  # a write the last process did not finish
            path.unlink(missing_ok=True)
        for _, block_hash, size in sorted(found):
            self._lru[block_hash] = size
            self._bytes += size
        self._evict()
        if found:
            log.info(kv(event="prefix_disk_found", folder=str(self.folder), files=len(self._lru), bytes=self._bytes))

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            block_hash, payload = item
            try:
                self._write(block_hash, payload)
            except OSError as exc:
                log.warning(kv(event="prefix_disk_write_failed", block=block_hash.hex()[:16], error=str(exc)))
            finally:
                with self._lock:
                    self._queued_bytes -= len(payload)
                self._queue.task_done()

    def _write(self, block_hash: bytes, payload: bytes) -> None:
        started = time.perf_counter()
        header = _HEADER.pack(MAGIC, len(payload), block_hash, digest(block_hash, payload, self.key))
        path = self._path(block_hash)
        tmp = path.with_suffix(".tmp")
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE), "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, path)
        size = _HEADER.size + len(payload)
        with self._lock:
            self._seconds["spill"] += time.perf_counter() - started
            self._counts["spilled"] += 1
            old = self._lru.pop(block_hash, None)
            self._bytes += size - (old or 0)
            self._lru[block_hash] = size
            if self.events is not None and old is None:
                self.events.record(True, True, [block_hash])
            self._evict()

    def _evict(self) -> None:
        """Delete least recently used files past the capacity (lock held)."""
        while self._bytes > self.capacity_bytes and self._lru:
            block_hash, size = self._lru.popitem(last=False)
            self._bytes -= size
            self._counts["evictions"] += 1
            self._path(block_hash).unlink(missing_ok=True)
            if self.events is not None:
                self.events.record(False, True, [block_hash])
