"""pdserve's KV connector for vLLM: the class vLLM loads, which hands each call to its side.

Load it with `--kv-transfer-config '{"kv_connector": "PdserveConnector",
"kv_connector_module_path": "pdserve_worker.engines.vllm.connector", "kv_role":
"kv_consumer"|"kv_producer", "kv_connector_extra_config": {"pdserve_link_key": ...}}'`
(the keys: grant.ConnectorSettings). A consumer is a decode (scheduler.DecodeScheduler,
decode_worker.DecodeReceiver), a producer a prefill (scheduler.PrefillScheduler,
prefill_worker.PrefillPusher); kv_both is refused. The worker side sets up each step when vLLM
binds the step's metadata (before the forward: vLLM calls `start_load_kv` after it), pushes in
`save_kv_layer`, settles in `wait_for_save` and reports in `get_transfer_results`.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from pdserve_worker.engines.vllm.decode_worker import DecodeReceiver, Reservation
from pdserve_worker.engines.vllm.grant import ConnectorSettings
from pdserve_worker.engines.vllm.plane import KVPlane
from pdserve_worker.engines.vllm.prefill_worker import PrefillPusher, PushOrder
from pdserve_worker.engines.vllm.scheduler import DecodeScheduler, PrefillScheduler

log = logging.getLogger(__name__)


@dataclass
class PdserveMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's word from the scheduler side to the workers (pickled across processes)."""

    orders: list[PushOrder] = field(default_factory=list)  # prefill
    new: list[Reservation] = field(default_factory=list)  # decode
    ended: list[str] = field(default_factory=list)  # decode


def _role_of(config: Any) -> str:
    if config.kv_role == "kv_consumer":
        return "decode"
    if config.kv_role == "kv_producer":
        return "prefill"
    raise ValueError(
        f"PdserveConnector runs as kv_consumer (decode) or kv_producer (prefill), got kv_role={config.kv_role!r}"
    )


def _log_to_stderr() -> None:
    """vLLM configures only its own loggers: give pdserve's key=value lines a handler once."""
    root = logging.getLogger("pdserve_worker")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)


class PdserveConnector(KVConnectorBase_V1):  # type: ignore[misc]
    _cache_hit_source = CacheHitSource.P2P  # (vLLM's metrics: prompt tokens that came from a peer)

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_to_stderr()
        config = vllm_config.kv_transfer_config
        self.side = _role_of(config)
        self.settings = ConnectorSettings.parse(config.kv_connector_extra_config or {})
        self.block_tokens = int(vllm_config.cache_config.block_size)
        self.scheduler: DecodeScheduler | PrefillScheduler | None = None
        self.plane: KVPlane | None = None
        self.pusher: PrefillPusher | None = None
        self.receiver: DecodeReceiver | None = None
        self._idle_step = False  # this step ran no forward (start_load_kv saw no attention metadata)
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = (DecodeScheduler if self.side == "decode" else PrefillScheduler)(self.block_tokens)
        else:
            self.plane = KVPlane(self.settings, self.side)
            if self.side == "decode":
                self.receiver = DecodeReceiver(self.plane)
            else:
                self.pusher = PrefillPusher(self.plane)

    # ---- worker side ---------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self.plane is not None
        geometry = self.plane.open(kv_caches, self.block_tokens)
        if self.pusher is not None:
            self.pusher.registered(geometry)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if not isinstance(connector_metadata, PdserveMetadata):
            return
        if self.pusher is not None:
            self.pusher.start_step(connector_metadata.orders)
        elif self.receiver is not None:
            self.receiver.start_step(connector_metadata.new, connector_metadata.ended)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Nothing to load (the KV is pushed into our blocks); notes a step without a forward."""
        self._idle_step = getattr(forward_context, "attn_metadata", None) is None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        if self.pusher is not None:
            self.pusher.save_layer(layer_name)

    def wait_for_save(self) -> None:
        if self.pusher is not None:
            self.pusher.end_step()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self.receiver is None:
            return KVConnectorTransferResults()
        received, failed = self.receiver.finished(idle=self._idle_step)
        self._idle_step = False
        return KVConnectorTransferResults(finished_recving=received, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        if self.plane is not None:
            self.plane.close()

    # ---- scheduler side ------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> PdserveMetadata:
        if isinstance(self.scheduler, PrefillScheduler):
            return PdserveMetadata(orders=self.scheduler.build_connector_meta(scheduler_output))
        assert isinstance(self.scheduler, DecodeScheduler)
        step = self.scheduler.build_connector_meta()
        return PdserveMetadata(new=step.new, ended=step.ended)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request)

    def update_connector_output(self, connector_output: Any) -> None:
        if isinstance(self.scheduler, DecodeScheduler):
            self.scheduler.update_connector_output(list(connector_output.finished_recving or ()))

    def has_pending_push_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_push_work()
