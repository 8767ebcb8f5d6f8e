"""One worker process from start to stop: `pdserve worker --role prefill|decode|router|colocated`.

Start (each step visible on /healthz's `phase`): HTTP first, so probes answer while the model
loads; then the model, the transfer engine and the role's state; the gRPC server; last the
broker registration, after which /readyz turns 200: peers learn of a worker once it can serve.

Stop (SIGTERM or SIGINT, once; a second is ignored, the pod's grace period is the limit): /readyz
fails at once; a decode drains (up to the drain timeout); the worker leaves the broker, the gRPC
and HTTP servers stop (grace period for in-flight calls), the KV pool is deregistered, the
transfer engine finalized (no peer's write can still land), and only then the pool freed.

With TLS (settings.tls) every gRPC server requires a client certificate of the CA, every gRPC
client dials with its own, and the router serves HTTPS. The router role serves the OpenAI API
over `PDBackend`; the colocated role over one in-process Generator (no broker).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve_common.logs import kv
from pdserve_worker.process.pod_http import (
    ADMIN_HOST,
    PROBE_LIMITS,
    RunningServer,
    WorkerState,
    admin_app,
    health_routes,
    probe_app,
    serve_in_background,
    worker_app,
)
from pdserve_worker.process.startup import StartupError, start_engine
from pdserve_worker.serving.settings import WorkerSettings, epp_token_table, member_credential_source, model_revision
from pdserve_worker.util.fresh_thread import run_in_fresh_thread

if TYPE_CHECKING:
    from pdserve_worker.api.http_guard import HttpLimits
    from pdserve_worker.engines.base import Engine
    from pdserve_worker.process.roles import ServingRole
    from pdserve_worker.ranks.group import TPGroup
    from pdserve_worker.ranks.processes import Ranks
    from pdserve_worker.rpc.broker_client import BrokerClient
    from pdserve_worker.transfer.base import TransferBackend

log = logging.getLogger(__name__)

REGISTER_TIMEOUT_S = 120.0


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def resolve_model_folder(settings: WorkerSettings) -> Path:
    """The HF folder of the model: as given, or the GGUF's converted copy (converted once, cached)."""
    path = settings.model_path
    if path is not None and (Path(path) / "config.json").is_file():
        return Path(path)  # no torch needed (the router holds no weights)
    from pdserve_worker.model.loading.loader import model_folder

    return model_folder(path, settings.model_dtype)[0]


def served_name(settings: WorkerSettings, folder: Path) -> str:
    if settings.model_name:
        return settings.model_name
    marker = folder / "pdserve_source.json"
    if marker.is_file():
        return str(json.loads(marker.read_text()).get("name", folder.name))
    return folder.name


async def run_worker(settings: WorkerSettings) -> int:
    from pdserve_common import tracing

    # A no-op unless asked for (tracing.py); the router (and colocated) face clients: the edge.
    tracing.setup(f"pdserve-{settings.role}", settings.member_id, edge=settings.role in ("router", "colocated"))
    state = WorkerState(settings.role, settings.member_id)  # what /healthz and /readyz report
    try:
        async with _probe_listener(settings, state):
            if settings.role == "router":
                await _run_router(settings, state)
            elif settings.role == "colocated":
                await _run_colocated(settings, state)
            else:
                await _run_model_worker(settings, state)
    except StartupError as exc:
        log.error(kv(event="worker_start_failed", role=settings.role, error=str(exc)))
        return 1
    finally:
        tracing.shutdown()  # exports what is still buffered
    return 0


@contextlib.asynccontextmanager
async def _probe_listener(settings: WorkerSettings, state: WorkerState) -> AsyncIterator[None]:
    """The kubelet's port (pod_env.PROBE_PORT), when the pod has one: /healthz and /readyz of
    `state` for the process's whole life, on a listener that floods of the serving ports
    cannot fill (#58 A2). Stopped however the process ends."""
    if not settings.probe_port:
        yield
        return
    probe = _serve_or_fail(
        probe_app(state), settings.bind_host, settings.probe_port, settings, "probe", None, PROBE_LIMITS
    )
    try:
        yield
    finally:
        await probe.stop()


# ---- prefill and decode ---------------------------------------------------------------------------


def _admin_listener(settings: WorkerSettings, process: _Membership) -> Any:
    """The admin port (/drain, the preStop hook's): loopback only, and only a decode has one."""
    if settings.role != "decode":
        return None
    app = admin_app(process.tokens, process.drain)
    return _serve_or_fail(app, ADMIN_HOST, settings.admin_port, settings, "worker-admin")


async def _run_model_worker(settings: WorkerSettings, state: WorkerState) -> None:
    """A prefill, a decode or a decode group's follower, from start to stop (module doc)."""
    import grpc

    from pdserve_common.channels import WORKER_POLICY, aio_server
    from pdserve_worker.process.roles import grpc_max_message
    from pdserve_worker.serving.torch_threads import serve_with

    stop = _stop_event()
    process = _Membership(settings, state)
    http = _serve_or_fail(worker_app(process.state), settings.bind_host, settings.http_port, settings, "worker-http")
    # The admin port (/drain, the preStop hook's) listens on loopback only, and only a decode has one.
    admin = _admin_listener(settings, process)
    backend: TransferBackend | None = None
    server: grpc.aio.Server | None = None
    front: Any = None  # the gRPC port's per-address cap (pdserve_common/grpc_front.py)
    role: ServingRole | None = None
    ranks: Ranks | None = None  # a tensor-parallel instance's other ranks (ranks/processes.py)
    try:
        serve_with(settings.torch_threads)  # (serving/torch_threads.py)
        process.state.phase = "loading"
        ranks, settings, group = await _tp_group(settings)
        engine, revision = await _load_model(settings, group)
        backend = start_engine(settings)
        role = process.role = await _make_role(settings, engine, backend, revision, group)
        if role.metrics is not None:  # (a group's follower reports through its leader)
            process.state.metrics = role.metrics.exposition
        server = aio_server(
            process.tokens, max_message=grpc_max_message(settings, engine.config.hidden_size), policy=WORKER_POLICY
        )
        role.add_to(server)
        front = await _listen_or_fail(server, settings)
        await server.start()
        await role.start(process.broker)
        if stop.is_set():
            return
        await process.join(role)
        _ready(settings, engine.name, revision)
        await _until(stop, http.task)
        log.info(kv(event="worker_stopping", role=settings.role, worker=settings.member_id))
        await process.leave()
        if role.fatal:  # (exit non-zero: the pod's restart brings the instance back)
            raise StartupError(role.fatal)
    finally:
        process.state.phase = "stopping"
        await process.broker.close()
        if server is not None:
            await server.stop(settings.grace_seconds)  # calls in flight get the grace period
        if front is not None:
            await front.close()
        for running in (http, admin):
            if running is not None:
                await running.stop()
        _let_go(role, backend)
        if ranks is not None:
            ranks.stop()
        log.info(kv(event="worker_stopped", role=settings.role, worker=settings.member_id))


def _ready(settings: WorkerSettings, model: str, revision: str) -> None:
    """Serving from now on: the startup heap leaves the collector's sight (serving/gc_heap.py)."""
    from pdserve_worker.serving.gc_heap import freeze_startup_heap

    freeze_startup_heap()
    ready = {"grpc": settings.grpc_endpoint, "http": settings.http_port, "model": model, "revision": revision}
    log.info(kv(event="worker_ready", role=settings.role, worker=settings.member_id, **ready))


async def _tp_group(settings: WorkerSettings) -> tuple[Ranks | None, WorkerSettings, TPGroup | None]:
    """A tensor-parallel instance's rank 0 starts the other ranks and joins the group with them
    (ranks/processes.py); returns them, its settings with the rendezvous, and the group."""
    from pdserve_worker.ranks.group import TPGroup
    from pdserve_worker.ranks.processes import group_spec, start_ranks

    if settings.tensor_parallel == 1:
        return None, settings, None
    ranks, settings = start_ranks(settings)
    try:
        return ranks, settings, await run_in_fresh_thread(TPGroup, group_spec(settings))
    except (RuntimeError, ValueError) as exc:
        ranks.stop()
        raise StartupError(f"tensor-parallel group of {settings.tensor_parallel} did not form: {exc}") from exc


def _let_go(role: ServingRole | None, backend: TransferBackend | None) -> None:
    """Stop using the pool and deregister it, then stop the engine (its server first: no peer
    can be writing any more), and only then free the pool's memory."""
    if role is not None:
        role.close()
    if backend is not None:
        backend.engine.finalize()
    if role is not None:
        role.free()


class _Membership:
    """This process's place in its service: its phase (/healthz, /readyz), its broker
    registration, and the drain that /drain and the stop signal share."""

    def __init__(self, settings: WorkerSettings, state: WorkerState) -> None:

        self.settings = settings
        self.state = state
        self.broker: BrokerClient = broker_client(settings)
        self.tokens = settings.token_table()
        self.role: ServingRole | None = None
        self.registered = False
        self.marked_drain: asyncio.Task[None] | None = None  # the drain the operator's mark started

    async def join(self, role: ServingRole) -> None:
        """Register (a group's follower does not: its leader stands for the group); then ready."""
        from pdserve_worker.rpc.broker_client import BrokerError

        self.state.phase = "registering"
        info = role.member_info()
        if info is not None:
            try:
                # A decode acts on being marked draining by the operator (a scale-down): it
                # hands its requests over before its StatefulSet is lowered (docs/migration.md).
                on_mark = self._on_marked_draining if self.settings.role == "decode" else None
                await self.broker.register(
                    info, load=role.load, timeout_s=REGISTER_TIMEOUT_S, on_marked_draining=on_mark
                )
            except (BrokerError, TimeoutError) as exc:
                raise StartupError(f"broker {self.settings.broker_address} did not register us: {exc}") from exc
            self.registered = True
        if self.state.phase == "registering":
            self.state.phase = "ready"

    async def drain(self) -> dict[str, Any]:
        """GET /drain on the admin port: the pod's preStop hook (pod_env.py). A registered role
        leaves the broker once drained, and /healthz then fails: a drained decode is replaced,
        not kept idle. A follower serves its leader's steps until the leader let go."""
        role = self.role
        if role is None or self.state.phase not in ("ready", "draining", "drained"):
            self.state.phase = "draining"
            return {"drained": True, "busy": 0}
        if self.state.phase == "ready":
            self.state.phase = "draining"
            if self.registered:
                await self.broker.set_draining(True)
        drained = await role.drain(self.settings.drain_timeout_seconds)
        if self.registered:
            await self._leave_broker()
            if self.state.phase == "draining":
                self.state.phase = "drained"
        return {"drained": drained, "busy": role.busy()}

    def _on_marked_draining(self) -> None:
        if self.marked_drain is None:
            self.marked_drain = asyncio.get_running_loop().create_task(self.drain_marked(), name="marked-drain")

    async def drain_marked(self) -> None:
        """The operator marked this decode draining to scale down: drain as /drain does (migrate
        mode: every request moves to another decode), then stay registered, draining and idle,
        and report the load at once: the operator lowers the StatefulSet when it sees nothing
        running, and reads the migration counts from that load for its Event. The pod's stop
        (preStop /drain, SIGTERM) then finds nothing to do but leave the broker."""
        role = self.role
        if role is None or self.state.phase != "ready":
            return  # not serving yet, or already draining/stopping: that path drains
        self.state.phase = "draining"
        log.info(kv(event="worker_marked_draining", worker=self.settings.member_id, busy=role.busy()))
        drained = await role.drain(self.settings.drain_timeout_seconds)
        await self.broker.report_now()
        log.info(kv(event="worker_drained_by_mark", worker=self.settings.member_id, drained=drained, busy=role.busy()))

    async def leave(self) -> None:
        """On the stop signal: drain unless /drain did, then leave the broker."""
        if self.role is not None and self.state.phase not in ("draining", "drained"):
            self.state.phase = "draining"
            if self.registered:
                await self.broker.set_draining(True)
            await self.role.drain(self.settings.drain_timeout_seconds)
        if self.marked_drain is not None and not self.marked_drain.done():
            self.marked_drain.cancel()  # its wait only: what it parked is released with the pool
        self.state.phase = "stopping"
        await self._leave_broker()

    async def _leave_broker(self) -> None:
        if self.registered:
            self.registered = False
            await self.broker.deregister()


async def _load_model(settings: WorkerSettings, group: TPGroup | None = None) -> tuple[Engine, str]:
    """The model engine (a layer-sharded decode member loads only its share, a tensor-parallel
    rank its heads), warmed up, and the model's revision."""
    from pdserve_worker.decode.layer_shards import member_layers
    from pdserve_worker.engines.base import EngineError
    from pdserve_worker.process.startup import load_model_engine

    try:
        # Fresh threads, not to_thread: no OpenMP pool may outlive them (util/fresh_thread.py).
        folder = await run_in_fresh_thread(resolve_model_folder, settings)
        layers = member_layers(settings, folder)
        # The source itself, not its converted folder: a GGUF's quantized blocks come from it.
        tp = {} if group is None else {"tp": (group.size, group.rank), "reduce": group.all_reduce}
        engine = await run_in_fresh_thread(functools.partial(load_model_engine, settings, layers, **tp))
        await _warm_up(engine.warm_up)
    except (FileNotFoundError, ValueError, RuntimeError, EngineError) as exc:
        raise StartupError(f"cannot load model {settings.model_source!r}: {exc}") from exc
    return engine, model_revision(folder, settings.model_dtype)


async def _warm_up(run: Callable[[], float]) -> None:
    """A short prefill and decode before serving (Engine.warm_up), on a thread that ends."""
    seconds = await run_in_fresh_thread(run)
    log.info(kv(event="model_warmed", seconds=round(seconds, 3)))


async def _make_role(
    settings: WorkerSettings, engine: Engine, backend: TransferBackend, revision: str, group: TPGroup | None
) -> ServingRole:
    from pdserve_worker.decode.layer_shards import LayerShardError
    from pdserve_worker.process.roles import make_role

    try:
        return await make_role(settings, engine, backend, revision, group)
    except LayerShardError as exc:
        raise StartupError(str(exc)) from exc


async def _listen_or_fail(server: Any, settings: WorkerSettings) -> Any:
    """The gRPC port, behind the per-address cap (pdserve_common/grpc_front.py): its front."""
    from pdserve_common.channels import listen

    try:
        _, front = await listen(server, settings.bind_host, settings.grpc_port, settings.tls)
    except (OSError, ValueError) as exc:
        raise StartupError(str(exc)) from exc
    return front


async def _until(stop: asyncio.Event, server_task: asyncio.Task) -> None:
    """Wait for a stop signal; a server that died on its own is a failure."""
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait({waiter, server_task}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if server_task.done() and not stop.is_set():
        raise StartupError(f"the HTTP server stopped unexpectedly: {server_task.exception()!r}")


def _serve_or_fail(
    app: Any,
    host: str,
    port: int,
    settings: WorkerSettings,
    name: str,
    tls: Any = None,
    limits: HttpLimits | None = None,
) -> RunningServer:
    try:
        return serve_in_background(app, host, port, settings.grace_seconds, tls, name, limits or settings.http_limits)
    except OSError as exc:
        raise StartupError(str(exc)) from exc


# ---- router and colocated --------------------------------------------------------------------------


async def _serve_api(
    settings: WorkerSettings,
    backend: Any,
    metrics: Any,
    state: WorkerState,
    stop: asyncio.Event,
    sampling_defaults: dict[str, float | int],
) -> None:
    """Serve the OpenAI API over `backend` until stopped; in-flight requests get the grace period.
    `sampling_defaults`: the model's generation_config values for requests that leave them unset."""
    from pdserve_worker.api.admission import AdmissionConfig, AdmissionQueue
    from pdserve_worker.api.app import RouterLimits, create_app
    from pdserve_worker.api.keys import KeyFile, KeyFileError

    keys = None
    if settings.api_keys_file is not None:
        try:
            keys = KeyFile(settings.api_keys_file)
        except (KeyFileError, OSError) as exc:
            raise StartupError(f"API keys: {exc}") from exc
    admission = None
    if settings.admission_queue > 0:  # 0: no queue, a request without a free slot is a 429 at once
        admission = AdmissionQueue(
            AdmissionConfig(
                capacity=settings.admission_queue,
                max_queued_per_tenant=settings.admission_per_tenant,
                deadline_s=settings.admission_deadline_seconds,
                replicas=settings.router_replicas,
            ),
            observer=metrics,
        )
    app = create_app(
        backend,
        metrics,
        limits=RouterLimits(max_body_bytes=settings.max_body_bytes),
        admission=admission,
        keys=keys,
        sampling_defaults=sampling_defaults,
    )
    app.router.routes.extend(health_routes(state))
    running = _serve_or_fail(app, settings.bind_host, settings.http_port, settings, "router-http", settings.tls)
    try:
        state.phase = "ready"
        log.info(
            kv(
                event="router_listening",
                role=settings.role,
                host=settings.bind_host,
                port=settings.http_port,
                model=backend.model_name,
                https=settings.tls is not None,
                sampling_defaults=sampling_defaults or "openai",
            )
        )
        await _until(stop, running.task)
        state.phase = "stopping"
    finally:
        await running.stop()


async def _run_router(settings: WorkerSettings, state: WorkerState) -> None:
    from pdserve_common.membership import MemberInfo, Role
    from pdserve_worker.api.metrics import RouterMetrics
    from pdserve_worker.model.config import ModelConfig
    from pdserve_worker.model.loading.generation_config import GenerationDefaults
    from pdserve_worker.model.tokenizer import Tokenizer, TokenizerError
    from pdserve_worker.router.config import RouterConfig, Timeouts
    from pdserve_worker.router.load import router_load
    from pdserve_worker.router.pd_backend import PDBackend

    stop = _stop_event()
    epp: Any = None
    try:
        folder = await asyncio.to_thread(resolve_model_folder, settings)
        tokenizer = Tokenizer.from_dir(folder)
        config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
        sampling_defaults = GenerationDefaults.from_folder(folder).sampling_defaults()
    except (FileNotFoundError, ValueError, TokenizerError) as exc:
        raise StartupError(f"cannot read model {settings.model_source!r}: {exc}") from exc
    broker = broker_client(settings)
    metrics = RouterMetrics()
    router_config = RouterConfig(
        model_name=served_name(settings, folder),
        max_model_len=min(settings.max_length, config.max_position_embeddings),
        revision=model_revision(folder, settings.model_dtype),
        token=settings.token,
        timeouts=Timeouts(
            lease_ms=settings.lease_ms,
            readiness_ms=settings.readiness_timeout_ms,
            prefill_s=settings.request_timeout_seconds,
            return_wait_s=settings.return_wait_seconds,
        ),
        tls=settings.peer_tls,
        prefix_block_tokens=settings.prefix_block_tokens,
        prefix_routing=settings.prefix_routing,
        disaggregation=settings.disaggregation,
    )
    backend = PDBackend(router_config, tokenizer=tokenizer, broker=broker, metrics=metrics)
    # A router without a prefill or a decode to send requests to is not ready for traffic.
    state.serving = lambda: bool(backend.health()["ready"])
    try:
        await backend.start()
        # The keepalive carries the router's traffic: the operator's autoscaler plans from it.
        # Its HTTP endpoint, for the endpoint pickers of a gateway (gateway/ext_proc.py).
        endpoint = {"http_endpoint": f"{settings.advertise_host}:{settings.http_port}"}
        await broker.register(
            MemberInfo(worker_id=settings.member_id, role=Role.ROUTER, revision=backend.revision, labels=endpoint),
            wait=False,
            load=lambda: dataclasses.replace(router_load(metrics), active_requests=backend.in_flight()["decode"]),
        )
        epp = await _start_epp(settings, broker, backend.model_name, backend.revision) if settings.epp_port else None
        await _serve_api(settings, backend, metrics, state, stop, sampling_defaults)
        await broker.deregister()
    finally:
        if epp is not None:
            await epp.stop(settings.grace_seconds)
        await backend.close()
        await broker.close()
        log.info(kv(event="worker_stopped", role=settings.role, worker=settings.member_id))


def broker_client(settings: WorkerSettings) -> Any:
    """This process's BrokerClient: its role token, and its member credential (#58 A4)."""
    from pdserve_worker.rpc.broker_client import BrokerClient

    tls, credential = settings.broker_channel_tls, member_credential_source(settings)
    return BrokerClient(settings.broker_address, settings.service, settings.token, tls, credential=credential)


async def _start_epp(settings: WorkerSettings, broker: Any, model_name: str, revision: str) -> Any:
    """The router's endpoint picker (gateway/ext_proc.py) on `epp_port`: it picks among the
    service's routers that the broker lists (its own included), by their reported load."""
    from pdserve_common.membership import Role
    from pdserve_worker.gateway import ext_proc
    from pdserve_worker.gateway.endpoint_picker import Candidate

    view = await broker.watch([Role.ROUTER])

    def candidates() -> list[Candidate]:
        return [
            Candidate(m.info.labels["http_endpoint"], m.load.active_requests)
            for m in view.by_role(Role.ROUTER)
            if m.info.labels.get("http_endpoint") and m.info.revision == revision
        ]

    address = f"{settings.bind_host}:{settings.epp_port}"
    try:
        picker = ext_proc.EndpointPicker(model_name, candidates)
        tokens = epp_token_table(settings)  # the gateway's token (#58 A3)
        running = await ext_proc.serve(picker, settings.bind_host, settings.epp_port, tokens, settings.tls)
    except (OSError, ValueError) as exc:
        raise StartupError(f"the endpoint picker cannot start on {address}: {exc}") from exc
    log.info(kv(event="epp_listening", address=address, model=model_name))
    return running


async def _run_colocated(settings: WorkerSettings, state: WorkerState) -> None:
    from pdserve_worker.api.metrics import RouterMetrics
    from pdserve_worker.colocated.backend import ColocatedBackend, ColocatedConfig
    from pdserve_worker.model.engine import warm_up
    from pdserve_worker.model.loading.loader import load_model
    from pdserve_worker.serving.torch_threads import serve_with
    from pdserve_worker.serving.worker_metrics import watch_prefix_cache

    stop = _stop_event()
    serve_with(settings.torch_threads)  # (serving/torch_threads.py)
    try:
        folder = await run_in_fresh_thread(resolve_model_folder, settings)  # (util/fresh_thread.py)
        loaded = await run_in_fresh_thread(
            load_model, settings.model_path, settings.model_dtype, settings.device, None, settings.weights
        )
        await _warm_up(functools.partial(warm_up, loaded.model))  # (colocated serves a LoadedModel, not an Engine)
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        raise StartupError(f"cannot load model {settings.model_source!r}: {exc}") from exc
    max_len = min(settings.max_length, loaded.config.max_position_embeddings)
    colocated = ColocatedConfig(
        slots=settings.slots,
        max_len=max_len,
        model_name=served_name(settings, folder),
        prefix_cache_tokens=settings.prefix_cache_tokens,
        prefix_block_tokens=settings.prefix_block_tokens,
        memory_share=settings.memory_share,
        prefix_disk_dir=settings.prefix_disk_dir,
        prefix_disk_bytes=settings.prefix_disk_bytes,
        prefill_chunk_tokens=settings.prefill_chunk_tokens,
    )
    backend = ColocatedBackend(loaded, colocated)
    backend.start()
    metrics = RouterMetrics()
    if backend.prefix is not None:  # its prefix cache's series, as a prefill publishes them
        watch_prefix_cache(metrics.registry, backend.prefix)
    try:
        await _serve_api(settings, backend, metrics, state, stop, loaded.generation.sampling_defaults())
    finally:
        backend.close()
        log.info(kv(event="worker_stopped", role=settings.role, worker=settings.member_id))
