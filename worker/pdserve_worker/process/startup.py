"""What every model process of a worker starts with, shared by `pdserve worker` (worker_main)
and the other ranks of a tensor-parallel instance (rank_main): the transfer engine and the model engine."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from pdserve_common.logs import kv
from pdserve_worker.serving.settings import WorkerSettings

if TYPE_CHECKING:
    from pdserve_worker.engines.base import Engine
    from pdserve_worker.transfer.base import TransferBackend

log = logging.getLogger(__name__)


class StartupError(RuntimeError):
    """The worker cannot start (bad model, taken port, broker refused it); the message says why."""


def start_engine(settings: WorkerSettings) -> TransferBackend:
    """The transfer engine, initialized. A prefill connects out only: it listens on no transfer
    port. A decode admits only peers holding the service's link key, and (unless it is a group
    follower, which keeps no slot table) lets them write only into
    reserved slots (service_link.py); a tensor-parallel decode's other ranks too, leased by rank 0's
    table over the group (ranks/decode.py)."""
    from pdserve_worker.decode.layer_shards import is_follower
    from pdserve_worker.transfer.registry import create_engine
    from pdserve_worker.transfer.service_link import engine_options, local_engine_id

    backend = create_engine(settings.transfer_backend)
    engine_id = local_engine_id(settings.role, settings.advertise_host, settings.transfer_port)
    options = engine_options(
        backend.name,
        settings.kv_keys().link,
        settings.engine_options,
        leased_writes=settings.role == "decode" and not is_follower(settings),
    )
    status = backend.engine.initialize(engine_id, options)
    if status != backend.api.SUCCESS:
        raise StartupError(f"transfer engine {engine_id} failed to initialize: status {status}")
    if not settings.kv_digest:
        backend.digest = None  # (transfer/digest.py: pushes carry none, ready messages need none)
    log.info(kv(event="transfer_engine_started", backend=backend.name, engine=engine_id, kv_digest=backend.digest))
    return backend


def load_model_engine(
    settings: WorkerSettings, layers: range | None = None, tp: tuple[int, int] | None = None, reduce: Any = None
) -> Engine:
    """The model engine `settings.engine` names (engines/registry.py), loaded with the model:
    a layer-sharded member's `layers`, a tensor-parallel rank's (size, rank) share."""
    from pdserve_worker.engines.base import EngineLoad
    from pdserve_worker.engines.registry import load_engine

    request = EngineLoad(
        source=settings.model_path,
        dtype=settings.model_dtype,
        device=settings.device,
        weights=settings.weights,
        max_length=settings.max_length,
        layers=layers,
        tp=tp,
        reduce=reduce,
    )
    return load_engine(settings.engine, request)
