"""D1 (scope): even a peer holding the service's key writes only into leased slots, reads nothing.

Before: a link could WRITE anywhere in a decode's registered pool, including slots other
requests were decoding from, and READ all of it. Now the decode leases exactly its reserved
slots to its engine (`pdserve.RemoteWrite=leased`); a write elsewhere is PARAM_INVALID and
counted, and READ is off (`pdserve.RemoteRead=0`): no pull mode needs it.
"""

from __future__ import annotations

import ctypes

import grpc
import pytest

from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve_common.kv_layout import KVLayout
from pdserve_worker.transfer import hixl_api as api
from pdserve_worker.transfer.backends.host import link_auth
from pdserve_worker.transfer.registry import create_engine
from security.conftest import KEY
from support import attacker

pytestmark = pytest.mark.slow


def test_an_insider_cannot_write_outside_leases_nor_read(decode_peer) -> None:
    decode = decode_peer(slots=3)
    layout: KVLayout = decode.info["layout"]
    base = decode.info["base_addr"]
    leased = decode.call("reserve", request_id="victim", ttl_s=60)
    crcs = {s: decode.call("slot_crc", slot=s) for s in range(3)}
    free_slot = next(s for s in range(3) if s != leased["slot"])
    with attacker.connect(decode.info["engine_id"]) as sock:
        attacker.authenticate(sock, KEY)
        for slot in (free_slot,):
            sock.sendall(attacker.write_frame(base + layout.slot_span(slot)[0], b"\x11" * 512, seq=1))
            assert attacker.ack(sock) == (api.PARAM_INVALID, 0)
        # Straddling the leased slot's end by one byte is refused too.
        start, length = layout.slot_span(leased["slot"])
        sock.sendall(attacker.write_frame(base + start + length - 8, b"\x12" * 9, seq=2))
        assert attacker.ack(sock) == (api.PARAM_INVALID, 0)
        sock.sendall(attacker.read_request([(base, 64)], seq=3))
        assert attacker.ack(sock) == (api.PARAM_INVALID, 0)  # and no bytes follow
        # The link stays up for what a push needs: a write into the leased slot.
        sock.sendall(attacker.write_frame(base + start, b"\x13" * 64, seq=4))
        assert attacker.ack(sock) == (api.SUCCESS, 0), (decode.call("security"), leased, start, base)
    assert {s: decode.call("slot_crc", slot=s) for s in range(3) if s != leased["slot"]} == {
        s: crcs[s] for s in range(3) if s != leased["slot"]
    }
    stats = decode.call("security")
    assert (stats["write_not_leased"], stats["read_disabled"]) == (2, 1)
    # Once the KV arrived (commit) the lease is gone: a late write is refused.
    assert decode.call("commit", slot=leased["slot"], generation=leased["generation"])
    with attacker.connect(decode.info["engine_id"]) as sock:
        attacker.authenticate(sock, KEY)
        sock.sendall(attacker.write_frame(base + start, b"\x14" * 64))
        assert attacker.ack(sock) == (api.PARAM_INVALID, 0)
    assert decode.call("security")["write_leases"] == 0


def test_the_real_decode_leases_only_reserved_slots(local) -> None:
    """The same against a decode worker of `pdserve local` (a paged pool: the grant's blocks):
    its pool is writable only where a Reserve answer pointed, and only until that request's KV
    arrived."""
    auth = (("authorization", f"Bearer {local.token}"),)
    with grpc.insecure_channel(local.child("decode-0")["grpc"]) as channel:
        decode = worker_pb2_grpc.DecodeStub(channel)
        before = decode.Status(worker_pb2.StatusRequest(), metadata=auth, timeout=5).transfer_refusals
        grant = decode.Reserve(
            worker_pb2.ReserveRequest(request_id="lease", num_prompt_tokens=4, max_tokens=4), metadata=auth, timeout=5
        )
        insider = create_engine("cpu")
        key = link_auth.derive_key(local.token, link_auth.PURPOSE_LINK)
        assert insider.engine.initialize("127.0.0.1", {"pdserve.Transport": "tcp", "pdserve.AuthKey": key.hex()}) == 0
        buf = (ctypes.c_char * 256)()
        local_addr = ctypes.addressof(buf)
        try:
            assert insider.engine.register_mem(api.MemDesc(local_addr, 256), api.MEM_HOST)[0] == api.SUCCESS
            insider.ensure_connected(grant.engine_id, 2000)
            layout = grant.kv_layout
            if layout.block_tokens:  # a paged pool (the default): the grant's own first block, and another
                block_bytes = layout.block_tokens * layout.kv_heads * layout.head_dim * 4
                other = next(b for b in range(layout.num_blocks) if b not in grant.blocks)
                own = grant.base_addr + grant.blocks[0] * block_bytes  # layer 0, K
                elsewhere = grant.base_addr + other * block_bytes
            else:
                slot_bytes = layout.num_layers * 2 * layout.max_len * layout.kv_heads * layout.head_dim * 4
                other = (grant.slot + 1) % layout.num_slots
                own = grant.base_addr + grant.slot * slot_bytes
                elsewhere = grant.base_addr + other * slot_bytes
            write = api.TransferOp.WRITE
            assert (
                insider.engine.transfer_sync(
                    grant.engine_id, write, [api.TransferOpDesc(local_addr, elsewhere, 256)], 2000
                )
                == api.PARAM_INVALID
            )
            assert (
                insider.engine.transfer_sync(
                    grant.engine_id, api.TransferOp.READ, [api.TransferOpDesc(local_addr, own, 256)], 2000
                )
                == api.PARAM_INVALID
            )
            assert (
                insider.engine.transfer_sync(grant.engine_id, write, [api.TransferOpDesc(local_addr, own, 256)], 2000)
                == api.SUCCESS
            )
            decode.Release(
                worker_pb2.ReleaseRequest(request_id="lease", slot=grant.slot, generation=grant.generation),
                metadata=auth,
                timeout=5,
            )
            assert (
                insider.engine.transfer_sync(grant.engine_id, write, [api.TransferOpDesc(local_addr, own, 256)], 2000)
                == api.PARAM_INVALID
            )  # released: the lease went with it
        finally:
            insider.engine.finalize()
        after = decode.Status(worker_pb2.StatusRequest(), metadata=auth, timeout=5).transfer_refusals
    assert after - before == 3
