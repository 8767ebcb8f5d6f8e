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

from pdserve_common.logs import kv
from pdserve_operator import peering
from pdserve_operator.broker import tokens as broker_tokens
from pdserve_operator.broker.token_review import TokenReviewer
from pdserve_operator.broker.view import BrokerView, load_broker
from pdserve_operator.kube import RestKubeClient
from pdserve_operator.runtime import OperatorConfig, build_runtime, derived_priority

log = logging.getLogger(__name__)


def kopf_settings(config: OperatorConfig) -> kopf.OperatorSettings:
    from pdserve_operator import handlers

    settings = kopf.OperatorSettings()
    handlers.configure(settings)
    settings.peering.name = config.peering
    settings.peering.standalone = config.standalone
    # With replicas > 1 a missing peering CRD must stop the operator, not let replicas fight.
    settings.peering.mandatory = not config.standalone
    settings.peering.priority = config.priority if config.priority is not None else derived_priority()
    settings.peering.lifetime = config.peering_lifetime_seconds
    return settings


def run(
    config: OperatorConfig,
    *,
    stop_flag: threading.Event | asyncio.Event | None = None,
    ready_flag: threading.Event | asyncio.Event | None = None,
    broker: BrokerView | None = None,
    kube: RestKubeClient | None = None,
) -> None:
    """Block until the operator stops (stop_flag set, or a signal in the main thread)."""

    server: Any = None
    if broker is None:
        broker, server = load_broker(config.broker_host, config.broker_port, config.broker_tls())
    runtime = build_runtime(config, broker=broker, broker_server=server, kube=kube)
    if server is not None:  # pods prove which member they are by their identity tokens (#58 A4)
        server.member_credentials.set_review(TokenReviewer(runtime.kube))
    metrics_server = None
    if config.metrics_port:
        metrics_server, _ = runtime.metrics.serve(config.broker_host, config.metrics_port)
    try:
        config = check_peering(config, runtime.kube)
        if config.standalone or config.replicas == 1:  # the only replica: serve re-registrations at once
            broker_tokens.preload(runtime.kube, runtime.broker, config.namespaces)
        settings = kopf_settings(config)
        log.info(
            kv(
                event="operator_start",
                namespaces=",".join(config.namespaces) or "*",
                standalone=config.standalone,
                peering=config.peering,
                priority=settings.peering.priority,
            )
        )
        asyncio.run(_operate(config, settings, runtime, stop_flag, ready_flag))
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()
        runtime.close()
        log.info(kv(event="operator_stop"))


def check_peering(config: OperatorConfig, kube: RestKubeClient) -> OperatorConfig:
    """Before kopf starts: is the peering object there? If not, and this is known to be the only
    replica (`replicas == 1`), run standalone with a warning; otherwise kopf will wait paused, and
    `_report_peering` says what for until it appears."""
    if config.standalone:
        return config
    missing = peering.find_missing(kube, peering.peering_objects(config.peering, config.namespaces))
    if missing and config.replicas == 1:
        for m in missing:
            log.warning(
                kv(
                    event="peering_missing_standalone",
                    missing=m.what,
                    fix=m.fix,
                    detail="the only replica runs without peering: a second operator started by hand "
                    "would not be paused",
                )
            )
        return config.model_copy(update={"standalone": True})
    return config


async def _report_peering(config: OperatorConfig, kube: RestKubeClient) -> None:
    """While peering objects are missing, say so every `peering_report_seconds` (kopf is silent)."""
    objects = peering.peering_objects(config.peering, config.namespaces)
    reported = False
    while True:
        missing = await asyncio.to_thread(peering.find_missing, kube, objects)
        if not missing:
            if reported:
                log.info(kv(event="peering_found", peering=config.peering, detail="kopf resumes the handlers"))
            return
        for m in missing:
            log.warning(
                kv(
                    event="peering_missing",
                    waiting_for=str(m.obj),
                    missing=m.what,
                    fix=m.fix,
                    detail="kopf keeps every handler paused until it exists; with one replica, "
                    "--standalone runs without peering",
                )
            )
        reported = True
        await asyncio.sleep(config.peering_report_seconds)


async def _operate(
    config: OperatorConfig,
    settings: kopf.OperatorSettings,
    runtime: Any,
    stop_flag: threading.Event | asyncio.Event | None,
    ready_flag: threading.Event | asyncio.Event | None,
) -> None:
    from pdserve_operator import handlers

    reporter = None if config.standalone else asyncio.create_task(_report_peering(config, runtime.kube))
    try:
        await kopf.operator(
            registry=handlers.register(
                kopf.OperatorRegistry(), watch_leader_worker_sets=config.watch_leader_worker_sets
            ),
            settings=settings,
            clusterwide=not config.namespaces,
            namespaces=config.namespaces,
            liveness_endpoint=config.liveness,
            memo=kopf.Memo(runtime=runtime),
            stop_flag=stop_flag,
            ready_flag=ready_flag,
        )
    finally:
        if reporter is not None:
            reporter.cancel()
            try:
                await reporter
            except (asyncio.CancelledError, Exception):  # a failed lookup must not mask kopf's exit
                pass
