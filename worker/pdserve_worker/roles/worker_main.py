"""One worker process from start to stop: `pdserve worker --role prefill|decode|router|colocated`.

Start (each step visible on /healthz's `phase`): HTTP first, so probes answer while the model
loads; then the model, the transfer engine and the role's state; the gRPC server; and last
the broker registration, after which /readyz turns 200. Peers learn of a worker only once it
can serve.

Stop (SIGTERM or SIGINT, once): /readyz fails at once; a decode drains (no new slots, active
requests finish, up to the drain timeout); the worker leaves the broker, then the gRPC and
HTTP servers stop (in-flight calls get the grace period), then the KV pool is deregistered,
the transfer engine finalized (its server stopped and joined, so no peer's write can still
land), and only then the pool's memory freed. A second signal during the stop is ignored; the pod's grace period is
the hard limit. A decode drained through its admin port (the preStop hook's `pdserve drain`)
has already left the broker when the signal comes; drained by anything else, it fails its
liveness probe and is restarted.

With TLS configured (settings.tls) every gRPC server listens with TLS only and requires a
client certificate of the CA, every gRPC client (to the broker, to other workers, a group's
leader to its followers) dials with TLS and its certificate, and the router serves HTTPS.

The router role serves the OpenAI API (`router_app.create_app`) over `PDBackend`; the
colocated role serves it over one in-process Generator (no broker): the baseline of the
benchmarks and a one-process `pdserve local --colocated`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from pathlib import Path
from typing import Any

from pdserve_worker.logs import kv
from pdserve_worker.roles.pod_http import (
    ADMIN_HOST,
    WorkerState,
    admin_app,
    embedded_server,
    health_routes,
    listen,
    worker_app,
)
from pdserve_worker.settings import WorkerSettings, model_revision

log = logging.getLogger("pdserve.worker")

REGISTER_TIMEOUT_S = 120.0


class StartupError(RuntimeError):
    """The worker cannot start (bad model, taken port, broker refused it); the message says why."""


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
    from pdserve_worker.model.loader import model_folder

    return model_folder(path, settings.model_dtype)[0]


def served_name(settings: WorkerSettings, folder: Path) -> str:
    if settings.model_name:
        return settings.model_name
    marker = folder / "pdserve_source.json"
    if marker.is_file():
        return str(json.loads(marker.read_text()).get("name", folder.name))
    return folder.name


async def run_worker(settings: WorkerSettings) -> int:
    from pdserve_worker import tracing

    # A no-op unless asked for (tracing.py); the router (and colocated) face clients: the edge.
    tracing.setup(f"pdserve-{settings.role}", settings.member_id, edge=settings.role in ("router", "colocated"))
    try:
        if settings.role == "router":
            await _run_router(settings)
        elif settings.role == "colocated":
            await _run_colocated(settings)
        else:
            await _run_model_worker(settings)
    except StartupError as exc:
        log.error(kv(event="worker_start_failed", role=settings.role, error=str(exc)))
        return 1
    finally:
        tracing.shutdown()  # exports what is still buffered
    return 0


# ---- prefill and decode ---------------------------------------------------------------------------


async def _run_model_worker(settings: WorkerSettings) -> None:
    import torch

    from pdserve_worker.broker_client import BrokerClient, BrokerError
    from pdserve_worker.model.loader import load_model
    from pdserve_worker.roles.decode import DecodeServicer, DecodeWorker
    from pdserve_worker.roles.prefill import PrefillServicer, PrefillWorker
    from pdserve_worker.rpc.auth import TokenTable
    from pdserve_worker.rpc.channels import aio_server, bind
    from pdserve_worker.rpc.membership import Role
    from pdserve.v1 import shard_pb2_grpc, worker_pb2_grpc
    from pdserve_worker.roles.decode_shard import (
        DecodeShardServicer,
        GroupLeader,
        RemoteShard,
        ShardError,
        ShardFollower,
        describe_followers,
        group_max_message,
        is_follower,
        member_layers,
    )
    from pdserve_worker.rpc.channels import WORKER_MAX_MESSAGE
    from pdserve_worker.transfer.engine import create_engine
    from pdserve_worker.transfer.service_link import engine_options, local_engine_id

    stop = _stop_event()
    state = WorkerState(settings.role, settings.member_id)
    decode: DecodeWorker | None = None
    broker = BrokerClient(settings.broker_address, settings.service, settings.token, settings.broker_channel_tls)
    tokens = TokenTable({settings.service: settings.token})
    registered = False

    async def leave_broker() -> None:
        nonlocal registered
        if registered:
            registered = False
            await broker.deregister()

    async def drain() -> dict[str, Any]:
        """GET /drain on the admin port: the pod's preStop hook (pod_env.py)."""
        if isinstance(worker, ShardFollower) and state.phase in ("ready", "draining"):
            state.phase = "draining"  # serve the leader's steps until it has drained and let go
            return {"drained": await worker.drain(settings.drain_timeout_seconds), "busy": worker.open_streams}
        if decode is None or state.phase not in ("ready", "draining", "drained"):
            state.phase = "draining"
            return {"drained": True, "busy": 0}
        if state.phase == "ready":
            state.phase = "draining"
            await broker.set_draining(True)
        drained = await decode.drain(settings.drain_timeout_seconds)
        await leave_broker()
        if state.phase == "draining":
            state.phase = "drained"  # /healthz fails from here: a drained decode is replaced, not kept idle
        return {"drained": drained, "busy": decode.busy_slots()}

    http_socket = _listen_or_fail(settings.bind_host, settings.http_port)
    app = worker_app(state)
    http = embedded_server(app, settings.bind_host, settings.http_port, settings.grace_seconds,
                           limits=settings.http_limits)
    http_task = asyncio.create_task(http.serve(sockets=[http_socket]), name="worker-http")
    admin: Any = None
    admin_task: asyncio.Task | None = None
    if settings.role == "decode":
        admin_socket = _listen_or_fail(ADMIN_HOST, settings.admin_port)
        admin = embedded_server(admin_app(tokens, drain), ADMIN_HOST, settings.admin_port, settings.grace_seconds,
                                limits=settings.http_limits)
        admin_task = asyncio.create_task(admin.serve(sockets=[admin_socket]), name="worker-admin")
    backend = None
    worker: Any = None
    server = None
    try:
        torch.set_num_threads(settings.torch_threads)
        state.phase = "loading"
        try:
            folder = await asyncio.to_thread(resolve_model_folder, settings)
            layers = member_layers(settings, folder)  # a layer-sharded decode member loads only its share
            # The source itself, not its converted folder: a GGUF's quantized blocks come from it.
            loaded = await asyncio.to_thread(load_model, settings.model_path, settings.model_dtype, settings.device,
                                             layers, settings.weights)
            loaded.config.check_max_len(settings.max_length)  # spec.model.maxLength against the model's context
        except (FileNotFoundError, ValueError, RuntimeError) as exc:
            raise StartupError(f"cannot load model {settings.model_source!r}: {exc}") from exc
        revision = model_revision(folder, settings.model_dtype)
        backend = create_engine(settings.transfer_backend)
        # A prefill connects out only: it listens on no transfer port. A decode admits only
        # peers holding the service's link key, and (unless it is a group follower, which has
        # no slot table) lets them write only into reserved slots (service_link.py).
        engine_id = local_engine_id(settings.role, settings.advertise_host, settings.transfer_port)
        options = engine_options(backend.name, settings.token, settings.engine_options,
                                 leased_writes=settings.role == "decode" and not is_follower(settings))
        status = backend.engine.initialize(engine_id, options)
        if status != backend.api.SUCCESS:
            raise StartupError(f"transfer engine {engine_id} failed to initialize: status {status}")
        max_message = (WORKER_MAX_MESSAGE if settings.layer_shards == 1
                       else group_max_message(settings.slots, loaded.config.hidden_size))
        server = aio_server(tokens, max_message=max_message)
        if is_follower(settings):
            worker = ShardFollower(settings, loaded, backend)
            shard_pb2_grpc.add_DecodeShardServicer_to_server(DecodeShardServicer(worker), server)
            load_fn = None
        elif settings.role == "decode" and settings.layer_shards > 1:
            remotes = [RemoteShard(peer, settings.token, settings.peer_tls, max_message=max_message)
                       for peer in settings.peers[1:]]
            try:
                followers = await asyncio.to_thread(describe_followers, remotes)
            except ShardError as exc:
                raise StartupError(str(exc)) from exc
            worker = decode = GroupLeader(settings, loaded, backend, revision, remotes, followers)
            worker_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(decode), server)
            decode.start()
            load_fn = decode.load
        elif settings.role == "decode":
            worker = decode = DecodeWorker(settings, loaded, backend, revision)
            worker_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(decode), server)
            decode.start()
            load_fn = decode.load
        else:
            worker = PrefillWorker(settings, loaded, backend, revision)
            worker_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(worker), server)
            load_fn = worker.load
        if getattr(worker, "metrics", None) is not None:  # a group's follower reports through its leader
            state.metrics = worker.metrics.exposition
        try:
            bind(server, settings.bind_host, settings.grpc_port, settings.tls)
        except (OSError, ValueError) as exc:
            raise StartupError(str(exc)) from exc
        await server.start()
        if stop.is_set():
            return
        state.phase = "registering"
        try:
            if load_fn is not None:  # a group's followers are part of their leader's instance
                await broker.register(worker.member_info(), load=load_fn, timeout_s=REGISTER_TIMEOUT_S)
                registered = True
        except (BrokerError, TimeoutError) as exc:
            raise StartupError(f"broker {settings.broker_address} did not register us: {exc}") from exc
        if isinstance(worker, PrefillWorker):
            await broker.watch([Role.DECODE], listener=worker.on_member)
        if state.phase == "registering":
            state.phase = "ready"
        log.info(kv(event="worker_ready", role=settings.role, worker=settings.member_id,
                    grpc=settings.grpc_endpoint, engine=engine_id, http=settings.http_port,
                    model=loaded.name, revision=revision))
        await _until(stop, http_task)
        log.info(kv(event="worker_stopping", role=settings.role, worker=settings.member_id))
        if decode is not None and state.phase not in ("draining", "drained"):
            state.phase = "draining"
            await broker.set_draining(True)
            await decode.drain(settings.drain_timeout_seconds)
        if isinstance(worker, ShardFollower) and state.phase not in ("draining", "drained"):
            state.phase = "draining"
            await worker.drain(settings.drain_timeout_seconds)
        state.phase = "stopping"
        await leave_broker()
    finally:
        state.phase = "stopping"
        await broker.close()
        if server is not None:
            await server.stop(settings.grace_seconds)
        http.should_exit = True
        with contextlib.suppress(Exception):
            await http_task
        if admin is not None and admin_task is not None:
            admin.should_exit = True
            with contextlib.suppress(Exception):
                await admin_task
        # Stop using the pool and deregister it, then stop the engine (its server first: no
        # peer can be writing any more), and only then free the pool's memory.
        if worker is not None:
            worker.close()
        if backend is not None:
            backend.engine.finalize()
        if worker is not None:
            worker.free()
        log.info(kv(event="worker_stopped", role=settings.role, worker=settings.member_id))


async def _until(stop: asyncio.Event, server_task: asyncio.Task) -> None:
    """Wait for a stop signal; a server that died on its own is a failure."""
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait({waiter, server_task}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if server_task.done() and not stop.is_set():
        raise StartupError(f"the HTTP server stopped unexpectedly: {server_task.exception()!r}")


def _listen_or_fail(host: str, port: int):
    try:
        return listen(host, port)
    except OSError as exc:
        raise StartupError(str(exc)) from exc


# ---- router and colocated --------------------------------------------------------------------------


def _add_pod_routes(app, state: WorkerState) -> None:
    for route in health_routes(state):
        app.router.routes.append(route)


async def _serve_api(settings: WorkerSettings, backend: Any, metrics: Any, state: WorkerState,
                     stop: asyncio.Event) -> None:
    """Serve the OpenAI API over `backend` until stopped; in-flight requests get the grace period."""
    from pdserve_worker.roles.router_admission import AdmissionConfig, AdmissionQueue
    from pdserve_worker.roles.router_app import RouterLimits, create_app
    from pdserve_worker.roles.router_keys import KeyFile, KeyFileError

    keys = None
    if settings.api_keys_file is not None:
        try:
            keys = KeyFile(settings.api_keys_file)
        except (KeyFileError, OSError) as exc:
            raise StartupError(f"API keys: {exc}") from exc
    admission = None
    if settings.admission_queue > 0:  # 0: no queue, a request without a free slot is a 429 at once
        admission = AdmissionQueue(AdmissionConfig(
            capacity=settings.admission_queue, max_queued_per_tenant=settings.admission_per_tenant,
            deadline_s=settings.admission_deadline_seconds, replicas=settings.router_replicas), observer=metrics)
    app = create_app(backend, metrics, limits=RouterLimits(max_body_bytes=settings.max_body_bytes),
                     admission=admission, keys=keys)
    _add_pod_routes(app, state)
    sock = _listen_or_fail(settings.bind_host, settings.http_port)
    server = embedded_server(app, settings.bind_host, settings.http_port, settings.grace_seconds, settings.tls,
                             settings.http_limits)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="router-http")
    try:
        state.phase = "ready"
        log.info(kv(event="router_listening", role=settings.role, host=settings.bind_host, port=settings.http_port,
                    model=backend.model_name, https=settings.tls is not None))
        await _until(stop, task)
        state.phase = "stopping"
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await task


async def _run_router(settings: WorkerSettings) -> None:
    from pdserve_worker.broker_client import BrokerClient
    from pdserve_worker.model.config import ModelConfig
    from pdserve_worker.model.tokenizer import Tokenizer, TokenizerError
    from pdserve_worker.roles.router_load import router_load
    from pdserve_worker.roles.router_metrics import RouterMetrics
    from pdserve_worker.roles.router_pd import PDBackend, Timeouts
    from pdserve_worker.rpc.membership import MemberInfo, Role

    stop = _stop_event()
    state = WorkerState(settings.role, settings.member_id)
    try:
        folder = await asyncio.to_thread(resolve_model_folder, settings)
        tokenizer = Tokenizer.from_dir(folder)
        config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    except (FileNotFoundError, ValueError, TokenizerError) as exc:
        raise StartupError(f"cannot read model {settings.model_source!r}: {exc}") from exc
    broker = BrokerClient(settings.broker_address, settings.service, settings.token, settings.broker_channel_tls)
    metrics = RouterMetrics()
    backend = PDBackend(
        model_name=served_name(settings, folder),
        tokenizer=tokenizer,
        max_model_len=min(settings.max_length, config.max_position_embeddings),
        revision=model_revision(folder, settings.model_dtype),
        broker=broker,
        token=settings.token,
        metrics=metrics,
        timeouts=Timeouts(lease_ms=settings.lease_ms, readiness_ms=settings.readiness_timeout_ms,
                          prefill_s=settings.request_timeout_seconds),
        tls=settings.peer_tls,
    )
    # A router without a prefill or a decode to send requests to is not ready for traffic.
    state.serving = lambda: bool(backend.health()["ready"])
    try:
        await backend.start()
        # The keepalive carries the router's traffic: the operator's autoscaler plans from it.
        await broker.register(MemberInfo(worker_id=settings.member_id, role=Role.ROUTER,
                                         revision=backend.revision), wait=False,
                              load=lambda: router_load(metrics))
        await _serve_api(settings, backend, metrics, state, stop)
        await broker.deregister()
    finally:
        await backend.close()
        await broker.close()
        log.info(kv(event="worker_stopped", role=settings.role, worker=settings.member_id))


async def _run_colocated(settings: WorkerSettings) -> None:
    import torch

    from pdserve_worker.model.loader import load_model
    from pdserve_worker.roles.colocated import ColocatedBackend
    from pdserve_worker.roles.router_metrics import RouterMetrics

    stop = _stop_event()
    state = WorkerState(settings.role, settings.member_id)
    torch.set_num_threads(settings.torch_threads)
    try:
        folder = await asyncio.to_thread(resolve_model_folder, settings)
        loaded = await asyncio.to_thread(load_model, settings.model_path, settings.model_dtype, settings.device,
                                         None, settings.weights)
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        raise StartupError(f"cannot load model {settings.model_source!r}: {exc}") from exc
    max_len = min(settings.max_length, loaded.config.max_position_embeddings)
    backend = ColocatedBackend(loaded, slots=settings.slots, max_len=max_len,
                               model_name=served_name(settings, folder),
                               prefix_cache_tokens=settings.prefix_cache_tokens,
                               prefix_block_tokens=settings.prefix_block_tokens)
    backend.start()
    try:
        await _serve_api(settings, backend, RouterMetrics(), state, stop)
    finally:
        backend.close()
        log.info(kv(event="worker_stopped", role=settings.role, worker=settings.member_id))
