"""The operator's view of the broker: the seam between reconciling and the gRPC broker.

Reconciling and autoscaling need this much of the broker, and `BrokerView` declares all of it:
every view (`BrokerServerView` on a running `pdserve_operator.broker.server.BrokerServer`,
`NullBrokerView` when none runs, the tests' fakes) implements every member, and a view that does
not know an answer returns None; nothing is probed. `load_broker()` starts the real broker when
this build has it; without one, tokens are still generated and handed to pods.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pdserve_common.logs import kv

if TYPE_CHECKING:
    from pdserve_common.membership import Member
    from pdserve_operator.broker.server import BrokerServer

log = logging.getLogger(__name__)


@runtime_checkable
class BrokerView(Protocol):
    def set_service_token(self, service_key: str, token: str) -> None:
        """Accept registrations for `service_key` ("namespace/name") carrying `token`."""

    def remove_service(self, service_key: str) -> None:
        """Forget a deleted service: its token and its workers' leases."""

    def registered_counts(self, service_key: str) -> Mapping[str, int] | None:
        """Workers registered per role ("prefill", "decode", "router"); None when unknown."""

    def slots_in_use(self, service_key: str) -> int | None:
        """Decode slots currently reserved across the service; None when unknown."""

    def members(self, service_key: str) -> list[Member] | None:
        """Every registered worker with its last reported load (the autoscaler's input); None when unknown."""

    def set_draining(self, service_key: str, worker_id: str, draining: bool) -> bool:
        """Mark a worker draining (no new requests) or active again; False when it is not registered."""

    def kv_tokens_in_use(self, service_key: str) -> int | None:
        """Decode KV tokens reserved across the service; None when unknown."""


class NullBrokerView:
    """No broker in this process: remember tokens (for tests and logs), know no counts."""

    def __init__(self) -> None:
        self.tokens: dict[str, str] = {}

    def set_service_token(self, service_key: str, token: str) -> None:
        self.tokens[service_key] = token

    def remove_service(self, service_key: str) -> None:
        self.tokens.pop(service_key, None)

    def registered_counts(self, service_key: str) -> Mapping[str, int] | None:
        return None

    def slots_in_use(self, service_key: str) -> int | None:
        return None

    def members(self, service_key: str) -> list[Member] | None:
        return None

    def set_draining(self, service_key: str, worker_id: str, draining: bool) -> bool:
        return False

    def kv_tokens_in_use(self, service_key: str) -> int | None:
        return None


class BrokerServerView:
    """Adapts a running `BrokerServer` to `BrokerView`."""

    def __init__(self, server: BrokerServer) -> None:
        self.server = server

    def set_service_token(self, service_key: str, token: str) -> None:
        self.server.set_service_token(service_key, token)

    def remove_service(self, service_key: str) -> None:
        self.server.remove_service(service_key)

    def registered_counts(self, service_key: str) -> Mapping[str, int] | None:
        # Roles may come as an enum; status speaks their string values.
        counts = self.server.registered_counts(service_key)
        return {str(getattr(role, "value", role)): int(n) for role, n in counts.items()}

    def slots_in_use(self, service_key: str) -> int | None:
        return None  # the broker tracks KV tokens (`kv_tokens_in_use`), not slots

    def members(self, service_key: str) -> list[Member] | None:
        members: list[Member] = self.server.registry.members(service_key)
        return members

    def set_draining(self, service_key: str, worker_id: str, draining: bool) -> bool:
        return bool(self.server.registry.set_draining(service_key, worker_id=worker_id, draining=draining))

    def kv_tokens_in_use(self, service_key: str) -> int | None:
        return self.server.kv_tokens_in_use(service_key)


def load_broker(host: str, port: int, tls: Any = None) -> tuple[BrokerView, Any | None]:
    """Start the gRPC broker if this build has one; returns (view, server or None).

    The broker module is optional at this layer: an operator built before it existed, or a
    test without gRPC, still reconciles.
    """
    try:
        module = importlib.import_module("pdserve_operator.broker.server")
    except ModuleNotFoundError as exc:
        if exc.name != "pdserve_operator.broker.server":
            raise  # the broker exists but something it needs is missing: that is a real error
        log.warning(kv(event="broker_unavailable", reason="pdserve_operator.broker.server not installed"))
        return NullBrokerView(), None
    server = module.BrokerServer(tls=tls)
    bound = server.start(host, port)
    log.info(kv(event="broker_started", host=host, port=bound, tls=tls is not None))
    return BrokerServerView(server), server
