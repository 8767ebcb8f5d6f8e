"""Issue #29 item 4, against `pdserve local`'s real processes: one service token authorised
every RPC, and the internet-facing router held it — with it a member re-registered `decode-0` at
an endpoint of its own choosing until the real pod came back. Now no process of the deployment
holds the service token (pdserve_common/credentials.py), each holds its role's, and:
- a router's token can watch the membership and call the workers it routes to, but cannot
  register a prefill or a decode, nor replace a live member (its own role's included);
- a decode's token cannot replace another live decode (only that member's own lease does), nor
  call what only routers call;
- a prefill's token cannot call a decode.
After every attack the deployment answers as before and decode-0 is still where it was."""

from __future__ import annotations

import grpc
import pytest

from pdserve.v1 import broker_pb2, broker_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve_common.auth import role_token
from pdserve_common.credentials import MEMBER_CREDENTIAL_HEADER, member_credential
from security.conftest import complete

pytestmark = pytest.mark.slow

SERVICE = "local/pdserve"


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def like(real: broker_pb2.Member, worker_id: str | None = None, endpoint: str | None = None) -> broker_pb2.MemberInfo:
    """A valid member like `real`, under another id or at another endpoint (the attacker's)."""
    info = broker_pb2.MemberInfo()
    info.CopyFrom(real.info)
    if worker_id is not None:
        info.worker_id = worker_id
    if endpoint is not None:
        info.grpc_endpoint = endpoint
    return info


def code_of(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def members(local, token: str) -> dict[str, broker_pb2.Member]:
    with grpc.insecure_channel(local.manifest["broker"]) as channel:
        reply = broker_pb2_grpc.BrokerStub(channel).ListMembers(
            broker_pb2.ListMembersRequest(service_key=SERVICE), metadata=bearer(token), timeout=5
        )
    return {m.info.worker_id: m for m in reply.members}


def test_no_process_of_the_deployment_holds_the_service_token(local):
    for child in local.manifest["children"]:
        if child["role"] == "broker":
            continue  # the operator's part: the broker's table holds the service token
        environ = open(f"/proc/{child['pid']}/environ", "rb").read().split(b"\0")
        assert local.token.encode() not in b"\0".join(environ), child["name"]
        tokens = [e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"PDSERVE_BROKER_TOKEN=")]
        role = child["role"]
        assert tokens == [role_token(local.token, role)], (child["name"], tokens)


def test_a_routers_token_cannot_register_or_replace_a_member(local, reference):
    router = role_token(local.token, "router")
    before = members(local, router)  # watching and listing: allowed
    assert "decode-0" in before
    with grpc.insecure_channel(local.manifest["broker"]) as channel:
        broker = broker_pb2_grpc.BrokerStub(channel)
        forged = broker_pb2.RegisterRequest(
            service_key=SERVICE, member=like(before["decode-0"], endpoint="127.0.0.1:9")
        )
        assert code_of(lambda: broker.Register(forged, metadata=bearer(router), timeout=5)) == (
            grpc.StatusCode.PERMISSION_DENIED
        )
        new_prefill = broker_pb2.RegisterRequest(service_key=SERVICE, member=like(before["prefill-0"], "prefill-9"))
        assert code_of(lambda: broker.Register(new_prefill, metadata=bearer(router), timeout=5)) == (
            grpc.StatusCode.PERMISSION_DENIED
        )
        # its own role, but a live member: only that member's lease replaces it, even with the
        # member's own credential (#58 A4: a pod's, stolen)
        twin = broker_pb2.RegisterRequest(service_key=SERVICE, member=like(before["router-0"]))
        own = bearer(router) + ((MEMBER_CREDENTIAL_HEADER, member_credential(local.token, "router", "router-0")),)
        assert code_of(lambda: broker.Register(twin, metadata=own, timeout=5)) == (grpc.StatusCode.FAILED_PRECONDITION)
        # deregistering is by lease: a guessed one removes nobody (the membership is checked below)
        gone = broker_pb2.DeregisterRequest(service_key=SERVICE, lease_id="not-a-lease")
        code_of(lambda: broker.Deregister(gone, metadata=bearer(router), timeout=5))
    after = members(local, router)
    assert after["decode-0"].info.grpc_endpoint == before["decode-0"].info.grpc_endpoint
    assert set(after) == set(before)
    prompt = "Paris is the capital of"
    assert complete(local, prompt, 8) == reference.complete(reference.tokenizer.encode(prompt), 8)


def test_a_decodes_token_cannot_replace_another_decode_nor_route(local):
    decode, prefill = role_token(local.token, "decode"), role_token(local.token, "prefill")
    before = members(local, decode)
    with grpc.insecure_channel(local.manifest["broker"]) as channel:
        broker = broker_pb2_grpc.BrokerStub(channel)
        takeover = broker_pb2.RegisterRequest(
            service_key=SERVICE, member=like(before["decode-0"], endpoint="127.0.0.1:9"), replaces_lease_id="a-guess"
        )
        own = bearer(decode) + ((MEMBER_CREDENTIAL_HEADER, member_credential(local.token, "decode", "decode-0")),)
        assert code_of(lambda: broker.Register(takeover, metadata=own, timeout=5)) == (
            grpc.StatusCode.FAILED_PRECONDITION
        )
    with grpc.insecure_channel(local.child("decode-0")["grpc"]) as channel:
        stub = worker_pb2_grpc.DecodeStub(channel)
        reserve = worker_pb2.ReserveRequest(request_id="x", num_prompt_tokens=3, max_tokens=3)
        # a decode's token is known here (a group's leader calls its members) but not for this;
        # a prefill's is not even known (no prefill calls a decode)
        assert code_of(lambda: stub.Reserve(reserve, metadata=bearer(decode), timeout=5)) == (
            grpc.StatusCode.PERMISSION_DENIED
        )
        assert code_of(lambda: stub.Reserve(reserve, metadata=bearer(prefill), timeout=5)) == (
            grpc.StatusCode.UNAUTHENTICATED
        )
        assert stub.Status(worker_pb2.StatusRequest(), metadata=bearer(role_token(local.token, "router")), timeout=5)
    with grpc.insecure_channel(local.child("prefill-0")["grpc"]) as channel:
        request = worker_pb2.PrefillRequest(request_id="x", prompt_token_ids=[1, 2])
        prefill_stub = worker_pb2_grpc.PrefillStub(channel)
        assert code_of(lambda: prefill_stub.Prefill(request, metadata=bearer(decode), timeout=5)) == (
            grpc.StatusCode.UNAUTHENTICATED  # only routers call a prefill: it knows no decode's token
        )
    assert members(local, decode)["decode-0"].info.grpc_endpoint == before["decode-0"].info.grpc_endpoint
