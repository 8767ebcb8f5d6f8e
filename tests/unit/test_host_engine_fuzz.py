"""Property: arbitrary transfer descriptors never crash the host engine or its server.

Whatever addresses and lengths a caller hands `transfer_sync`, the answer is SUCCESS exactly
when every op lies inside registered memory on both sides (and has bytes to move), else
PARAM_INVALID; nothing is left outstanding, and the link still moves bytes afterwards.
"""

from __future__ import annotations

import ctypes

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve_worker.transfer import hixl_api as api

from test_host_engine import SIZE, Pair

U64 = (1 << 64) - 1


def _address(base_of: str) -> st.SearchStrategy[tuple[str, int]]:
    """An address near a region (edges included) or anywhere in the 64-bit space."""
    near = st.tuples(st.just(base_of), st.integers(-SIZE, 2 * SIZE))
    anywhere = st.tuples(st.just("abs"), st.integers(0, U64))
    return st.one_of(near, near, anywhere)


op = st.tuples(_address("local"), _address("remote"), st.one_of(st.integers(0, 2 * SIZE), st.integers(0, U64)))


def _resolve(pair: Pair, where: tuple[str, int]) -> int:
    kind, value = where
    base = {"local": pair.local_addr, "remote": pair.remote_addr, "abs": 0}[kind]
    return min(max(base + value, 0), U64)


def _inside(addr: int, length: int, base: int) -> bool:
    return length > 0 and base <= addr and addr + length <= base + SIZE


@pytest.fixture(scope="module", params=["auto", "tcp"])
def linked(request: pytest.FixtureRequest):
    p = Pair(request.param)
    p.connect()
    yield p
    p.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op, min_size=1, max_size=4), write=st.booleans())
def test_arbitrary_descriptors_are_served_or_refused_never_crash(linked: Pair, ops, write: bool) -> None:
    descs, valid = [], True
    for local, remote, length in ops:
        la, ra = _resolve(linked, local), _resolve(linked, remote)
        length = min(length, U64)
        descs.append(api.TransferOpDesc(la, ra, length))
        valid = valid and _inside(la, length, linked.local_addr) and _inside(ra, length, linked.remote_addr)
    status = linked.client.transfer_sync(linked.remote, api.WRITE if write else api.READ, descs, 2000)
    assert status == (api.SUCCESS if valid else api.PARAM_INVALID), (descs, status)
    assert linked.client.outstanding() == 0
    # The engine and its server are still whole: a plain write goes through.
    ctypes.memmove(linked.local_addr, b"still-ok", 8)
    probe = [api.TransferOpDesc(linked.local_addr, linked.remote_addr + SIZE - 8, 8)]
    assert linked.client.transfer_sync(linked.remote, api.WRITE, probe, 2000) == api.SUCCESS
    assert linked.remote_bytes(SIZE - 8, 8) == b"still-ok"
