"""Review of issue 13: what one service's token can make the broker hold.

The operator's broker is shared by every service of the cluster, and any pod of a service
holds its token. Before, a Register was bounded only by the 4 MiB message limit and a
service's members not at all: 300 registrations with 3 MiB of labels each, in 11 s, grew
pdserve local's broker from 337 MB to 1.2 GB; against the operator (512 Mi limit) one
compromised pod of one service OOM-kills the broker of all of them. Now a member's
description is at most 16 KiB and a service has at most `PDSERVE_BROKER_MAX_MEMBERS`
(default 4,096) members; past that a new worker id is RESOURCE_EXHAUSTED while the
members already there renew and re-register as before. The deployment runs with 32.
"""

from __future__ import annotations

import grpc
import pytest

from pdserve.v1 import broker_pb2, broker_pb2_grpc
from security.conftest import BROKER_MAX_MEMBERS

pytestmark = pytest.mark.slow


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_one_services_token_cannot_make_the_broker_hold_much(local):
    broker_pid = local.child("broker")["pid"]
    metadata = (("authorization", f"Bearer {local.token}"),)
    service = local.manifest["service"]
    before = rss_mib(broker_pid)
    with grpc.insecure_channel(local.manifest["broker"], options=[("grpc.max_send_message_length", 8 << 20)]) as ch:
        stub = broker_pb2_grpc.BrokerStub(ch)

        def register(worker_id: str, pad: int) -> broker_pb2.RegisterReply:
            info = broker_pb2.MemberInfo(worker_id=worker_id, role=broker_pb2.ROLE_ROUTER, labels={"pad": "x" * pad})
            return stub.Register(
                broker_pb2.RegisterRequest(service_key=service, member=info), metadata=metadata, timeout=5
            )

        with pytest.raises(grpc.RpcError) as big:
            register("fat", 3 << 20)  # 3 MiB of labels
        assert big.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        leases, refused = [], 0
        for i in range(2 * BROKER_MAX_MEMBERS):
            try:
                leases.append(register(f"fake-{i}", 8 << 10).lease_id)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                refused += 1
        existing = len(local.manifest["children"]) - 1  # the deployment's own members (not the broker)
        assert len(leases) == BROKER_MAX_MEMBERS - existing and refused == 2 * BROKER_MAX_MEMBERS - len(leases)
        leases[0] = register("fake-0", 100).lease_id  # a member already there may register again
        for lease in leases:
            stub.Deregister(
                broker_pb2.DeregisterRequest(service_key=service, lease_id=lease), metadata=metadata, timeout=5
            )
    assert rss_mib(broker_pid) - before < 64
