"""Issue #58 A4, against `pdserve local`'s real processes: role credentials were scoped by role,
not by pod. With one prefill's token (what a compromised prefill pod holds: its environment) an
attacker registered a second, fake prefill at an endpoint of its own, and the router sent it
other tenants' prompts (8 of 8 in the finding), with the decode grants and their nonces.

Now a registration made with a role token carries the member's own credential, bound to the
member id it claims (operator/pdserve_operator/broker/identity.py): the stolen one registers no
other id (refused by name), no credential registers nothing, and the stolen pod's own id is not
taken from the live member (only its lease replaces it). The fake prefill receives nothing, and
the deployment answers as before."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from pdserve.v1 import broker_pb2, broker_pb2_grpc, worker_pb2_grpc
from security.conftest import complete
from security.test_role_credentials import SERVICE, bearer, code_of, like, members

pytestmark = pytest.mark.slow

MEMBER_HEADER = "x-pdserve-member-credential"  # (credentials.MEMBER_CREDENTIAL_HEADER)
PROMPTS = 8


class FakePrefill(worker_pb2_grpc.PrefillServicer):
    """The attacker's prefill: records every prompt sent to it, then fails the call."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    def Prefill(self, request, context):  # noqa: N802  (the protocol's name)
        self.prompts.append(list(request.prompt_token_ids))
        context.abort(grpc.StatusCode.UNAVAILABLE, "attacker")


def stolen_env(local, name: str) -> dict[str, str]:
    """What a compromised pod holds: its process's environment."""
    raw = open(f"/proc/{local.child(name)['pid']}/environ", "rb").read().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_a4_a_stolen_prefill_credential_registers_no_other_member(local, reference):
    env = stolen_env(local, "prefill-0")
    token, credential = env["PDSERVE_BROKER_TOKEN"], env.get("PDSERVE_MEMBER_CREDENTIAL", "")
    before = members(local, token)
    fake = FakePrefill()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    worker_pb2_grpc.add_PrefillServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    leases: list[str] = []
    try:
        with grpc.insecure_channel(local.manifest["broker"]) as channel:
            broker = broker_pb2_grpc.BrokerStub(channel)
            twin = like(before["prefill-0"], "prefill-9", f"127.0.0.1:{port}")
            request = broker_pb2.RegisterRequest(service_key=SERVICE, member=twin)

            def register(metadata):
                leases.append(broker.Register(request, metadata=metadata, timeout=5).lease_id)

            # the stolen pod's credential, for another member id: refused, by name
            with pytest.raises(grpc.RpcError) as refused:
                register(bearer(token) + ((MEMBER_HEADER, credential),))
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "prefill-9" in refused.value.details(), refused.value.details()
            # the role token alone: refused
            assert code_of(lambda: register(bearer(token))) == grpc.StatusCode.PERMISSION_DENIED
            # the stolen pod's own id, at the attacker's endpoint: the live member is not replaced
            own = broker_pb2.RegisterRequest(
                service_key=SERVICE, member=like(before["prefill-0"], endpoint=f"127.0.0.1:{port}")
            )
            call = lambda: broker.Register(own, metadata=bearer(token) + ((MEMBER_HEADER, credential),), timeout=5)  # noqa: E731
            assert code_of(call) == grpc.StatusCode.FAILED_PRECONDITION
        prompts = [f"Tenant B's secret number {i} is" for i in range(PROMPTS)]
        answers = [complete(local, p, 4) for p in prompts]
        assert fake.prompts == [], f"the fake prefill received {len(fake.prompts)} prompts"
        for prompt, answer in zip(prompts, answers, strict=True):
            assert answer == reference.complete(reference.tokenizer.encode(prompt), 4)
        after = members(local, token)
        assert set(after) == set(before)
        assert after["prefill-0"].info.grpc_endpoint == before["prefill-0"].info.grpc_endpoint
    finally:
        with grpc.insecure_channel(local.manifest["broker"]) as channel:  # (on main: the fake leaves)
            for lease in leases:
                broker_pb2_grpc.BrokerStub(channel).Deregister(
                    broker_pb2.DeregisterRequest(service_key=SERVICE, lease_id=lease), metadata=bearer(token), timeout=5
                )
        server.stop(0)
