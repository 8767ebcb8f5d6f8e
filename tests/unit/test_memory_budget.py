"""The prefix cache's default size (kv/memory_budget.py, issue #30): a quarter of the memory the
process counts as its own, read from its cgroup (else MemTotal), never more than what is left
after what it already holds; an explicit size wins and 0 turns the cache off."""

from __future__ import annotations

import logging

import pytest

from pdserve_worker.kv import memory_budget as mb
from pdserve_worker.kv.prefix_store import PrefixStoreConfig, kv_bytes_per_token, open_prefix_store
from pdserve_worker.model.config import ModelConfig

GiB = 1 << 30


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_limit_is_the_cgroups_else_memtotal(tmp_path):
    meminfo = write(tmp_path, "meminfo", "MemTotal:       24683664 kB\nMemFree: 1 kB\n")
    missing = tmp_path / "absent"
    v2 = write(tmp_path, "memory.max", "8589934592\n")
    v1 = write(tmp_path, "limit_in_bytes", "4294967296\n")
    assert mb.memory_limit(v2, v1, meminfo) == mb.MemoryLimit(8 * GiB, "cgroup v2")
    assert mb.memory_limit(write(tmp_path, "v2max", "max\n"), v1, meminfo) == mb.MemoryLimit(4 * GiB, "cgroup v1")
    unlimited_v1 = write(tmp_path, "v1big", "9223372036854771712\n")
    assert mb.memory_limit(missing, unlimited_v1, meminfo) == mb.MemoryLimit(24683664 * 1024, "MemTotal")


def test_a_quarter_of_the_share_in_whole_blocks():
    tokens = mb.auto_prefix_tokens(16 * GiB, 0.5, kv_bytes_per_token=46080, block_tokens=16)
    assert tokens == int(16 * GiB * 0.5 * 0.25 // 46080) // 16 * 16
    assert tokens % 16 == 0 and tokens > 0


def test_what_the_process_holds_caps_the_cache_and_can_leave_none():
    own = 8 * GiB
    # Holding 5 GiB of 8: 0.9 x 8 - 5 = 2.2 GiB left, which is more than the quarter (2 GiB).
    assert mb.auto_prefix_tokens(own, 1.0, 1024, 16, resident=5 * GiB) == 2 * GiB // 1024
    # Holding 6.5 GiB: only 0.7 GiB may be spared.
    assert mb.auto_prefix_tokens(own, 1.0, 1024, 16, resident=int(6.5 * GiB)) == int(0.7 * GiB) // 1024 // 16 * 16
    assert mb.auto_prefix_tokens(own, 1.0, 1024, 16, resident=8 * GiB) == 0


def test_the_bookkeeping_cap_and_bad_inputs():
    assert mb.auto_prefix_tokens(1 << 50, 1.0, 1, 16) == mb.MAX_AUTO_TOKENS
    with pytest.raises(ValueError, match="memory share"):
        mb.auto_prefix_tokens(GiB, 0.0, 1024, 16)
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        mb.auto_prefix_tokens(GiB, 1.0, 0, 16)


def test_open_prefix_store_auto_explicit_and_off(tiny_model_dir, caplog):
    import json

    config = ModelConfig.from_hf(json.loads((tiny_model_dir / "config.json").read_text()))
    layout = config.kv_layout(1, 64, "float32")
    per_token = kv_bytes_per_token(layout)
    assert per_token == config.kv_bytes_per_token("float32")
    with caplog.at_level(logging.INFO, logger="pdserve_worker.kv.prefix_store"):
        auto = open_prefix_store(layout, PrefixStoreConfig(None, 0.25, 16, "rev"))
        assert auto is not None
        expected = mb.prefix_budget(None, 0.25, per_token, 16)
        # The resident set moves a little between the two readings; the quarter-share bound does not.
        assert auto.cache.num_blocks * 16 <= mb.auto_prefix_tokens(mb.memory_limit().bytes, 0.25, per_token, 16)
        assert abs(auto.cache.num_blocks * 16 - expected.tokens) <= 16 * 64
        set_ = open_prefix_store(layout, PrefixStoreConfig(40, 1.0, 16, "rev"))
        assert set_ is not None and set_.cache.num_blocks == 2
        assert open_prefix_store(layout, PrefixStoreConfig(0, 1.0, 16, "rev")) is None
    lines = [r.getMessage() for r in caplog.records]
    assert any("event=prefix_cache " in m and "mode=auto" in m and "limit_source=" in m for m in lines), lines
    assert any("event=prefix_cache_off" in m for m in lines), lines


def test_a_decode_pool_is_what_its_slots_use_capped_by_its_memory():
    # 8 slots x 2,048 tokens of 46 KB: 754 MB, well within half of 8 GiB: unchanged.
    assert mb.auto_kv_tokens(8 * 2048, 8 * GiB, 1.0, 46080, 16) == 8 * 2048
    # The same in a 1 GiB pod: capped to half of it, whole blocks.
    capped = mb.auto_kv_tokens(8 * 2048, GiB, 1.0, 46080, 16)
    assert capped == int(GiB * 0.5 // 46080) // 16 * 16 and capped < 8 * 2048
    # Holding 0.85 GiB of 1: only 0.05 GiB may be spared; nothing at all still leaves one block.
    assert (
        mb.auto_kv_tokens(8 * 2048, GiB, 1.0, 46080, 16, resident=int(0.85 * GiB))
        == int(0.05 * GiB) // 46080 // 16 * 16
    )
    assert mb.auto_kv_tokens(8 * 2048, GiB, 1.0, 46080, 16, resident=GiB) == 16


def test_the_decode_sizes_its_pool_when_kv_tokens_is_unset(tiny_model_dir, monkeypatch, caplog):
    import json

    from pdserve_worker.decode import worker as dw
    from support.worker_env import worker_settings

    config = ModelConfig.from_hf(json.loads((tiny_model_dir / "config.json").read_text()))
    full = config.kv_layout(4, 256, "float32")
    settings = worker_settings({"PDSERVE_ROLE": "decode", "PDSERVE_BROKER_ADDRESS": "b:1", "PDSERVE_BROKER_TOKEN": "t"})
    settings = settings.model_copy(update={"slots": 4, "max_length": 256, "model_dtype": "float32"})
    with caplog.at_level(logging.INFO, logger="pdserve_worker.decode.worker"):
        assert dw.pool_tokens(settings, full) == 4 * 256  # plenty of memory: the slots' tokens
    assert any("event=kv_pool_size" in r.getMessage() and "mode=auto" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(mb, "memory_limit", lambda: mb.MemoryLimit(mb.resident_bytes() + 64 * 1024, "test"))
    with caplog.at_level(logging.INFO, logger="pdserve_worker.decode.worker"):
        small = dw.pool_tokens(settings, full)
    assert 16 <= small < 4 * 256 and small % 16 == 0
    assert any("event=kv_pool_capped_by_memory" in r.getMessage() for r in caplog.records)


def test_an_explicit_size_needs_no_memory_reading(monkeypatch):
    def unreadable():
        raise RuntimeError("no MemTotal line")

    monkeypatch.setattr(mb, "memory_limit", unreadable)
    assert mb.prefix_budget(64, 1.0, 1024, 16).tokens == 64
    with pytest.raises(RuntimeError, match="MemTotal"):
        mb.prefix_budget(None, 1.0, 1024, 16)
