"""Decode worker side: blocks vLLM's scheduler reserved become writable for one push, and the
request runs once its `kv_ready` notify (with the reservation's nonce) arrives.

Per step (`start_step`), for each new reservation: lease its blocks in every layer (the host
engine then refuses a WRITE anywhere else), and announce the grant (engine, geometry, block
ids, nonce) to the grant sink, pdserve's decode worker, which hands it to the prefill. For each
reservation that ended before its KV came (aborted): revoke the leases, keep the blocks in
quarantine for `quarantine_s` (a write checked before the revoke may still land), then report
them done so vLLM frees them. `finished` (vLLM's `get_finished`, every step) drains the
notifies: a ready one with the right nonce and tokens revokes the leases and reports the
request loaded; a failed one, an announce that failed, or no notify within `ready_timeout_s`
report it received and failed, so vLLM recomputes the prompt locally.
Every reservation leaves through exactly one of these, and its leases go with it.
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve_common.logs import kv
from pdserve_worker.engines.vllm.grant import READY_NOTIFY, VllmGrant, parse_ready
from pdserve_worker.engines.vllm.plane import KVPlane
from pdserve_worker.transfer.base import TransferBackend

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.01  # at most this long an idle decode step sleeps for a notify (a new request waits as long)


@dataclass(frozen=True)
class Reservation:
    """What the scheduler side decided for one request: its blocks and its nonce."""

    request_id: str
    nonce: str
    num_tokens: int
    first_block: int
    block_ids: tuple[int, ...]
    tag: str = ""


@dataclass
class _Waiting:
    grant: VllmGrant
    deadline: float
    leases: list[int] = field(default_factory=list)


class DecodeReceiver:
    """The decode's worker side of the connector (module doc)."""

    def __init__(self, plane: KVPlane) -> None:
        self.plane = plane
        self._waiting: dict[str, _Waiting] = {}
        self._quarantine: dict[str, float] = {}  # request id -> when its blocks may be freed
        self._loaded: set[str] = set()
        self._failed: set[str] = set()
        self._sink: socket.socket | None = None
        self.counts: Counter[str] = Counter()  # grants, ready, failed, timeouts, aborted, dropped

    def start_step(self, new: Sequence[Reservation], ended: Sequence[str]) -> None:
        for reservation in new:
            self._grant(reservation)
        for request_id in ended:
            waiting = self._waiting.pop(request_id, None)
            if waiting is not None:
                self._revoke(waiting)
                self._quarantine[request_id] = time.monotonic() + self.plane.settings.quarantine_s
                self.counts["aborted"] += 1
                log.info(
                    kv(event="vllm_grant_aborted", request=request_id, quarantine_s=self.plane.settings.quarantine_s)
                )

    def _grant(self, reservation: Reservation) -> None:
        backend, geometry = self._backend(), self.plane.geometry
        assert geometry is not None
        grant = VllmGrant(
            request_id=reservation.request_id,
            engine_id=self.plane.engine_id,
            nonce=reservation.nonce,
            num_tokens=reservation.num_tokens,
            first_block=reservation.first_block,
            block_ids=reservation.block_ids,
            geometry=geometry,
            tag=reservation.tag,
        )
        waiting = _Waiting(grant, time.monotonic() + self.plane.settings.ready_timeout_s)
        self._waiting[grant.request_id] = waiting
        self.counts["grants"] += 1
        try:
            if backend.host is not None:
                for layer in range(len(geometry.layer_names)):
                    for addr, length in geometry.block_spans(layer, grant.block_ids):
                        status, lease = backend.host.lease_write(addr, length)
                        backend.check(status, f"lease_write of {length} bytes for {grant.describe()}")
                        waiting.leases.append(lease)
            self._announce(grant)
        except (OSError, RuntimeError, ValueError) as exc:
            log.warning(kv(event="vllm_grant_failed", grant=grant.describe(), error=exc))
            self._fail(grant.request_id, "grant_failed")

    def _announce(self, grant: VllmGrant) -> None:
        """One JSON line to the grant sink (kept connected; reconnected once if it dropped)."""
        line = (json.dumps({"grant": grant.to_wire()}, separators=(",", ":")) + "\n").encode()
        for attempt in (0, 1):
            if self._sink is None:
                host, _, port = self.plane.settings.grant_sink.rpartition(":")
                if not host:
                    raise ValueError(f"pdserve_grant_sink must be 'ip:port', got {self.plane.settings.grant_sink!r}")
                self._sink = socket.create_connection((host, int(port)), timeout=5)
            try:
                self._sink.sendall(line)
                return
            except OSError:
                self._sink.close()
                self._sink = None
                if attempt:
                    raise

    def finished(self, idle: bool = False) -> tuple[set[str], set[str]]:
        """(requests done receiving: KV in place, failed over, or an abort's quarantine over;
        those of them whose KV failed, for vLLM to recompute). `idle`: the step ran no forward,
        so while a reservation waits, sleep on the engine's notify inbox (up to IDLE_WAIT_S,
        woken by the notify) instead of letting vLLM's loop spin a core against the prefill."""
        backend = self._backend()
        if idle and self._waiting and backend.blocking is not None:
            status, items = backend.blocking.wait_notifies(IDLE_WAIT_S)
        else:
            status, items = backend.engine.get_notifies()
        if status == backend.api.SUCCESS:
            for item in items:
                self._file(item.name, item.notify_msg)
        now = time.monotonic()
        for request_id in [r for r, w in self._waiting.items() if w.deadline <= now]:
            self.counts["timeouts"] += 1
            log.warning(
                kv(event="vllm_ready_timeout", request=request_id, timeout_s=self.plane.settings.ready_timeout_s)
            )
            self._fail(request_id, "timeout")
        for request_id in [r for r, until in self._quarantine.items() if until <= now]:
            del self._quarantine[request_id]
            self._loaded.add(request_id)  # (vLLM frees an aborted waiter's blocks on it)
        loaded, self._loaded = self._loaded, set()
        failed, self._failed = self._failed, set()
        return loaded, failed

    def _file(self, name: str, text: str) -> None:
        if name != READY_NOTIFY:
            self.counts["dropped_other"] += 1
            return
        try:
            request_id, nonce, num_tokens, ok = parse_ready(text)
        except ValueError:
            self.counts["dropped_malformed"] += 1
            return
        waiting = self._waiting.get(request_id)
        if waiting is None or not hmac.compare_digest(nonce, waiting.grant.nonce):
            self.counts["dropped_bad_capability"] += 1  # forged, or late for an ended reservation
            return
        if not ok or num_tokens != waiting.grant.num_tokens:
            self._fail(request_id, "push_failed")
            return
        del self._waiting[request_id]
        self._revoke(waiting)
        self._loaded.add(request_id)
        self.counts["ready"] += 1
        log.info(kv(event="vllm_kv_ready", request=request_id, tag=waiting.grant.tag, tokens=num_tokens))

    def _fail(self, request_id: str, why: str) -> None:
        """The KV will not come: report the request loaded with its blocks invalid (recompute)."""
        waiting = self._waiting.pop(request_id)
        self._revoke(waiting)
        self._failed.add(request_id)
        self._loaded.add(request_id)
        self.counts["failed"] += 1
        log.info(kv(event="vllm_kv_recompute", request=request_id, reason=why))

    def _revoke(self, waiting: _Waiting) -> None:
        backend = self._backend()
        if backend.host is not None:
            for lease in waiting.leases:
                backend.host.revoke_write(lease)
        waiting.leases.clear()

    def pending(self) -> bool:
        """Whether a reservation or a quarantine still needs this worker's steps."""
        return bool(self._waiting or self._quarantine)

    def close(self) -> None:
        for request_id in list(self._waiting):
            self._revoke(self._waiting.pop(request_id))
        if self._sink is not None:
            self._sink.close()
            self._sink = None

    def _backend(self) -> TransferBackend:
        if self.plane.backend is None:
            raise RuntimeError("the decode's KV plane is not open (register_kv_caches did not run)")
        return self.plane.backend
