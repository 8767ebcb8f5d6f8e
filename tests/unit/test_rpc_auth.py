"""Per-service bearer tokens: the pure rules, then the interceptor on a real worker service."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from pdserve.v1 import broker_pb2, worker_pb2, worker_pb2_grpc
from pdserve_common.auth import Denial, TLSConfig, TokenTable, authorize, token_from_metadata
from pdserve_common.channels import aio_channel, aio_server, bind

UNAUTH, DENIED = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED


def test_token_table_resolves_rotates_and_removes() -> None:
    table = TokenTable({"ns/a": "tok-a"})
    assert table.service_for("tok-a") == "ns/a"
    table.set("ns/a", "tok-a2")
    assert table.service_for("tok-a") is None, "a rotated-out token must stop working"
    assert table.service_for("tok-a2") == "ns/a" and table.verify("ns/a", "tok-a2")
    assert table.remove("ns/a") and table.service_for("tok-a2") is None
    assert not table.remove("ns/a")


@pytest.mark.parametrize(
    ("service", "token", "message"),
    [
        ("ns/b", "tok-a", "cannot share a token"),
        ("ns/b", "has space", "without whitespace"),
        ("ns/b", "", "non-empty"),
        ("", "x", "service_key"),
    ],
)
def test_token_table_refuses(service: str, token: str, message: str) -> None:
    table = TokenTable({"ns/a": "tok-a"})
    with pytest.raises(ValueError, match=message):
        table.set(service, token)


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ((), "missing"),
        ((("authorization", "Basic dXNlcg=="),), "malformed"),
        ((("authorization", "Bearer "),), "malformed"),
        ((("authorization", "Bearer a"), ("authorization", "Bearer b")), "2 'authorization' headers"),
    ],
)
def test_missing_or_malformed_header_is_unauthenticated(metadata, expected: str) -> None:
    denial = token_from_metadata(metadata)
    assert isinstance(denial, Denial) and denial.code == UNAUTH and expected in denial.details


def test_authorize_by_the_service_key_of_the_request() -> None:
    table = TokenTable({"ns/a": "tok-a", "ns/b": "tok-b"})
    md = (("authorization", "Bearer tok-b"),)
    assert authorize(table, md, broker_pb2.WatchRequest(service_key="ns/b")) is None
    denial = authorize(table, md, broker_pb2.WatchRequest(service_key="ns/a"))
    assert denial is not None and denial.code == DENIED and "'ns/a'" in denial.details
    unknown = authorize(table, (("authorization", "Bearer nope"),), broker_pb2.WatchRequest(service_key="ns/a"))
    assert unknown is not None and unknown.code == UNAUTH
    # Worker requests carry no service_key: the token alone decides.
    assert authorize(table, md, worker_pb2.StatusRequest()) is None


class EchoDecode(worker_pb2_grpc.DecodeServicer):
    """Just enough of a decode service to see which calls reach the handler."""

    def __init__(self) -> None:
        self.calls = 0

    async def Status(self, request, context):
        self.calls += 1
        return worker_pb2.DecodeStatus(worker_id="d0", slots_total=4, slots_free=4)

    async def Generate(self, request, context):
        self.calls += 1
        for i in range(3):
            yield worker_pb2.TokenEvent(index=i, token_id=100 + i)

    async def Release(self, request, context):  # context.write-free coroutine returning a reply
        self.calls += 1
        await asyncio.sleep(0)
        return worker_pb2.ReleaseReply(released=True)


@pytest.mark.asyncio
async def test_worker_service_checks_every_kind_of_call() -> None:
    servicer = EchoDecode()
    server = aio_server(TokenTable({"ns/a": "tok-a"}))
    worker_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
    port = bind(server, "127.0.0.1", 0)
    await server.start()
    try:
        async with aio_channel(f"127.0.0.1:{port}", "tok-a") as good:
            stub = worker_pb2_grpc.DecodeStub(good)
            assert (await stub.Status(worker_pb2.StatusRequest())).slots_total == 4
            events = [e.token_id async for e in stub.Generate(worker_pb2.GenerateRequest(request_id="r"))]
            assert events == [100, 101, 102]
            assert (await stub.Release(worker_pb2.ReleaseRequest())).released
        assert servicer.calls == 3
        async with aio_channel(f"127.0.0.1:{port}", "tok-of-another-service") as bad:
            stub = worker_pb2_grpc.DecodeStub(bad)
            with pytest.raises(grpc.aio.AioRpcError) as unary:
                await stub.Status(worker_pb2.StatusRequest())
            with pytest.raises(grpc.aio.AioRpcError) as stream:
                async for _ in stub.Generate(worker_pb2.GenerateRequest(request_id="r")):
                    pass
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as anonymous:
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await worker_pb2_grpc.DecodeStub(anonymous).Status(worker_pb2.StatusRequest())
        assert (unary.value.code(), stream.value.code(), missing.value.code()) == (UNAUTH, UNAUTH, UNAUTH)
        assert "missing 'authorization" in missing.value.details()
        assert servicer.calls == 3, "a refused call must never reach the handler"
    finally:
        await server.stop(None)


def test_tls_config_from_env_and_its_errors(tmp_path: Path) -> None:
    assert TLSConfig.from_env({}) is None
    tls = TLSConfig.from_env({"PDSERVE_TLS_CA": "/ca.pem", "PDSERVE_TLS_SERVER_NAME": "broker.ns.svc"})
    assert tls == TLSConfig(ca_file=Path("/ca.pem"), server_name="broker.ns.svc")
    with pytest.raises(ValueError, match="needs cert_file and key_file"):
        TLSConfig(ca_file=tmp_path / "ca.pem").server_credentials()
    with pytest.raises(ValueError, match="cannot read TLS key file .*missing.pem"):
        TLSConfig(cert_file=tmp_path / "c.pem", key_file=tmp_path / "missing.pem").server_credentials()


# ---- credentials by role (issue #29) ------------------------------------------------------------


def test_role_tokens_are_derived_one_way_and_resolve_to_their_role() -> None:
    from pdserve_common.auth import SERVICE_ROLE, Principal, role_of_token, role_token

    table = TokenTable({"ns/a": "tok-a"})
    router, decode = role_token("tok-a", "router"), role_token("tok-a", "decode")
    assert router.startswith("pdr1.router.") and role_of_token(router) == "router" and role_of_token("tok-a") is None
    assert "tok-a" not in router and router != role_token("tok-b", "router") and router != decode
    assert table.principal("tok-a") == Principal("ns/a", SERVICE_ROLE)
    assert table.principal(router) == Principal("ns/a", "router")
    assert table.verify("ns/a", "tok-a") and not table.verify("ns/a", router)  # a role token is not the service's
    assert table.principal(role_token("tok-a", "decode")[:-1] + "0") is None  # a forged MAC is unknown
    with pytest.raises(ValueError, match="role must be one of"):
        role_token("tok-a", "operator")


def test_a_workers_table_admits_only_the_digests_it_was_given() -> None:
    from pdserve_common.auth import role_token, token_digest
    from pdserve_common.credentials import pod_env, secret_data

    data = secret_data("tok-a")
    decode_env = pod_env("tok-a", "decode")
    assert decode_env["PDSERVE_BROKER_TOKEN"] == role_token("tok-a", "decode")
    assert "tok-a" not in "".join(decode_env.values())  # no pod gets the service token
    assert "PDSERVE_KV_CAPABILITY_KEY" in decode_env and "PDSERVE_KV_CAPABILITY_KEY" not in pod_env("tok-a", "prefill")
    assert set(pod_env("tok-a", "router")) == {"PDSERVE_BROKER_TOKEN", "PDSERVE_EPP_ACCEPT_TOKEN_DIGESTS"}
    table = TokenTable()
    table.accept("ns/a", dict(item.split(":") for item in data["accept-prefill"].split(",")))
    assert table.service_for(role_token("tok-a", "router")) == "ns/a"
    assert table.service_for("tok-a") == "ns/a"  # the operator's token, by its digest
    assert table.service_for(role_token("tok-a", "decode")) is None  # nobody but routers calls a prefill
    with pytest.raises(ValueError, match="accepted roles"):
        table.accept("ns/a", {"admin": token_digest("x")})
    with pytest.raises(ValueError, match="hex SHA-256"):
        table.accept("ns/a", {"router": "zz"})


@pytest.mark.asyncio
async def test_the_policy_refuses_a_role_before_the_handler_and_tells_the_handler_who_called() -> None:
    from pdserve_common.auth import caller, role_token
    from pdserve_common.channels import WORKER_POLICY

    seen: list[str] = []

    class Decode(EchoDecode):
        async def Status(self, request, context):
            seen.append(caller().role)
            return await super().Status(request, context)

    servicer = Decode()
    server = aio_server(TokenTable({"ns/a": "tok-a"}), policy=WORKER_POLICY)
    worker_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
    port = bind(server, "127.0.0.1", 0)
    await server.start()
    try:
        for token in (role_token("tok-a", "router"), "tok-a"):
            async with aio_channel(f"127.0.0.1:{port}", token) as channel:
                await worker_pb2_grpc.DecodeStub(channel).Status(worker_pb2.StatusRequest())
        assert seen == ["router", "service"]
        for role in ("decode", "prefill"):
            async with aio_channel(f"127.0.0.1:{port}", role_token("tok-a", role)) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await worker_pb2_grpc.DecodeStub(channel).Status(worker_pb2.StatusRequest())
            assert refused.value.code() == DENIED and f"a {role}'s token may not call" in refused.value.details()
        assert servicer.calls == 2
    finally:
        await server.stop(None)


def test_a_live_member_is_replaced_only_with_its_own_lease() -> None:
    from pdserve_common.membership import MemberInfo, Role
    from pdserve_operator.broker.registry import MemberTaken, Registry

    registry = Registry(ttl_s=10.0)
    info = MemberInfo(worker_id="prefill-0", role=Role.PREFILL, grpc_endpoint="10.0.0.1:1")
    first = registry.register("ns/a", info)
    moved = MemberInfo(worker_id="prefill-0", role=Role.PREFILL, grpc_endpoint="6.6.6.6:1")
    with pytest.raises(MemberTaken, match="only its own lease replaces it"):
        registry.register("ns/a", moved, may_replace=False)
    with pytest.raises(MemberTaken):
        registry.register("ns/a", moved, may_replace=False, replaces="a-guess")
    assert [m.info.grpc_endpoint for m in registry.members("ns/a")] == ["10.0.0.1:1"]
    second = registry.register("ns/a", info, may_replace=False, replaces=first.lease_id)  # the member itself
    assert second.lease_id != first.lease_id
    registry.register("ns/a", moved)  # the service token may
    assert [m.info.grpc_endpoint for m in registry.members("ns/a")] == ["6.6.6.6:1"]


def test_every_worker_method_is_named_in_the_policy() -> None:
    """A method the policy does not name is open to every role (auth.py): a new RPC of a worker
    service (shard.proto's PushHandoff, say) must say who may call it, or this fails."""
    from pdserve.v1 import shard_pb2, worker_pb2
    from pdserve_common.channels import WORKER_POLICY

    methods = {
        f"/{service.full_name}/{method.name}"
        for module in (worker_pb2, shard_pb2)
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    }
    assert len(methods) > 10
    assert methods - set(WORKER_POLICY) == set()
    assert WORKER_POLICY["/pdserve.v1.DecodeShard/PushHandoff"] == frozenset({"decode"})
