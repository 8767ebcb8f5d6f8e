"""KV integrity: every pushed layer chunk carries a digest, which the decode checks before first use.

The pusher (push.py) hashes, per target, the bytes each layer chunk puts there, in the order its
descriptors take them, as one running digest snapshotted at every chunk's end (`ChunkDigests`);
the ready notify carries them as `kv_digest` ({"alg", "heads", "first", "ends", "sums"}; the last
snapshot only where 1,024 characters would not hold them all). The decode (`ReadyDigests`, called
by readiness.py before the message makes the request decodable) hashes what landed, enumerated by
`push_runs` (the rule the push was cut by), and compares at every end: `KVDigestMismatch` names
the layers (Generate answers DATA_LOSS; the router runs the request again). A ready without the
field while digests are on is refused by name (`KVDigestRefused`). A digest covers what the
notifying pusher put: a tensor-parallel prefill's other ranks, and a group migration's other
members, push bytes none covers. A backend declares the digest its memory allows: XXH3-64 over
host memory (host engines), FLETCHER64 computed on the pool's device (HIXL: device_digest.py).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import xxhash

from pdserve_common.kv_layout import BlockLayout, K, KVLayout, PushRoute, Strided, V, push_runs
from pdserve_worker.kv.slots import Grant
from pdserve_worker.transfer.base import FLETCHER64, XXH3_64

DIGEST_FIELD = "kv_digest"  # the ready message's key
ALGORITHMS = (XXH3_64, FLETCHER64)


class RunningDigest(Protocol):
    """A running digest of byte ranges fed by address (`HostDigest`, device_digest's `TensorDigest`)."""

    bytes: int

    def update(self, addr: int, copies: int, step: int, length: int) -> None: ...

    def intdigest(self) -> int: ...


class KVIntegrityError(RuntimeError):
    """A ready message's KV cannot be trusted: `reason` is "mismatch" or "refused"."""

    reason = "refused"


class KVDigestRefused(KVIntegrityError):
    """The ready message lacks the digest this decode requires, or carries one it cannot read."""


class KVDigestMismatch(KVIntegrityError):
    """The bytes that landed are not the bytes the prefill hashed."""

    reason = "mismatch"


class HostDigest:
    """A running XXH3-64 over host memory, fed by address: ranges that continue one another are
    hashed as one (no copy, one call: a prefill's slot rows are one range per layer's K or V,
    however many blocks they land in); a head slice's pieces are gathered once."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()
        self.bytes = 0
        self._addr = self._len = 0  # a contiguous range not yet hashed

    def update(self, addr: int, copies: int, step: int, length: int) -> None:
        """Feed `copies` ranges of `length` bytes, the i-th at `addr + i * step`."""
        n = length * copies
        self.bytes += n
        if copies == 1 or step == length:
            if self._len and addr == self._addr + self._len:
                self._len += n
                return
            self._flush()
            self._addr, self._len = addr, n
            return
        self._flush()
        span = (copies - 1) * step + length
        raw = np.ctypeslib.as_array((ctypes.c_ubyte * span).from_address(addr))
        rows = np.lib.stride_tricks.as_strided(raw, (copies, length), (step, 1))
        self._h.update(np.ascontiguousarray(rows).data)

    def _flush(self) -> None:
        if self._len:
            self._h.update((ctypes.c_char * self._len).from_address(self._addr))
            self._len = 0

    def intdigest(self) -> int:
        self._flush()
        return int(self._h.intdigest())


def new_digest(algorithm: str) -> RunningDigest:
    if algorithm == XXH3_64:
        return HostDigest()
    if algorithm == FLETCHER64:
        from pdserve_worker.transfer.device_digest import TensorDigest  # (imports torch)

        return TensorDigest()
    raise ValueError(f"KV digest algorithm must be one of {ALGORITHMS}, got {algorithm!r}")


@dataclass
class ChunkDigests:
    """The pusher's side for one target: the running digest at the end of every layer chunk."""

    algorithm: str
    heads: range  # the KV heads this push writes into the target
    ends: list[int]
    sums: list[int]
    _digest: RunningDigest
    first: int = 0  # the first layer hashed

    @classmethod
    def of(cls, algorithm: str | None, heads: range) -> ChunkDigests | None:
        """A push's digests of `heads` into one target; None where the backend declares none."""
        return None if algorithm is None else cls(algorithm, heads, [], [], new_digest(algorithm))

    def add(self, layers: Sequence[int], pieces: Mapping[tuple[int, int], Sequence[Sequence[Strided]]]) -> None:
        """Hash the source bytes of `layers` (consecutive, after the last chunk) as they are put."""
        self.first = layers[0] if not self.ends else self.first
        if self.ends and layers[0] != self.ends[-1]:
            raise ValueError(f"KV digests need layer chunks in order: layer {layers[0]} after {self.ends[-1]}")
        for layer in layers:
            for kv_index in (K, V):
                for run in pieces[(layer, kv_index)]:
                    for r in run:
                        self._digest.update(r.src, r.copies, r.src_step, r.length)
        self.ends.append(layers[-1] + 1)
        self.sums.append(self._digest.intdigest())

    def field(self, compact: bool = False) -> dict[str, Any]:
        """The ready message's `kv_digest`; compact: the last snapshot only (it covers every byte).
        No chunk (a notify for layers others pushed: a group's migration): empty ends and sums."""
        ends, sums = (self.ends[-1:], self.sums[-1:]) if compact else (self.ends, self.sums)
        return {
            "alg": self.algorithm,
            "heads": [self.heads.start, self.heads.stop],
            "first": self.first,
            "ends": ends,
            "sums": [f"{s:016x}" for s in sums],
        }


@dataclass(frozen=True)
class _Claim:
    heads: range
    first: int
    ends: list[int]
    sums: list[int]


def _parse(field: Any, view_layers: range, view_heads: range, algorithm: str) -> _Claim:
    """The message's `kv_digest`, checked against this pool (ValueError says what is wrong)."""
    if not isinstance(field, dict) or field.get("alg") != algorithm:
        raise ValueError(f"it is not a {algorithm} digest")
    heads, first, ends, sums = field.get("heads"), field.get("first"), field.get("ends"), field.get("sums")
    if not (isinstance(heads, list) and len(heads) == 2 and all(type(h) is int for h in heads)):
        raise ValueError("its heads are not [first, stop]")
    covered = range(heads[0], heads[1])
    if not covered or covered.start < view_heads.start or covered.stop > view_heads.stop:
        raise ValueError(f"its heads {heads} are not a part of this pool's {view_heads}")
    if not (isinstance(ends, list) and isinstance(sums, list) and len(ends) == len(sums) <= len(view_layers)):
        raise ValueError("its ends and sums are not two lists of one entry per chunk")
    if type(first) is not int or any(type(e) is not int for e in ends) or ends != sorted(set(ends)):
        raise ValueError("its first layer and chunk ends are not increasing integers")
    if ends and not view_layers.start <= first < ends[0] <= ends[-1] <= view_layers.stop:
        raise ValueError(f"its chunks {first}..{ends} are not within layers {view_layers}")
    try:
        values = [int(s, 16) for s in sums if isinstance(s, str) and len(s) == 16]
    except ValueError:
        values = []
    if len(values) != len(sums):
        raise ValueError("its sums are not 16 hex digits each")
    return _Claim(covered, first, ends, values)


class ReadyDigests:
    """The decode's check of a ready message's KV, before the request may decode (readiness.py).

    `algorithm` None: digests are off here (nothing is checked, a carried digest is ignored).
    `grant_of` None: a slot pool without a table of its own (a layer-sharded group's follower),
    whose pushes write the whole slot from token 0."""

    def __init__(
        self,
        algorithm: str | None,
        base_addr: int,
        layout: KVLayout,
        grant_of: Callable[[int, int], Grant | None] | None,
    ) -> None:
        if grant_of is None and layout.paged:
            raise ValueError("a paged pool's digests need its block table (grant_of)")
        if algorithm is not None:
            new_digest(algorithm)  # (refuses an unknown name now, not at the first request)
        self.algorithm = algorithm
        self._base = base_addr
        self._layout = layout
        self._grant_of = grant_of

    def check(self, slot: int, generation: int, message: Mapping[str, Any]) -> int:
        """Bytes checked (0: digests off, or the reservation ended: its commit fails anyway).
        Raises KVDigestRefused or KVDigestMismatch naming the reservation (never the nonce)."""
        if self.algorithm is None:
            return 0
        where = f"slot {slot} generation {generation}"
        field = message.get(DIGEST_FIELD)
        if field is None:
            raise KVDigestRefused(
                f"the ready message of {where} carries no {DIGEST_FIELD!r}, which this decode requires "
                f"({self.algorithm}): a prefill without KV digests, or with them turned off"
            )
        grant = None if self._grant_of is None else self._grant_of(slot, generation)
        if grant is None and self._grant_of is not None:
            return 0
        layout = self._layout
        view = layout.blocks if layout.paged else layout.slot_blocks
        try:
            num_tokens = int(message["num_tokens"])
            claim = _parse(field, view.layer_range, view.head_range, self.algorithm)
        except (KeyError, TypeError, ValueError) as exc:
            raise KVDigestRefused(f"the {DIGEST_FIELD!r} of the ready message of {where} is unusable: {exc}") from None
        blocks = grant.blocks if grant is not None and layout.paged else (slot,)
        start = 0 if grant is None else min(grant.shared * view.block_tokens, num_tokens)
        if num_tokens > len(blocks) * view.block_tokens or num_tokens < 0:
            raise KVDigestRefused(f"the ready message of {where} names {num_tokens} tokens, beyond its reservation")
        return self._compare(where, _Landed.of(view, blocks, start, num_tokens, claim.heads), claim)

    def _compare(self, where: str, landed: _Landed, claim: _Claim) -> int:
        digest = new_digest(self.algorithm or XXH3_64)
        first = claim.first
        for end, expected in zip(claim.ends, claim.sums, strict=True):
            for layer in range(first, end):
                for kv_index in (K, V):
                    for r in landed.runs(layer, kv_index):
                        digest.update(self._base + r.dst, r.copies, r.dst_step, r.length)
            seen = digest.intdigest()
            if seen != expected:
                raise KVDigestMismatch(
                    f"the KV of layers {first}..{end - 1} (heads {claim.heads.start}..{claim.heads.stop - 1}) of "
                    f"{where} does not match its digest: {self.algorithm} {seen:016x}, the sender's {expected:016x}"
                )
            first = end
        return digest.bytes


@dataclass(frozen=True)
class _Landed:
    """Where a push put a prompt's tokens into this pool: `push_runs`' destination side, with a
    stand-in source holding exactly the pushed heads (the source's rows never change the order
    or the bytes on the destination side)."""

    view: BlockLayout  # (SlotBlocks for a slot pool)
    blocks: Sequence[int]
    start: int
    end: int
    heads: range
    source: KVLayout | None  # None: no token was pushed

    @classmethod
    def of(cls, view: BlockLayout, blocks: Sequence[int], start: int, end: int, heads: range) -> _Landed:
        source = None
        if end > start:
            v = view
            source = KVLayout(1, v.num_layers, end, len(heads), v.head_dim, v.dtype, v.first_layer, 0, 0, heads.start)
        return cls(view, blocks, start, end, heads, source)

    def runs(self, layer: int, kv_index: int) -> list[Strided]:
        if self.source is None:
            return []
        route = PushRoute(self.source, 0, self.view, self.blocks)
        return push_runs(route, layer, kv_index, self.end, self.start, self.heads)
