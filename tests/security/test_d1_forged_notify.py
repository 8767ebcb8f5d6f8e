"""D1 (notify): a forged `kv_ready` neither wakes a victim nor stays queued, and is counted.

Before: 43 of 71 victims' answers changed when an attacker sent ready notifies naming their
slots, and forged notifies left in the queue corrupted a request after the attack stopped.
Now a notify counts only with its reservation's nonce (an HMAC the decode hands out in the
Reserve answer only). The attacker here is stronger than a real one: it knows the victim's
slot and generation exactly. It sends forged notifies both ways a notify can arrive: as
datagrams into the decode's notify inbox (any process of the same user on this host: no key
needed) and over an authenticated link (an insider with the key, or real HIXL, which has no
authentication at all).
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time

import grpc
import pytest

from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve_worker.model.sampling.params import SamplingParams
from pdserve_worker.rpc.convert import sampling_to_proto
from pdserve_worker.transfer import hixl_api as api
from pdserve_worker.transfer.backends.host import link_auth, wire
from pdserve_worker.transfer.registry import create_engine
from security.conftest import complete

pytestmark = pytest.mark.slow

FORGED_FIRST_TOKEN = 3


def inbox_of(pid: int) -> str:
    """The decode's notify inbox: an abstract Unix socket, listed in /proc/net/unix."""
    with open("/proc/net/unix") as f:
        names = re.findall(rf"@(pdserve-hixl-notify-{pid}-[0-9a-f]+)", f.read())
    assert names, f"no notify inbox of pid {pid}"
    return names[0]


def forged(slot: int, generation: int, num_tokens: int, nonce: str) -> tuple[bytes, str]:
    msg = json.dumps(
        {
            "request_id": "victim",
            "slot": slot,
            "generation": generation,
            "nonce": nonce,
            "num_tokens": num_tokens,
            "first_token": FORGED_FIRST_TOKEN,
        }
    )
    return wire.notify_frame(b"kv_ready" + msg.encode(), len(b"kv_ready")), msg


def test_forged_ready_notifies_are_dropped_counted_and_the_victim_is_unchanged(local, reference) -> None:
    auth = (("authorization", f"Bearer {local.token}"),)
    decode_child, prefill_child = local.child("decode-0"), local.child("prefill-0")
    prompt = "The victim asks a question about"
    ids = reference.tokenizer.encode(prompt)
    expected = reference.complete(ids, 16)
    decode_channel = grpc.insecure_channel(decode_child["grpc"])
    prefill_channel = grpc.insecure_channel(prefill_child["grpc"])
    decode = worker_pb2_grpc.DecodeStub(decode_channel)
    dropped_before = decode.Status(worker_pb2.StatusRequest(), metadata=auth, timeout=5).notifies_dropped

    # The victim's request, driven as the router drives it.
    grant = decode.Reserve(
        worker_pb2.ReserveRequest(request_id="victim", num_prompt_tokens=len(ids), max_tokens=16),
        metadata=auth,
        timeout=5,
    )
    sampling = sampling_to_proto(SamplingParams(max_tokens=16, temperature=0))
    events: list[worker_pb2.TokenEvent] = []
    stream = decode.Generate(
        worker_pb2.GenerateRequest(
            request_id="victim",
            slot=grant.slot,
            generation=grant.generation,
            prompt_token_ids=ids,
            sampling=sampling,
            readiness_timeout_ms=60_000,
        ),
        metadata=auth,
        timeout=90,
    )
    reader = threading.Thread(target=lambda: events.extend(stream), daemon=True)
    reader.start()
    time.sleep(0.3)

    # Attack 1: datagrams into the inbox, with wrong nonces (and none), right slot and generation.
    sent_datagrams = 0
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.connect("\0" + inbox_of(decode_child["pid"]))
        for i in range(300):
            frame, _ = forged(grant.slot, grant.generation, len(ids), os.urandom(16).hex() if i % 3 else "")
            try:
                sock.send(frame, socket.MSG_DONTWAIT)
                sent_datagrams += 1
            except BlockingIOError:
                time.sleep(0.002)
    # Attack 2: over a link, as an insider holding the service's key (or anyone, on real HIXL).
    insider = create_engine("cpu")
    key = link_auth.derive_key(local.token, link_auth.PURPOSE_LINK)
    assert insider.engine.initialize("127.0.0.1", {"pdserve.Transport": "tcp", "pdserve.AuthKey": key.hex()}) == 0
    try:
        insider.ensure_connected(grant.engine_id, 2000)
        for _ in range(100):
            _, msg = forged(grant.slot, grant.generation, len(ids), os.urandom(16).hex())
            assert insider.engine.send_notify(grant.engine_id, api.NotifyDesc("kv_ready", msg), 2000) == api.SUCCESS
    finally:
        insider.engine.finalize()
    time.sleep(0.5)
    assert events == [], "a forged notify woke the victim's Generate"

    # Every forged notify was dropped and counted (none is left to be taken later).
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        dropped = decode.Status(worker_pb2.StatusRequest(), metadata=auth, timeout=5).notifies_dropped - dropped_before
        if dropped >= sent_datagrams + 100:
            break
        time.sleep(0.05)
    assert dropped == sent_datagrams + 100 and sent_datagrams > 0, (dropped, sent_datagrams)

    # The genuine prefill: the victim's answer is exactly the model's.
    worker_pb2_grpc.PrefillStub(prefill_channel).Prefill(
        worker_pb2.PrefillRequest(request_id="victim", prompt_token_ids=ids, sampling=sampling, targets=[grant]),
        metadata=auth,
        timeout=60,
    )
    reader.join(60)
    assert "".join(e.text for e in events) == expected
    decode_channel.close()
    prefill_channel.close()

    # Nothing forged stayed queued: the next requests through the router are the model's too.
    for prompt in ("After the attack", "Berlin is", "Numbers like 12345"):
        assert complete(local, prompt, 10) == reference.complete(reference.tokenizer.encode(prompt), 10)

    # No log line per drop: at most a rate-limited summary or two.
    log = open(decode_child["log"]).read()
    assert log.count("ready_notifies_dropped") <= 2, log.count("ready_notifies_dropped")
    assert "ready_stale_ignored" not in log and "notify_ignored" not in log


def test_a_prefill_refuses_a_grant_without_its_nonce(local, reference) -> None:
    """The router hands the Reserve answer to the prefill unchanged; a grant stripped of its
    nonce is refused up front (the decode would drop its notify anyway)."""
    auth = (("authorization", f"Bearer {local.token}"),)
    ids = reference.tokenizer.encode("no nonce")
    with grpc.insecure_channel(local.child("decode-0")["grpc"]) as channel:
        decode = worker_pb2_grpc.DecodeStub(channel)
        grant = decode.Reserve(
            worker_pb2.ReserveRequest(request_id="strip", num_prompt_tokens=len(ids), max_tokens=4),
            metadata=auth,
            timeout=5,
        )
        assert len(grant.nonce) == 16
        stripped = worker_pb2.Grant()
        stripped.CopyFrom(grant)
        stripped.ClearField("nonce")
        with grpc.insecure_channel(local.child("prefill-0")["grpc"]) as pchannel:
            with pytest.raises(grpc.RpcError) as refused:
                worker_pb2_grpc.PrefillStub(pchannel).Prefill(
                    worker_pb2.PrefillRequest(
                        request_id="strip",
                        prompt_token_ids=ids,
                        targets=[stripped],
                        sampling=sampling_to_proto(SamplingParams(max_tokens=4, temperature=0)),
                    ),
                    metadata=auth,
                    timeout=30,
                )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "nonce" in refused.value.details()
        assert decode.Release(
            worker_pb2.ReleaseRequest(request_id="strip", slot=grant.slot, generation=grant.generation),
            metadata=auth,
            timeout=5,
        ).released
