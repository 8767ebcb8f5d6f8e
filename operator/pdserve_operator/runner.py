"""Run the operator: the broker (when this build has it) plus kopf with our handlers.

`pdserve operator` calls `run()` in the main thread; the end-to-end tests call it in a thread
with their own stop flag and a fake broker, so both go through the same code.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import kopf

from pdserve_worker.logs import kv

from pdserve_operator.broker_view import BrokerView, load_broker
from pdserve_operator.kube import KubeClient
from pdserve_operator.runtime import OperatorConfig, build_runtime, derived_priority

log = logging.getLogger("pdserve.operator")


def kopf_settings(config: OperatorConfig) -> kopf.OperatorSettings:
    from pdserve_operator import handlers

    settings = kopf.OperatorSettings()
    handlers.configure(settings)
    settings.peering.name = config.peering
    settings.peering.standalone = config.standalone
    # With replicas > 1 a missing peering CRD must stop the operator, not let replicas fight.
    settings.peering.mandatory = not config.standalone
    settings.peering.priority = config.priority if config.priority is not None else derived_priority()
    return settings


def run(
    config: OperatorConfig,
    *,
    stop_flag: threading.Event | asyncio.Event | None = None,
    ready_flag: threading.Event | asyncio.Event | None = None,
    broker: BrokerView | None = None,
    kube: KubeClient | None = None,
) -> None:
    """Block until the operator stops (stop_flag set, or a signal in the main thread)."""
    from pdserve_operator import handlers  # registers the handlers in kopf's default registry

    server: Any = None
    if broker is None:
        broker, server = load_broker(config.broker_host, config.broker_port)
    runtime = build_runtime(config, events=handlers.post_event, broker=broker, broker_server=server, kube=kube)
    settings = kopf_settings(config)
    log.info(kv(event="operator_start", namespaces=",".join(config.namespaces) or "*",
                standalone=config.standalone, peering=config.peering, priority=settings.peering.priority))
    try:
        asyncio.run(
            kopf.operator(
                settings=settings,
                clusterwide=not config.namespaces,
                namespaces=config.namespaces,
                liveness_endpoint=config.liveness,
                memo=kopf.Memo(runtime=runtime),
                stop_flag=stop_flag,
                ready_flag=ready_flag,
            )
        )
    finally:
        runtime.close()
        log.info(kv(event="operator_stop"))
