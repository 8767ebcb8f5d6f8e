"""Block events (kv/block_events.py) and the router's index of them (router/kv_index.py), issue
#30 item 4: the prefix cache reports what it stores and evicts, per tier; a router that follows
the stream knows what each prefill holds, resets on a restart or a gap, and stays bounded."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve_worker.kv.block_events import BlockEventLog, runs
from pdserve_worker.kv.prefix_cache import PrefixCache, PrefixLease, block_hashes, cache_salt, scoped_salt
from pdserve_worker.router.kv_index import ReportedIndex

SCOPE = '["a",""]'
SALT = cache_salt("rev", "float32", 4)


@dataclass
class Run:
    stored: bool
    disk: bool
    block_hashes: list[bytes]


@dataclass
class Reply:
    epoch: str
    last_seq: int
    reset: bool
    runs: list[Run] = field(default_factory=list)
    salt: bytes = SALT
    block_tokens: int = 4
    enabled: bool = True


def reply_of(log: BlockEventLog, epoch: str, after: int, limit: int = 8192) -> Reply:
    batch = log.since(epoch, after, limit)
    return Reply(batch.epoch, batch.last_seq, batch.reset, [Run(*r) for r in runs(batch.events)])


def fill(cache: PrefixCache, hashes: list[bytes]) -> None:
    lease = PrefixLease()
    cache.reserve_fills(lease, hashes)
    cache.publish(lease)
    cache.release(lease)


def test_the_cache_reports_what_it_stores_and_evicts():
    cache = PrefixCache(num_blocks=3, block_tokens=4)
    log = BlockEventLog(lambda: [(False, h) for h in cache.held()])
    cache.events = log
    hashes = block_hashes(list(range(20)), 4, scoped_salt(SALT, SCOPE))  # 5 blocks
    fill(cache, hashes[:3])
    fill(cache, hashes[3:5])  # two evictions (LRU: the first chain's tail first)
    batch = log.since(log.epoch, 0)
    assert not batch.reset and batch.last_seq == 7
    kinds = [(e.stored, e.block_hash) for e in batch.events]
    assert kinds[:3] == [(True, h) for h in hashes[:3]]
    assert sorted(h for stored, h in kinds[3:] if not stored) == sorted(hashes[1:3])
    assert runs(batch.events)[0] == (True, False, hashes[:3])


def test_another_epoch_or_a_gap_gets_a_snapshot():
    held = [(False, b"r" * 32), (True, b"d" * 32)]
    log = BlockEventLog(lambda: held, capacity=4)
    log.record(True, False, [bytes([i]) * 32 for i in range(10)])  # 10 events, 4 kept
    assert log.since("other-epoch", 0).reset
    assert log.since(log.epoch, 2).reset  # events 3..6 are gone
    assert not log.since(log.epoch, 6).reset  # 7..10 are kept
    snap = log.since("", 0)
    assert snap.reset and snap.last_seq == 10 and [(e.disk, e.block_hash) for e in snap.events] == held
    paged = log.since(log.epoch, 6, limit=3)
    assert [e.seq for e in paged.events] == [7, 8, 9] and paged.last_seq == 9
    assert log.since(log.epoch, 10).events == []  # nothing new


def test_the_index_follows_stores_removals_and_resets():
    log = BlockEventLog(lambda: [])
    index = ReportedIndex()
    tokens = list(range(16))  # 4 blocks of 4
    chain = block_hashes(tokens, 4, scoped_salt(SALT, SCOPE))
    log.record(True, False, chain[:3])
    log.record(True, True, chain[3:])  # the last block only on disk
    index.apply("p0", reply_of(log, *index.cursor("p0")))  # first call: "" epoch, a snapshot
    assert index.matched_tokens(["p0", "p1"], tokens + [99], SCOPE) == {"p0": 0}  # snapshot of []
    index.apply("p0", reply_of(log, *index.cursor("p0")))  # a reset is the snapshot only
    log.record(True, False, chain[:3])
    index.apply("p0", reply_of(log, *index.cursor("p0")))
    assert index.matched_tokens(["p0"], tokens, SCOPE) == {"p0": 12}
    log.record(True, True, chain[3:])
    index.apply("p0", reply_of(log, *index.cursor("p0")))
    assert index.matched_tokens(["p0"], tokens, SCOPE) == {"p0": 16}  # the disk tier counts
    assert index.matched_tokens(["p0"], tokens, '["b",""]') == {"p0": 0}  # another tenant's scope
    log.record(False, False, [chain[1]])  # evicted from RAM: the chain breaks there
    index.apply("p0", reply_of(log, *index.cursor("p0")))
    assert index.matched_tokens(["p0"], tokens, SCOPE) == {"p0": 4}
    restarted = BlockEventLog(lambda: [(True, h) for h in chain])  # a new epoch: all on disk
    index.apply("p0", reply_of(restarted, *index.cursor("p0")))
    assert index.matched_tokens(["p0"], tokens, SCOPE) == {"p0": 16}
    index.forget("p0")
    assert not index.knows("p0") and index.matched_tokens(["p0"], tokens, SCOPE) == {}


def test_a_prefill_cannot_grow_a_router_without_bound():
    index = ReportedIndex(max_hashes=5)
    index.apply("p0", Reply("e", 1, True, [Run(True, False, [bytes([i]) * 32 for i in range(9)])]))
    assert index.size("p0") == 5
    index.apply("p0", Reply("e", 2, False, [Run(True, True, [b"x" * 32])]))
    assert index.size("p0") == 5
    index.apply("p0", Reply("e", 3, False, enabled=False))  # its cache is off: nothing is held
    assert not index.knows("p0")


def test_a_prediction_stands_until_the_members_events_say_otherwise():
    """router/kv_index.py `predict`: a decode that served a prompt is taken to hold its blocks
    before its events come (the next turn may come first); a removal or a reset corrects it, and
    a member that never reported gets no prediction."""
    log = BlockEventLog(lambda: [])
    index = ReportedIndex()
    tokens = list(range(10))  # 2 whole blocks of 4
    index.predict("d0", tokens, SCOPE)
    assert index.matched_tokens(["d0"], tokens, SCOPE) == {}  # never reported: nothing to go by
    index.apply("d0", reply_of(log, *index.cursor("d0")))
    index.predict("d0", tokens, SCOPE)
    assert index.matched_tokens(["d0"], tokens, SCOPE) == {"d0": 8}
    assert index.matched_tokens(["d0"], tokens, '["b",""]') == {"d0": 0}  # in its scope only
    log.record(False, False, block_hashes(tokens, 4, scoped_salt(SALT, SCOPE))[:1])  # evicted
    index.apply("d0", reply_of(log, *index.cursor("d0")))
    assert index.matched_tokens(["d0"], tokens, SCOPE) == {"d0": 0}


def test_an_unconfirmed_prediction_lapses(monkeypatch):
    from pdserve_worker.router import kv_index

    now = [100.0]
    monkeypatch.setattr(kv_index.time, "monotonic", lambda: now[0])
    index = ReportedIndex()
    index.apply("d0", reply_of(BlockEventLog(lambda: []), "", 0))
    tokens = list(range(8))
    index.predict("d0", tokens, SCOPE)
    assert index.matched_tokens(["d0"], tokens, SCOPE) == {"d0": 8}
    now[0] += kv_index.PREDICT_S + 0.1  # the decode never said it holds them
    assert index.matched_tokens(["d0"], tokens, SCOPE) == {"d0": 0}
