"""A PD service inside the test process: a real broker on 127.0.0.1, and the gRPC servers,
broker clients, channels, transfer engines and workers a test starts on it, all stopped by
`close()` (channels, clients, servers, workers, engines, then the broker), whatever failed.

The in-process integration tests (test_pd_paths.py, test_migration_serving.py,
test_two_sided_serving.py, test_kv_digest_serving.py) build their clusters from it, each adding
the workers and fault-injecting servicers it needs; `serve_decode`, `serve_prefill` and
`pd_backend` are the plain road: a started worker served and registered, and a router over them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from netutil import free_port
from pdserve.v1 import worker_pb2_grpc
from pdserve_common.auth import TokenTable
from pdserve_common.channels import aio_channel, aio_server, bind
from pdserve_common.membership import Load, MemberInfo, Role
from pdserve_operator.broker.server import BrokerServer
from pdserve_worker.rpc.backoff import Backoff
from pdserve_worker.rpc.broker_client import BrokerClient
from pdserve_worker.serving.settings import WorkerSettings
from pdserve_worker.transfer.registry import create_engine
from pdserve_worker.transfer.service_link import local_engine_id

FAST = Backoff(base_s=0.05, cap_s=0.5)


class Stack:
    def __init__(self, service: str, token: str, *, max_len: int, slots: int) -> None:
        self.service, self.token, self.max_len, self.slots = service, token, max_len, slots
        self.broker = BrokerServer({service: token}, ttl_s=5.0)
        self.broker.start("127.0.0.1", 0)
        self.servers: list[grpc.aio.Server] = []
        self.clients: list[BrokerClient] = []
        self.channels: list[grpc.aio.Channel] = []
        self.engines: list[Any] = []
        self.workers: list[Any] = []

    def settings(self, role: str, index: int = 0, **extra: Any) -> WorkerSettings:
        """A worker's settings on this broker, fresh loopback ports, the tiny model's sizes."""
        values: dict[str, Any] = dict(
            role=role,
            service=self.service,
            broker_address=f"127.0.0.1:{self.broker.port}",
            broker_token=self.token,
            worker_id=f"{role}-{index}",
            advertise_host="127.0.0.1",
            grpc_port=free_port(),
            transfer_port=free_port(),
            model_dtype="float32",
            max_length=self.max_len,
            slots=self.slots,
            layers_per_chunk=1,
            transfer_timeout_ms=1000,
        )
        return WorkerSettings(**{**values, **extra})

    def engine(self, settings: WorkerSettings, backend_name: str = "cpu") -> Any:
        """The transfer engine a worker of `settings` uses, initialized: the host engine, or
        the two-sided gloo baseline (where, as in a worker, only a decode listens)."""
        backend = create_engine(backend_name)  # type: ignore[arg-type]
        engine_id = settings.engine_id
        if backend_name == "two-sided":
            engine_id = local_engine_id(settings.role, settings.advertise_host, settings.transfer_port)
        assert backend.engine.initialize(engine_id) == backend.api.SUCCESS
        self.engines.append(backend)
        return backend

    def worker(self, w: Any) -> Any:
        """Own a started (or about to start) worker: closed at the end."""
        self.workers.append(w)
        return w

    async def serve(self, port: int, add: Callable[[grpc.aio.Server], None]) -> None:
        """A token-checking gRPC server on 127.0.0.1:`port` with the servicers `add` puts on it."""
        server = aio_server(TokenTable({self.service: self.token}))
        add(server)
        bind(server, "127.0.0.1", port)
        await server.start()
        self.servers.append(server)

    def client(self) -> BrokerClient:
        c = BrokerClient(f"127.0.0.1:{self.broker.port}", self.service, self.token, backoff=FAST)
        self.clients.append(c)
        return c

    async def join(self, info: MemberInfo, load: Callable[[], Load] | None = None) -> BrokerClient:
        """Register a member as its pod would."""
        c = self.client()
        await c.register(info, load=load)
        return c

    async def serve_decode(self, decode: Any) -> None:
        """Start a DecodeWorker (owned here), serve it on its settings' port and register it."""
        from pdserve_worker.decode.service import DecodeServicer

        self.worker(decode)
        await decode.start()
        await self.serve(
            decode.settings.grpc_port,
            lambda s: worker_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(decode), s),
        )
        await self.join(decode.member_info(), decode.load)

    async def serve_prefill(self, prefill: Any, revision: str) -> None:
        """Serve a PrefillWorker (owned here) on its settings' port and register it."""
        from pdserve_worker.prefill.service import PrefillServicer

        self.worker(prefill)
        settings = prefill.settings
        await self.serve(
            settings.grpc_port, lambda s: worker_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(prefill), s)
        )
        info = MemberInfo(settings.worker_id, Role.PREFILL, settings.grpc_endpoint, revision=revision)
        await self.join(info)

    async def pd_backend(self, tokenizer: Any, revision: str, timeouts: Any, members: int = 2) -> Any:
        """A started router (PDBackend) on this broker, once it sees `members` members; the
        caller closes it."""
        from pdserve_worker.router.config import RouterConfig
        from pdserve_worker.router.pd_backend import PDBackend

        config = RouterConfig(
            model_name="tiny",
            max_model_len=self.max_len,
            revision=revision,
            token=self.token,
            timeouts=timeouts,
            disaggregation="always",  # (the push road: conftest.py)
        )
        backend = PDBackend(config, tokenizer=tokenizer, broker=self.client())
        await backend.start()
        await backend.view.wait_for(lambda v: len(v.members) == members, 5)
        return backend

    def channel(self, endpoint: str) -> grpc.aio.Channel:
        ch = aio_channel(endpoint, self.token)
        self.channels.append(ch)
        return ch

    async def close(self) -> None:
        for ch in self.channels:
            await ch.close()
        for c in self.clients:
            await c.close()
        for server in self.servers:
            await server.stop(0)
        for w in self.workers:
            w.close()
        for e in self.engines:
            e.engine.finalize()
        self.broker.stop(0)
