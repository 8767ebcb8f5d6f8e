"""The operator's broker, faked for the e2e tests that run the operator in process: it records
the service tokens it is given and reports the counts, slots and loads a test sets."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class FakeBroker:
    """Stands in for the gRPC broker: records tokens, reports counts the test sets."""

    def __init__(self) -> None:
        self.tokens: dict[str, str] = {}
        self.removed: list[str] = []
        self.counts: dict[str, dict[str, int]] = {}
        self.slots: dict[str, int] = {}
        self.loads: dict[str, list[Any]] = {}
        self.draining: dict[tuple[str, str], bool] = {}
        self.token_calls = 0

    def set_service_token(self, service_key: str, token: str) -> None:
        self.tokens[service_key] = token
        self.token_calls += 1

    def remove_service(self, service_key: str) -> None:
        self.tokens.pop(service_key, None)
        self.removed.append(service_key)

    def registered_counts(self, service_key: str) -> Mapping[str, int] | None:
        return self.counts.get(service_key, {})

    def slots_in_use(self, service_key: str) -> int | None:
        return self.slots.get(service_key)

    def members(self, service_key: str) -> list[Any] | None:
        """The autoscaler's input: members with loads the test set (`pdserve_common.membership.Member`)."""
        return list(self.loads.get(service_key, []))

    def set_draining(self, service_key: str, worker_id: str, draining: bool) -> bool:
        self.draining[(service_key, worker_id)] = draining
        return any(m.worker_id == worker_id for m in self.loads.get(service_key, []))

    def kv_tokens_in_use(self, service_key: str) -> int | None:
        return None
