"""D9 (the KV plane's share): tell an unauthenticated peer nothing, log floods as summaries,
listen only where needed, and stop the transfer server before the KV pool is freed.

Before: the handshake reply carried the registered addresses, shared-memory names and host
id to anyone; each forged notify was one INFO line; a prefill listened on a transfer port it
never uses; shutdown freed the KV pool while the transfer server could still be writing it.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from pathlib import Path

import grpc
import pytest

from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve_worker.transfer.backends.host import link_auth, wire
from security.conftest import MAX_LEN, SLOTS, complete, decode_engine_id
from support import attacker

pytestmark = pytest.mark.slow


def test_the_handshake_tells_an_unauthenticated_peer_only_a_nonce(local) -> None:
    engine_id = decode_engine_id(local)
    with attacker.connect(engine_id) as sock:
        _, challenge = attacker.hello(sock)
    assert set(challenge) == {"auth", "nonce"} and len(bytes.fromhex(challenge["nonce"])) == link_auth.NONCE_BYTES
    # After authentication a peer on another host learns where the regions are (it needs that
    # to address its writes) but no segment names, notify inbox or host identity.
    key = link_auth.derive_key(local.token, link_auth.PURPOSE_LINK)
    with attacker.connect(engine_id) as sock:
        remote = attacker.authenticate(sock, key, host="another-host")
    assert set(remote) == {"proof", "regions"}
    assert all(r["shm_name"] == "" and r["shm_size"] == 0 for r in remote["regions"])
    # A peer on this host is told what it needs to map the pool and ring the inbox.
    with attacker.connect(engine_id) as sock:
        same = attacker.authenticate(sock, key, host=link_auth.host_tag())
    assert set(same) == {"proof", "regions", "host", "notify_socket"}
    assert all(r["shm_name"].startswith("pdserve-hixl-") for r in same["regions"])


def listening_ports(pid: int) -> set[int]:
    """TCP ports a process listens on: its socket inodes matched against /proc/net/tcp{,6}."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def test_a_prefill_listens_on_no_transfer_port(local) -> None:
    for name in ("prefill-0", "decode-0"):
        child = local.child(name)
        ports = listening_ports(child["pid"])
        expected = {int(child[kind].rsplit(":", 1)[1]) for kind in ("http", "probe", "grpc")}
        if name == "prefill-0":
            assert ports == expected, ports  # HTTP (metrics), the probes' and gRPC (Prefill): nothing else
        else:
            expected.add(int(child["admin"].rsplit(":", 1)[1]))  # /drain, on 127.0.0.1 only (pod_env.py)
            assert len(ports - expected) == 1, ports  # the decode's transfer port, which prefills push into
    log = open(local.child("prefill-0")["log"]).read()
    assert re.search(r"event=engine_initialized .*listening=False", log)


def test_floods_of_forged_notifies_and_failed_handshakes_log_a_summary_not_a_line_each(local, reference) -> None:
    decode = local.child("decode-0")
    with open("/proc/net/unix") as f:
        inbox = re.findall(rf"@(pdserve-hixl-notify-{decode['pid']}-[0-9a-f]+)", f.read())[0]
    log_path = Path(decode["log"])
    lines_before = len(log_path.read_text().splitlines())
    auth = (("authorization", f"Bearer {local.token}"),)
    channel = grpc.insecure_channel(decode["grpc"])
    stub = worker_pb2_grpc.DecodeStub(channel)
    # A request that waits for its KV keeps the decode draining its inbox while we flood it.
    grant = stub.Reserve(
        worker_pb2.ReserveRequest(request_id="waits", num_prompt_tokens=2, max_tokens=2), metadata=auth, timeout=5
    )
    waiting = stub.Generate(
        worker_pb2.GenerateRequest(
            request_id="waits",
            slot=grant.slot,
            generation=grant.generation,
            prompt_token_ids=[1, 2],
            readiness_timeout_ms=60_000,
        ),
        metadata=auth,
        timeout=90,
    )
    time.sleep(0.3)
    sent = 0
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.connect("\0" + inbox)
        for i in range(3000):
            msg = json.dumps({"slot": i % SLOTS, "generation": i, "nonce": "0" * 32, "num_tokens": 1})
            try:
                sock.send(wire.notify_frame(b"kv_ready" + msg.encode(), 8), socket.MSG_DONTWAIT)
                sent += 1
            except BlockingIOError:
                time.sleep(0.001)
    waiting.cancel()
    channel.close()
    engine_id = decode_engine_id(local)
    for _ in range(200):
        with attacker.connect(engine_id) as conn:
            conn.sendall(b"\x00" * 24)
            attacker.recv_all_until_close(conn)
    # The decode drains its inbox whenever a request waits: run some, and check they are right.
    for prompt in ("one", "two", "three"):
        assert complete(local, prompt, 4) == reference.complete(reference.tokenizer.encode(prompt), 4)
    new_lines = log_path.read_text().splitlines()[lines_before:]
    assert sent > 1000
    assert len(new_lines) < 40, "\n".join(new_lines[:50])
    assert sum("ready_notifies_dropped" in line for line in new_lines) <= 2
    assert sum("kv_link_refusals" in line for line in new_lines) <= 2


def test_shutdown_stops_the_transfer_server_before_freeing_the_pool(
    tiny_model_dir, tmp_path: Path, local_deployments
) -> None:
    """A peer is in the middle of a WRITE into a leased slot when the deployment stops: the
    decode must close that link and join its server before the pool's memory goes (before:
    the pool was freed first, while a server thread could be receiving into it)."""
    os.environ["PDSERVE_ENGINE_OPTIONS"] = json.dumps({"pdserve.Transport": "tcp"})
    try:
        run = local_deployments(tmp_path / "stop", tiny_model_dir, decode=1, slots=SLOTS, max_len=MAX_LEN)
    finally:
        del os.environ["PDSERVE_ENGINE_OPTIONS"]
    auth = (("authorization", f"Bearer {run.token}"),)
    with grpc.insecure_channel(run.child("decode-0")["grpc"]) as channel:
        grant = worker_pb2_grpc.DecodeStub(channel).Reserve(
            worker_pb2.ReserveRequest(request_id="slow", num_prompt_tokens=8, max_tokens=8, lease_ms=1500),
            metadata=auth,
            timeout=5,
        )
    key = link_auth.derive_key(run.token, link_auth.PURPOSE_LINK)
    sock = attacker.connect(grant.engine_id)
    attacker.authenticate(sock, key)
    # A WRITE of 64 KiB into the leased slot, of which only the first KiB is sent: the
    # server thread is now blocked receiving into the pool.
    size = 64 << 10
    sock.sendall(wire.header(wire.Kind.WRITE, 1, 1, size) + wire.pack_descs([(grant.base_addr, size)]) + b"\x07" * 1024)
    time.sleep(0.3)
    decode_log = Path(run.child("decode-0")["log"])
    assert run.stop() == 0
    assert attacker.recv_all_until_close(sock, timeout_s=5) == b""  # the link was closed, never ACKed
    sock.close()
    log = decode_log.read_text()
    finalized, freed = log.find("event=engine_finalized"), log.find("event=kv_pool_freed")
    assert 0 <= finalized < freed, log[-3000:]
    assert "Segmentation fault" not in log and "link_failed" not in log and "server_threads_linger" not in log
    assert "SIGSEGV" not in run.stderr_path.read_text()
