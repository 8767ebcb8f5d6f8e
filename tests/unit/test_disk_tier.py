"""The prefix cache's disk tier (kv/disk_tier.py, issue #30): blocks written through and read
back whole, a corrupt or truncated file is a miss (and the KV is computed, identical), bounded
LRU, found again after a restart with the same model and not with another, and never a wait on
a full queue."""

from __future__ import annotations

import threading

import pytest
import torch

from pdserve_worker.kv import disk_tier as dt
from pdserve_worker.kv.cache import KVCache
from pdserve_worker.kv.prefix_store import PrefixStore, disk_geometry, kv_bytes_per_token
from pdserve_worker.model.loading.loader import load_model

PAYLOAD = 4096
SCOPE = '["anonymous",""]'


def tier(tmp_path, capacity_blocks: int = 8, geometry: str = "g") -> dt.DiskTier:
    return dt.DiskTier(tmp_path, capacity_blocks * (PAYLOAD + dt._HEADER.size), geometry, PAYLOAD)


def payload(seed: int) -> bytes:
    return bytes((seed * 31 + i) % 251 for i in range(PAYLOAD))


def h(i: int) -> bytes:
    return bytes([i]) * 32


def spill_all(t: dt.DiskTier, ids) -> None:
    for i in ids:
        assert t.spill(h(i), payload(i))
    t.flush()


def test_written_through_and_read_back_whole(tmp_path):
    t = tier(tmp_path)
    spill_all(t, [1, 2])
    assert t.has(h(1)) and not t.has(h(3))
    assert bytes(t.read(h(1))) == bytes(payload(1))
    assert t.read(h(3)) is None
    st = t.stats()
    assert (st.files, st.spilled, st.loaded, st.load_misses, st.corrupt) == (2, 2, 1, 1, 0)
    assert not list(t.folder.glob("*.tmp"))
    t.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "other-hash"])
def test_a_damaged_file_is_a_miss_and_is_deleted(tmp_path, damage):
    t = tier(tmp_path)
    spill_all(t, [1, 2])
    path = t._path(h(1))
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-100] ^= 0x01
    elif damage == "truncate":
        data = data[:-1]
    else:  # a whole, valid file of another block under this block's name
        data = bytearray(t._path(h(2)).read_bytes())
    path.write_bytes(bytes(data))
    assert t.read(h(1)) is None
    assert not path.exists() and not t.has(h(1))
    assert t.stats().corrupt == 1
    assert bytes(t.read(h(2))) == bytes(payload(2))  # the others are untouched
    t.close()


def test_bounded_lru_and_a_read_refreshes(tmp_path):
    t = tier(tmp_path, capacity_blocks=3)
    spill_all(t, [1, 2, 3])
    assert t.read(h(1)) is not None  # 1 is now the most recently used
    spill_all(t, [4, 5])
    assert [t.has(h(i)) for i in (1, 2, 3, 4, 5)] == [True, False, False, True, True]
    st = t.stats()
    assert st.files == 3 and st.bytes <= st.capacity_bytes and st.evictions == 2
    assert len(list(t.folder.glob("*.kv"))) == 3
    t.close()


def test_a_restart_finds_the_blocks_and_another_geometry_does_not(tmp_path):
    t = tier(tmp_path)
    spill_all(t, [1, 2, 3])
    t.close()
    (t.folder / "half-written.tmp").write_bytes(b"x")  # a write the killed process never finished
    again = tier(tmp_path)
    assert again.stats().files == 3 and bytes(again.read(h(2))) == bytes(payload(2))
    assert not list(again.folder.glob("*.tmp"))
    other = tier(tmp_path, geometry="another model")
    assert other.stats().files == 0 and other.read(h(2)) is None
    again.close()
    other.close()


def test_files_are_private_and_another_services_key_reads_none_of_them(tmp_path):
    """#58 A10: the files were 0644 and their digest unkeyed, so any local user could read the
    prompts' KV and another service on a shared path would serve them."""
    folder = tmp_path / "tier"
    t = dt.DiskTier(folder, 8 * (PAYLOAD + dt._HEADER.size), "g", PAYLOAD, key=b"service-a" * 4)
    spill_all(t, [1, 2])
    for made in (folder, t.folder):
        assert made.stat().st_mode & 0o777 == 0o700
    assert {p.stat().st_mode & 0o777 for p in t.folder.glob("*.kv")} == {0o600}
    t.close()
    same = dt.DiskTier(folder, 8 * (PAYLOAD + dt._HEADER.size), "g", PAYLOAD, key=b"service-a" * 4)
    assert bytes(same.read(h(1))) == bytes(payload(1))
    same.close()
    other = dt.DiskTier(folder, 8 * (PAYLOAD + dt._HEADER.size), "g", PAYLOAD, key=b"service-b" * 4)
    assert other.read(h(2)) is None and other.stats().corrupt == 1  # a miss, deleted, never served
    other.close()
    old = t.folder / f"{h(9).hex()}.kv"  # an earlier version's world-readable file
    old.write_bytes(b"x")
    old.chmod(0o644)
    dt.DiskTier(folder, 8 * (PAYLOAD + dt._HEADER.size), "g", PAYLOAD).close()
    assert old.stat().st_mode & 0o777 == 0o600


def test_a_writer_that_is_behind_drops_spills_without_waiting(tmp_path, monkeypatch):
    monkeypatch.setattr(dt, "SPILL_QUEUE_BYTES", 2 * PAYLOAD)  # two copies may wait
    t = tier(tmp_path)
    gate = threading.Event()
    real = t._write

    def slow(block_hash, data):
        gate.wait(10)
        real(block_hash, data)

    t._write = slow
    results = [t.spill(h(i), payload(i)) for i in range(1, 6)]
    assert results == [True, True, False, False, False]  # the bound is in bytes, and nothing waited
    gate.set()
    t.flush()
    assert [t.has(h(i)) for i in range(1, 6)] == [True, True, False, False, False]
    assert t.spill(h(3), payload(3))  # room again once written
    t.flush()
    st = t.stats()
    assert (st.spill_dropped, st.spilled, t._queued_bytes) == (3, 3, 0)
    t.close()


# ---- the store in front of it: identical KV from RAM, disk or computation -------------------------
@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir), dtype="float32")


def store_with_disk(tiny, folder, ram_blocks: int) -> PrefixStore:
    layout = tiny.config.kv_layout(1, 256, "float32")
    disk = dt.DiskTier(folder, 1 << 26, disk_geometry(layout, 16, "rev"), 16 * kv_bytes_per_token(layout))
    return PrefixStore(layout, ram_blocks, 16, "rev", disk=disk)


def serve(tiny, store: PrefixStore, prompt: list[int], corrupt: bool = False) -> tuple[int, int, torch.Tensor]:
    cache = KVCache.allocate(store.layout)
    if corrupt and store.disk is not None:  # every file: a bad disk
        for path in sorted(store.disk.folder.glob("*.kv")):
            data = bytearray(path.read_bytes())
            data[-1] ^= 0xFF
            path.write_bytes(bytes(data))
    prefetched = store.prefetch(prompt, SCOPE)
    use = store.begin(prompt, cache, 0, SCOPE, prefetched)
    try:
        logits = tiny.model.prefill(prompt, cache, 0, start=use.cached_tokens)
        store.finish(use, cache, 0)
    finally:
        store.end(use)
    return use.cached_tokens, use.disk_tokens, logits


@torch.inference_mode()
def test_a_working_set_larger_than_ram_comes_back_from_disk_identical(tiny, tmp_path):
    prompts = [[(p * 97 + i) % 500 + 3 for i in range(65)] for p in range(4)]  # 4 blocks each, 16 in all
    reference = [tiny.model.prefill(p, KVCache.allocate(tiny.config.kv_layout(1, 256, "float32")), 0) for p in prompts]
    store = store_with_disk(tiny, tmp_path, ram_blocks=4)  # a quarter of the working set
    for p in prompts:
        assert serve(tiny, store, p)[0] == 0
    store.disk.flush()
    second = [serve(tiny, store, p) for p in prompts]
    for (cached, from_disk, logits), ref in zip(second, reference):
        assert cached == 64 and from_disk > 0
        assert torch.allclose(logits, ref, atol=1e-5)
    stats = store.tier_stats()
    assert stats.disk_hit_blocks >= 12 and stats.disk.loaded >= 12
    store.close()

    # A restart: a new store over the same folder finds the blocks on its first pass.
    restarted = store_with_disk(tiny, tmp_path, ram_blocks=4)
    cached, from_disk, logits = serve(tiny, restarted, prompts[0])
    assert cached == from_disk == 64 and torch.allclose(logits, reference[0], atol=1e-5)
    # Corrupted on disk: detected, computed, the same answer.
    cached, from_disk, logits = serve(tiny, restarted, prompts[1], corrupt=True)
    assert from_disk == 0 and restarted.disk.stats().corrupt >= 1
    assert torch.allclose(logits, reference[1], atol=1e-5)
    restarted.close()
