"""D1 (link): the KV transfer port admits only peers that hold the service's key.

Before: any TCP peer got the decode's regions at HELLO and could READ the whole pool (a
victim's prompt was recovered from its KV) or WRITE anywhere in it. Now a peer must pass
the challenge-response of link_auth.py first; until then it is told a nonce and nothing else,
and whatever else it sends closes the connection.
"""

from __future__ import annotations

import json
import os
import socket
import time

import grpc
import pytest

from pdserve.v1 import broker_pb2, broker_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve_worker.transfer import hixl_api as api
from pdserve_worker.transfer.backends.host import link_auth, wire
from pdserve_worker.transfer.registry import create_engine
from security.conftest import KEY, complete
from support import attacker

pytestmark = pytest.mark.slow


def decode_member(local) -> broker_pb2.Member:
    with grpc.insecure_channel(local.manifest["broker"]) as channel:
        members = (
            broker_pb2_grpc.BrokerStub(channel)
            .ListMembers(
                broker_pb2.ListMembersRequest(service_key="local/pdserve", roles=[broker_pb2.ROLE_DECODE]),
                metadata=(("authorization", f"Bearer {local.token}"),),
                timeout=5,
            )
            .members
        )
    [member] = members
    return member


def decode_status(local) -> worker_pb2.DecodeStatus:
    with grpc.insecure_channel(local.child("decode-0")["grpc"]) as channel:
        return worker_pb2_grpc.DecodeStub(channel).Status(
            worker_pb2.StatusRequest(), metadata=(("authorization", f"Bearer {local.token}"),), timeout=5
        )


def test_an_unauthenticated_peer_reads_nothing_and_writes_nothing(local, reference) -> None:
    member = decode_member(local)
    engine_id = member.info.engine_id
    [region] = member.info.regions
    before = decode_status(local).transfer_refusals

    # 1. The old protocol: HELLO, then straight to READ/WRITE. All it gets is a CHALLENGE.
    for frame in (attacker.read_request([(region.addr, 4096)]), attacker.write_frame(region.addr, b"\xff" * 4096)):
        with attacker.connect(engine_id) as sock:
            _, challenge = attacker.hello(sock)
            assert set(challenge) == {"auth", "nonce"} and challenge["auth"] is True
            sock.sendall(frame)
            assert attacker.recv_all_until_close(sock) == b""  # no ACK, no byte of KV: closed

    # 2. A made-up proof: closed without a word (it learns nothing about why).
    with attacker.connect(engine_id) as sock:
        attacker.hello(sock)
        sock.sendall(wire.json_frame(wire.Kind.AUTH, {"client": "x", "host": "y", "proof": "00" * 32}))
        sock.sendall(attacker.read_request([(region.addr, 4096)]))
        assert attacker.recv_all_until_close(sock) == b""

    # 3. Garbage instead of HELLO.
    with attacker.connect(engine_id) as sock:
        sock.sendall(os.urandom(64))
        assert attacker.recv_all_until_close(sock) == b""

    after = decode_status(local).transfer_refusals
    assert after - before >= 4, (before, after)
    # The decode still serves, and its answers are the model's (nothing of the pool changed).
    prompt = "Attackers at the gate"
    assert complete(local, prompt, 12) == reference.complete(reference.tokenizer.encode(prompt), 12)


@pytest.mark.parametrize("key", [None, os.urandom(32)], ids=["no-key", "wrong-key"])
def test_an_engine_without_the_services_key_cannot_connect(local, key: bytes | None) -> None:
    engine_id = decode_member(local).info.engine_id
    before = decode_status(local).transfer_refusals
    backend = create_engine("cpu")
    options = {"pdserve.Transport": "tcp"} | ({"pdserve.AuthKey": key.hex()} if key else {})
    assert backend.engine.initialize("127.0.0.1", options) == api.SUCCESS
    try:
        assert backend.engine.connect(engine_id, 2000) == api.FAILED
        assert backend.engine.link_path(engine_id) is None
    finally:
        backend.engine.finalize()
    # Counted (auth_failed) — the server may count just after the client saw the link fail.
    deadline = time.monotonic() + 5
    while decode_status(local).transfer_refusals == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert decode_status(local).transfer_refusals == before + 1


def test_the_right_key_is_what_the_service_token_derives(local) -> None:
    """A peer holding the service's token (what every pod of the service has) gets in; the
    key is derived from it, never sent: the HELLO_ACK proves the server holds it too."""
    key = link_auth.derive_key(local.token, link_auth.PURPOSE_LINK)
    with attacker.connect(decode_member(local).info.engine_id) as sock:
        ack = attacker.authenticate(sock, key)
    assert ack["regions"] and "proof" in ack
    assert key.hex() not in json.dumps(ack) and local.token not in json.dumps(ack)


def test_a_client_refuses_a_server_that_cannot_prove_the_key(decode_peer) -> None:
    """Mutual: a prefill must not push KV (which gives the prompt away) into an impostor."""
    impostor = decode_peer(**{"pdserve.AuthKey": os.urandom(32).hex()})
    backend = create_engine("cpu")
    assert backend.engine.initialize("127.0.0.1", {"pdserve.AuthKey": KEY.hex()}) == api.SUCCESS
    try:
        assert backend.engine.connect(impostor.info["engine_id"], 2000) == api.FAILED
    finally:
        backend.engine.finalize()
    assert impostor.call("security")["auth_failed"] == 1


def test_unauthenticated_attacks_leave_every_byte_of_the_pool_as_it_was(decode_peer) -> None:
    """The same attacks against a stand-in decode whose pool we can checksum."""
    decode = decode_peer(slots=2)
    grant = decode.call("reserve", request_id="victim", ttl_s=60)  # a live, leased slot
    crcs = [decode.call("slot_crc", slot=s) for s in range(2)]
    base = decode.info["base_addr"]
    for payload in (
        attacker.write_frame(base, b"\x01" * 1024),
        attacker.write_frame(base + grant["layout"]["max_len"], b"\x02" * 64),
    ):
        with attacker.connect(decode.info["engine_id"]) as sock:
            attacker.hello(sock)
            sock.sendall(payload)
            assert attacker.recv_all_until_close(sock) == b""
    with attacker.connect(decode.info["engine_id"]) as sock:
        sock.sendall(attacker.write_frame(base, b"\x03" * 256))  # not even a HELLO
        assert attacker.recv_all_until_close(sock) == b""
    assert [decode.call("slot_crc", slot=s) for s in range(2)] == crcs
    stats = decode.call("security")
    assert stats["handshake_invalid"] == 3 and stats["links_open"] == 0


def test_a_socket_that_connects_and_says_nothing_is_cut_at_the_handshake_deadline(decode_peer) -> None:
    decode = decode_peer(**{"pdserve.HandshakeTimeoutMs": "300"})
    with attacker.connect(decode.info["engine_id"]) as sock:
        assert attacker.recv_all_until_close(sock, timeout_s=3) == b""
    assert decode.call("security")["handshake_timeout"] == 1
    with pytest.raises((ConnectionError, socket.timeout, OSError)):
        with attacker.connect(decode.info["engine_id"]) as sock:
            sock.sendall(wire.header(wire.Kind.HELLO, 0, 0, 80)[:10])  # a partial header, then silence
            attacker.read_frame(sock)
