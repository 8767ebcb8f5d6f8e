"""Prefill worker side: each layer's KV of the requests in this step goes, one-sided, into the
blocks their decodes reserved, right after the layer is computed.

The scheduler side hands over a `PushOrder` per request in the step (its grant, its own block
ids and the decode's for the blocks this step computed, whether its prefill ends here).
`save_layer` (vLLM's `save_kv_layer`) issues one asynchronous WRITE per request for that
layer, so the transfer overlaps the next layers' compute; `end_step` (vLLM's `wait_for_save`)
waits for every put of the step (the blocks are the scheduler's again after it) and sends each
finished request's decode its `kv_ready` notify: ok when every put landed, not ok when one
failed (the decode then recomputes instead of waiting out its timeout).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve_common.logs import kv
from pdserve_worker.engines.vllm.grant import READY_NOTIFY, KVGeometry, VllmGrant, ready_message
from pdserve_worker.engines.vllm.plane import KVPlane
from pdserve_worker.transfer.base import TransferBackend
from pdserve_worker.transfer.hixl_api import status_name

log = logging.getLogger(__name__)

NOTIFY_TIMEOUT_MS = 2000


@dataclass(frozen=True)
class PushOrder:
    """One request's share of a step: its blocks `src` go to the decode's `dst` (same order)."""

    grant: VllmGrant
    src: tuple[int, ...]
    dst: tuple[int, ...]
    final: bool  # the prompt's last tokens are computed in this step: notify after it
    error: str = ""  # set by the scheduler side: push nothing, tell the decode it failed


@dataclass
class _Push:
    order: PushOrder
    requests: list[int] = field(default_factory=list)  # the engine's request ids in flight
    error: str = ""
    puts: int = 0


def pair_spans(
    geometry: KVGeometry, peer: KVGeometry, layer: int, pairs: Sequence[tuple[int, int]]
) -> list[tuple[int, int, int]]:
    """(source address, target address, bytes) of layer `layer`'s block pairs, runs of blocks
    consecutive on both sides merged into one descriptor."""
    spans: list[tuple[int, int, int]] = []
    size = geometry.block_bytes
    merge = geometry.block_stride == size and peer.block_stride == size
    for src_base, dst_base in zip(geometry.planes[layer], peer.planes[layer]):
        run_start = len(spans)
        for s, d in pairs:
            src, dst = src_base + s * geometry.block_stride, dst_base + d * peer.block_stride
            if merge and len(spans) > run_start:
                a, b, n = spans[-1]
                if a + n == src and b + n == dst:
                    spans[-1] = (a, b, n + size)
                    continue
            spans.append((src, dst, size))
    return spans


class PrefillPusher:
    """The prefill's worker side of the connector (module doc)."""

    def __init__(self, plane: KVPlane) -> None:
        self.plane = plane
        self._layer_index: dict[str, int] = {}
        self._step: list[_Push] = []
        self.counts: Counter[str] = Counter()  # puts, bytes, notifies, failures: what the tests read

    def registered(self, geometry: KVGeometry) -> None:
        self._layer_index = {name: i for i, name in enumerate(geometry.layer_names)}

    def start_step(self, orders: Sequence[PushOrder]) -> None:
        """The step's orders: each checked against this cache and connected before its first put."""
        backend, geometry = self._backend(), self.plane.geometry
        assert geometry is not None
        self._step = []
        for order in orders:
            push = _Push(order, error=order.error)
            if push.error:
                self._step.append(push)
                continue
            try:
                peer = order.grant.geometry
                assert peer is not None  # (from_wire makes it)
                geometry.check_matches(peer)
                if len(order.src) != len(order.dst) or max(order.src, default=0) >= geometry.num_blocks:
                    raise ValueError(f"{len(order.src)} source blocks for {len(order.dst)} targets")
                backend.ensure_connected(order.grant.engine_id, 2000)
            except (ValueError, RuntimeError) as exc:
                push.error = f"push to {order.grant.describe()} refused: {exc}"
            self._step.append(push)

    def save_layer(self, layer_name: str) -> None:
        """After layer `layer_name` is computed: put its blocks of every request of the step."""
        if not self._step:
            return
        layer = self._layer_index.get(layer_name)
        if layer is None:
            raise KeyError(f"layer {layer_name!r} has no registered KV cache")
        backend, geometry = self._backend(), self.plane.geometry
        assert geometry is not None
        api = backend.api
        for push in self._step:
            if push.error or not push.order.src:
                continue
            peer = push.order.grant.geometry
            assert peer is not None
            spans = pair_spans(geometry, peer, layer, list(zip(push.order.src, push.order.dst)))
            descs = [api.TransferOpDesc(s, d, n) for s, d, n in spans]
            status, req = backend.engine.transfer_async(push.order.grant.engine_id, api.TransferOp.WRITE, descs)
            if status != api.SUCCESS:
                push.error = f"put of layer {layer_name} to {push.order.grant.describe()}: {status_name(status)}"
                continue
            push.requests.append(req)
            push.puts += 1
            self.counts["puts"] += 1
            self.counts["bytes"] += sum(n for _, _, n in spans)

    def end_step(self) -> None:
        """Wait for the step's puts; notify the decodes whose prompt is complete."""
        step, self._step = self._step, []
        for push in step:
            started = time.perf_counter()
            self._settle(push)
            settled_ms = (time.perf_counter() - started) * 1000
            if push.error:
                self.counts["failed"] += 1
                log.warning(kv(event="vllm_push_failed", request=push.order.grant.request_id, error=push.error))
            if push.order.final or push.error:
                self._notify(push.order.grant, ok=not push.error)
            grant = push.order.grant
            log.info(
                kv(
                    event="vllm_kv_pushed",
                    request=grant.request_id,
                    tag=grant.tag,
                    puts=push.puts,
                    blocks=len(push.order.src),
                    final=push.order.final,
                    ok=not push.error,
                    settle_ms=f"{settled_ms:.1f}",  # waiting for the step's last puts after its forward
                )
            )

    def _settle(self, push: _Push) -> None:
        backend = self._backend()
        api = backend.api
        deadline = time.monotonic() + self.plane.settings.push_timeout_s
        for req in push.requests:
            while True:
                if backend.blocking is not None:
                    backend.blocking.wait_transfer(req, max(0.0, min(0.05, deadline - time.monotonic())))
                status, state = backend.engine.get_transfer_status(req)
                if status == api.SUCCESS and state == api.TransferStatus.WAITING:
                    if time.monotonic() > deadline:
                        push.error = push.error or f"a put to {push.order.grant.describe()} timed out"
                        backend.engine.disconnect(push.order.grant.engine_id, 1000)  # HIXL's advice
                        break
                    if backend.blocking is None:
                        time.sleep(0.0002)
                    continue
                if status != api.SUCCESS or state != api.TransferStatus.COMPLETED:
                    push.error = push.error or f"a put to {push.order.grant.describe()} failed: {status_name(status)}"
                break
        push.requests.clear()

    def _notify(self, grant: VllmGrant, ok: bool) -> None:
        backend = self._backend()
        api = backend.api
        desc = api.NotifyDesc(READY_NOTIFY, ready_message(grant.request_id, grant.nonce, grant.num_tokens, ok))
        deadline = time.monotonic() + self.plane.settings.push_timeout_s
        while True:
            status = backend.engine.send_notify(grant.engine_id, desc, NOTIFY_TIMEOUT_MS)
            if status == api.SUCCESS:
                self.counts["notifies"] += 1
                return
            if status != api.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                self.counts["notify_failed"] += 1
                log.warning(kv(event="vllm_ready_notify_failed", grant=grant.describe(), status=status_name(status)))
                return
            time.sleep(0.001)  # the decode's notify queue is full: it drains every step

    def _backend(self) -> TransferBackend:
        if self.plane.backend is None:
            raise RuntimeError("the prefill's KV plane is not open (register_kv_caches did not run)")
        return self.plane.backend
