"""The operator's view of the broker: the seam between reconciling and the gRPC broker.

Reconciling needs three things of the broker: tell it a service's token, forget a deleted
service, and read how many workers of each role registered. `BrokerView` is that much and no
more, so the reconciler is tested with a fake and runs with no broker at all (`NullBrokerView`:
tokens are still generated and handed to pods, counts are reported as unknown).
`load_broker()` starts the real `pdserve_operator.broker.server.BrokerServer` when it is importable.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pdserve_common.logs import kv

if TYPE_CHECKING:
    from pdserve_common.membership import Member

log = logging.getLogger("pdserve.operator.broker_view")


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

    # Optional: `kv_tokens_in_use(service_key) -> int | None` (decode KV tokens reserved across the
    # service); read through `kv_tokens_in_use` below, so a view without it reports unknown.


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

    def __init__(self, server: Any) -> None:
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
        # Optional in the broker's interface: a broker that does not track slots says so by lacking it.
        fn = getattr(self.server, "slots_in_use", None)
        return None if fn is None else fn(service_key)

    def members(self, service_key: str) -> list[Member] | None:
        members: list[Member] = self.server.registry.members(service_key)
        return members

    def set_draining(self, service_key: str, worker_id: str, draining: bool) -> bool:
        return bool(self.server.registry.set_draining(service_key, worker_id=worker_id, draining=draining))

    def kv_tokens_in_use(self, service_key: str) -> int | None:
        fn = getattr(self.server, "kv_tokens_in_use", None)
        return None if fn is None else fn(service_key)


def kv_tokens_in_use(view: object, service_key: str) -> int | None:
    """A view's KV tokens in use, None for a view (an older fake) that does not tell."""
    fn = getattr(view, "kv_tokens_in_use", None)
    return None if fn is None else fn(service_key)


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
