"""A layer-sharded decode group across processes: a leader that routers see, followers it drives.

The leader (member 0) registers with the broker, owns the group's slot table, answers Reserve
with one grant per member, runs the batch, its own layers and the head. Followers hold their
layer range's weights and KV pool and serve `DecodeShard` (shard.proto): `Describe`, `Forward`
(one stream of per-step hidden states) and `WaitReady`. A request starts only once every
member's ready notification arrived; a follower that dies fails the leader's next step. The
hidden state crosses the wire as raw bytes in the model's dtype (the same model revision on
every member). The full account: docs/roles.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import torch

from pdserve.v1 import shard_pb2, shard_pb2_grpc
from pdserve_common.auth import TLSConfig, bearer_metadata
from pdserve_common.channels import WORKER_MAX_MESSAGE, channel_options
from pdserve_common.kv_layout import KVLayout, layout_from_proto, layout_to_proto, shard_layers
from pdserve_common.logs import kv
from pdserve_common.membership import Load
from pdserve_worker.decode.migration import MigrationPusher, common_layers
from pdserve_worker.decode.worker import ReadyUnusable
from pdserve_worker.engines.base import LAYER_SHARDS, Engine, GroupEngine, group_engine
from pdserve_worker.kv.cache import KVCache
from pdserve_worker.kv.slots import Grant, nonce_matches
from pdserve_worker.model.config import ModelConfig
from pdserve_worker.model.engine import Generator
from pdserve_worker.model.layers.layer_shards import GroupKV, LayerShardDecoder, check_group_layouts
from pdserve_worker.ranks.group import MemberUnavailable
from pdserve_worker.rpc.broker_client import BrokerClient
from pdserve_worker.rpc.convert import grant_from_proto, grant_to_proto, hidden_from_proto, hidden_to_proto
from pdserve_worker.serving.settings import WorkerSettings
from pdserve_worker.transfer.base import TransferBackend, TransferError
from pdserve_worker.transfer.digest import KVIntegrityError, ReadyDigests
from pdserve_worker.transfer.pool import KVPool
from pdserve_worker.transfer.push import PushError, PushSource, layer_chunks
from pdserve_worker.transfer.readiness import Readiness, ReadinessTimeout

log = logging.getLogger(__name__)

DESCRIBE_TIMEOUT_S = 120.0  # followers load their model while the leader waits for them


def group_max_message(slots: int, hidden_size: int) -> int:
    """The largest gRPC message between a group's members: one decode step's hidden state,
    batch (at most `slots`) x hidden x 4 bytes, plus its slots and positions."""
    return max(WORKER_MAX_MESSAGE, slots * hidden_size * 4 + (1 << 20))


class LayerShardError(MemberUnavailable):
    """A follower failed a step or could not be reached; the message names it."""


# ---- which layers ----------------------------------------------------------------------------


def member_layers(settings: WorkerSettings, folder: Path) -> range | None:
    """The layers this decode worker holds: its share of the group's, or None (all of them)."""
    if settings.role != "decode" or settings.layer_shards == 1:
        return None
    config = ModelConfig.from_hf(json.loads((Path(folder) / "config.json").read_text()))
    _, member = settings.group_member
    return shard_layers(config.num_layers, settings.layer_shards)[member]


def is_follower(settings: WorkerSettings) -> bool:
    return settings.role == "decode" and settings.layer_shards > 1 and settings.group_member[1] > 0


def _pool_layout(settings: WorkerSettings, engine: GroupEngine) -> KVLayout:
    full = engine.config.kv_layout(settings.slots, settings.max_length, settings.model_dtype)
    layers = engine.layers
    return replace(full, first_layer=layers.start, num_layers=len(layers))


# ---- the follower ------------------------------------------------------------------------------------


class GenerationFloor:
    """A follower's rule for ready notifications, without a slot table of its own: generations
    only grow (the leader's table hands them out), so a slot's notification older than one
    already filed or awaited there belongs to an abandoned request and is dropped; otherwise a
    late push of an old request could overwrite the current request's notification."""

    def __init__(self) -> None:
        self._floor: dict[int, int] = {}
        self._lock = threading.Lock()

    def raise_to(self, slot: int, generation: int) -> None:
        with self._lock:
            self._floor[slot] = max(self._floor.get(slot, 0), generation)

    def accepts(self, slot: int, generation: int) -> bool:
        with self._lock:
            if generation < self._floor.get(slot, 0):
                return False
            self._floor[slot] = generation
            return True


class LayerShardFollower:
    """Member i > 0: a pool of its layers, their weights, its readiness; driven by the leader."""

    metrics = None  # (ServingRole: a follower reports through its leader)
    fatal = None  # (ServingRole: a dead leader or member fails the group's requests; nothing to restart for)

    def __init__(self, settings: WorkerSettings, engine: Engine, backend: TransferBackend) -> None:
        self.settings = settings
        self.engine = engine = group_engine(engine, LAYER_SHARDS)
        self.backend = backend
        self.member_index = settings.group_member[1]
        layout = _pool_layout(settings, engine)
        self.pool = KVPool(backend, layout, device=settings.device)
        self.cache = engine.bind_pool(layout, self.pool.tensor)  # (a slot pool: not paged)
        # The leader's slot table decides which grants are live; here only newer beats older.
        self.floor = GenerationFloor()
        # A notify counts only with the reservation's capability, which the leader's table made
        # under the key that every member derives from the service's token (kv/slots.py); a
        # forged one can then neither be filed nor raise the floor.
        key = settings.capability_key()
        self.readiness = Readiness(
            backend,
            settings.readiness_mode,
            accepts=self.floor.accepts,
            authorize=lambda slot, generation, nonce: nonce_matches(key, slot, generation, nonce),
            poll_interval_us=settings.poll_interval_micros,
            warmup=self.pool.warm if settings.warmup else None,
        )
        self.readiness.check = ReadyDigests(backend.digest, self.pool.base_addr, layout, None).check
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-compute")
        self._waiters = ThreadPoolExecutor(max_workers=layout.num_slots, thread_name_prefix="shard-ready")
        self._pushes = ThreadPoolExecutor(max_workers=2, thread_name_prefix="shard-migrate")
        self.steps = 0
        self.open_streams = 0  # the leader's Forward streams now open here

    # ---- the ServingRole of a follower process (process/roles.py) ------------------------------

    def add_to(self, server: grpc.aio.Server) -> None:
        shard_pb2_grpc.add_DecodeShardServicer_to_server(DecodeShardServicer(self), server)

    async def start(self, broker: BrokerClient) -> None:
        """Nothing runs on its own here: the leader drives every step."""

    def member_info(self) -> None:
        """Followers do not register: the group is routed to, and drains, as its leader."""
        return None

    def load(self) -> Load:
        return Load()

    def busy(self) -> int:
        return self.open_streams

    async def drain(self, timeout_s: float) -> bool:
        """Stop only once the leader let go: it closes its Forward stream after draining its own
        requests, so a follower stopping with its group does not fail the leader's last steps.
        True if that happened within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.open_streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        log.info(
            kv(
                event="shard_drained" if not self.open_streams else "shard_drain_timeout",
                member=self.member_index,
                open_streams=self.open_streams,
            )
        )
        return self.open_streams == 0

    def info(self) -> shard_pb2.ShardInfo:
        return shard_pb2.ShardInfo(
            worker_id=self.settings.member_id,
            engine_id=self.settings.engine_id,
            base_addr=self.pool.base_addr,
            kv_layout=layout_to_proto(self.pool.layout),
            member_index=self.member_index,
        )

    def forward(self, message: shard_pb2.HiddenState) -> shard_pb2.HiddenState:
        hidden = hidden_from_proto(message, self.engine.device).to(self.engine.dtype)
        out = self.engine.forward_layers(hidden, self.cache, list(message.slots), list(message.positions))
        self.steps += 1
        return hidden_to_proto(out, message.slots, message.positions)

    def push_handoff(self, request: shard_pb2.PushHandoffRequest) -> shard_pb2.PushHandoffReply:
        """This member's layers of a handed-over request into the targets that hold any of them
        (blocking); the leader notifies once every member answered. PermissionError: the nonce
        is not that reservation's; ValueError: a target is not usable; PushError/TransferError."""
        slot, generation = request.slot, request.generation
        if not nonce_matches(self.settings.capability_key(), slot, generation, request.nonce):
            raise PermissionError(f"slot {slot} generation {generation}: the nonce is not that reservation's")
        layout = self.pool.layout
        targets = [grant_from_proto(g, "", f"targets[{i}]") for i, g in enumerate(request.targets)]
        mine = [t for t in targets if common_layers(t.layout.layer_range, layout.layer_range)]
        if not mine:
            return shard_pb2.PushHandoffReply()
        timeout_s = (request.timeout_ms or self.settings.transfer_timeout_ms) / 1000
        source = PushSource(self.pool.base_addr, layout, slot)
        pusher = MigrationPusher(self.backend, source, (), mine, request.num_tokens, timeout_s=timeout_s)
        try:
            for chunk in layer_chunks(layout.layer_range, self.settings.layers_per_chunk):
                pusher.push_chunk(chunk)
            stats = pusher.settle()
        except BaseException:
            pusher.abort()
            raise
        log.info(kv(event="shard_handoff_pushed", member=self.member_index, slot=slot, bytes=stats.bytes))
        return shard_pb2.PushHandoffReply(bytes=stats.bytes, puts=stats.puts)

    def close(self) -> None:
        """Stop and deregister; `free` after the engine is finalized (DecodeWorker.close)."""
        self._compute.shutdown(wait=True, cancel_futures=True)
        self._waiters.shutdown(wait=False, cancel_futures=True)
        self._pushes.shutdown(wait=True, cancel_futures=True)  # (a push reads the pool: before it goes)
        self.pool.deregister()

    def free(self) -> None:
        self.pool.free()


class DecodeShardServicer(shard_pb2_grpc.DecodeShardServicer):
    def __init__(self, follower: LayerShardFollower) -> None:
        self.f = follower

    async def Describe(
        self, request: shard_pb2.DescribeShardRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.ShardInfo:
        return self.f.info()

    async def Forward(self, request_iterator, context: grpc.aio.ServicerContext):
        loop = asyncio.get_running_loop()
        self.f.open_streams += 1
        try:
            async for message in request_iterator:
                try:
                    reply = await loop.run_in_executor(self.f._compute, self.f.forward, message)
                except (ValueError, IndexError, RuntimeError) as exc:
                    log.warning(kv(event="shard_forward_failed", member=self.f.member_index, error=str(exc)))
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"member {self.f.member_index}: {exc}")
                yield reply
        finally:
            self.f.open_streams -= 1

    async def PushHandoff(
        self, request: shard_pb2.PushHandoffRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.PushHandoffReply:
        where = f"member {self.f.member_index}, slot {request.slot}"
        try:
            return await asyncio.get_running_loop().run_in_executor(self.f._pushes, self.f.push_handoff, request)
        except PermissionError as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{where}: {exc}")
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: {exc}")
        except (PushError, TransferError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{where}: migration push failed: {exc}")

    async def WaitReady(
        self, request: shard_pb2.WaitReadyRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.WaitReadyReply:
        timeout_s = (request.timeout_ms or self.f.settings.readiness_timeout_ms) / 1000
        self.f.floor.raise_to(request.slot, request.generation)
        try:
            message = await asyncio.get_running_loop().run_in_executor(
                self.f._waiters, self.f.readiness.wait, request.slot, request.generation, timeout_s
            )
        except ReadinessTimeout as exc:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"member {self.f.member_index}: {exc}")
        except KVIntegrityError as exc:  # (the leader's ReadyUnusable: the router re-prefills)
            await context.abort(grpc.StatusCode.ABORTED, f"member {self.f.member_index}: {exc}")
        try:
            return shard_pb2.WaitReadyReply(
                num_tokens=int(message["num_tokens"]), first_token=int(message["first_token"])
            )
        except (KeyError, TypeError, ValueError):
            await context.abort(
                grpc.StatusCode.ABORTED,
                f"member {self.f.member_index}: the ready message of slot "
                f"{request.slot} lacks an integer num_tokens or first_token",
            )


# ---- the leader's view of a follower -------------------------------------------------------------


@dataclass(frozen=True)
class FollowerInfo:
    endpoint: str
    worker_id: str
    engine_id: str
    base_addr: int
    layout: KVLayout


class RemoteLayerShard:
    """A follower seen from the leader: a blocking client (the generation loop's thread calls
    `forward`; readiness waits run on worker threads)."""

    def __init__(
        self, endpoint: str, token: str, tls: TLSConfig | None = None, *, max_message: int = WORKER_MAX_MESSAGE
    ) -> None:
        self.endpoint = endpoint
        options = channel_options(tls, max_message)
        # The token travels as explicit metadata on each call (a blocking channel has no
        # interceptors here), so TLS adds the transport only, not call credentials.
        self._channel = (
            grpc.insecure_channel(endpoint, options=options)
            if tls is None
            else grpc.secure_channel(endpoint, tls.ssl_credentials(), options=options)
        )
        self._stub = shard_pb2_grpc.DecodeShardStub(self._channel)
        self._metadata = bearer_metadata(token)
        self._lock = threading.Lock()
        self._requests: queue.SimpleQueue[Any] | None = None
        self._replies: Iterator[shard_pb2.HiddenState] | None = None

    def describe(self, timeout_s: float = DESCRIBE_TIMEOUT_S) -> FollowerInfo:
        try:
            info = self._stub.Describe(
                shard_pb2.DescribeShardRequest(), metadata=self._metadata, timeout=timeout_s, wait_for_ready=True
            )
        except grpc.RpcError as exc:
            raise LayerShardError(
                f"group member at {self.endpoint} did not describe itself: {exc.code().name} {exc.details()}"
            ) from None
        return FollowerInfo(
            self.endpoint, info.worker_id, info.engine_id, info.base_addr, layout_from_proto(info.kv_layout)
        )

    def forward(self, hidden: torch.Tensor, slots: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """One step through the follower's layers over the group's open stream (opened on first use,
        reopened after a failure)."""
        with self._lock:
            if self._requests is None:
                self._requests = queue.SimpleQueue()
                self._replies = self._stub.Forward(iter(self._requests.get, None), metadata=self._metadata)
            self._requests.put(hidden_to_proto(hidden, slots, positions))
            try:
                reply = next(self._replies)  # type: ignore[arg-type]
            except (grpc.RpcError, StopIteration) as exc:
                self._requests.put(None)
                self._requests = self._replies = None
                detail = f"{exc.code().name} {exc.details()}" if isinstance(exc, grpc.RpcError) else "stream ended"
                raise LayerShardError(f"group member at {self.endpoint} failed a decode step: {detail}") from None
        return hidden_from_proto(reply, hidden.device).to(hidden.dtype)

    def wait_ready(self, slot: int, generation: int, timeout_s: float) -> tuple[int, int]:
        try:
            reply = self._stub.WaitReady(
                shard_pb2.WaitReadyRequest(slot=slot, generation=generation, timeout_ms=max(1, int(timeout_s * 1000))),
                metadata=self._metadata,
                timeout=timeout_s + 5.0,
            )
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise ReadinessTimeout(f"group member at {self.endpoint}: {exc.details()}") from None
            if exc.code() == grpc.StatusCode.ABORTED:
                raise ReadyUnusable(f"group member at {self.endpoint}: {exc.details()}") from None
            raise LayerShardError(f"group member at {self.endpoint}: {exc.code().name} {exc.details()}") from None
        return reply.num_tokens, reply.first_token

    def push_handoff(self, request: shard_pb2.PushHandoffRequest, timeout_s: float) -> grpc.Future:
        """Start this follower's push of its layers of a handed-over request (its answer: the future)."""
        return self._stub.PushHandoff.future(request, metadata=self._metadata, timeout=timeout_s)

    def close(self) -> None:
        with self._lock:
            if self._requests is not None:
                self._requests.put(None)
                self._requests = self._replies = None
        self._channel.close()


@dataclass
class GroupPushes:
    """The followers' pushes of one handed-over request: `wait` before the leader's notify,
    `settle` on every way out (a follower still reading its pool finishes first)."""

    calls: list[tuple[str, grpc.Future]]

    def wait(self) -> int:
        """The followers' bytes, once every one of them landed; LayerShardError names one that failed."""
        total = 0
        for endpoint, call in self.calls:
            try:
                total += call.result().bytes
            except grpc.RpcError as exc:
                raise LayerShardError(
                    f"group member at {endpoint} did not push its layers: {exc.code().name} {exc.details()}"
                ) from None
        return total

    def settle(self) -> None:
        for _, call in self.calls:
            try:
                call.result()
            except grpc.RpcError:
                pass  # (reported by `wait`, or the migration already failed)


def describe_followers(
    remotes: Sequence[RemoteLayerShard], timeout_s: float = DESCRIBE_TIMEOUT_S
) -> list[FollowerInfo]:
    return [r.describe(timeout_s) for r in remotes]


# ---- the leader -----------------------------------------------------------------------------------------


class LayerShardGroup:
    """The leader's side of a layer-sharded group (`decode.group_hooks.GroupHooks`): given to its
    DecodeWorker, which then holds member 0's layers, hops through the followers each decode
    step, grants the slot on every member and waits for every member's notification."""

    def __init__(
        self, leader_id: str, own_layers: range, remotes: Sequence[RemoteLayerShard], followers: Sequence[FollowerInfo]
    ) -> None:
        self.leader_id = leader_id
        self.own_layers = own_layers
        self.remotes = tuple(remotes)
        self.followers = tuple(followers)

    def pool_layout(self, full: KVLayout) -> KVLayout:
        return replace(full, first_layer=self.own_layers.start, num_layers=len(self.own_layers))

    def generator(self, engine: Engine, cache: KVCache) -> Generator[Any]:
        leader = group_engine(engine, LAYER_SHARDS)
        layouts = [cache.layout, *(f.layout for f in self.followers)]
        check_group_layouts(layouts, engine.config.num_layers)

        def own(hidden: torch.Tensor, slots: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
            return leader.forward_layers(hidden, cache, slots, positions)

        hops = [own, *(r.forward for r in self.remotes)]

        def hop(index: int, hidden: torch.Tensor, slots: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
            return hops[index](hidden, slots, positions)

        log.info(
            kv(
                event="decode_group_formed",
                members=len(layouts),
                layers=" ".join(f"{lay.first_layer}..{lay.layer_range.stop - 1}" for lay in layouts),
                followers=",".join(f.endpoint for f in self.followers),
            )
        )
        return Generator(
            LayerShardDecoder(leader, layouts, hop), engine.tokenizer, GroupKV(layouts, engine.config.num_layers)
        )

    def grants(self, grant: Grant) -> list[Grant]:
        return [
            grant,
            *(replace(grant, engine_id=f.engine_id, base_addr=f.base_addr, layout=f.layout) for f in self.followers),
        ]

    migrates = True  # each member pushes its own layers of a handed-over request (decode/migration.py)

    def write_leases(self, own: Any) -> Any:
        """The leader's own: a follower's engine is not leased (it keeps no slot table)."""
        return own

    def push_members(
        self,
        slot: int,
        generation: int,
        nonce: str,
        num_tokens: int,
        targets: Sequence[Grant],
        timeout_s: float,
        blocks: Sequence[int] = (),
    ) -> GroupPushes:
        """Every follower starts pushing its layers of reservation (slot, generation) into `targets`
        (from its slot: a member's pool is a slot pool, so `blocks` are not needed)."""
        request = shard_pb2.PushHandoffRequest(
            slot=slot,
            generation=generation,
            nonce=nonce,
            num_tokens=num_tokens,
            targets=[grant_to_proto(t, worker_id="", lease_deadline_unix_ms=0) for t in targets],
            timeout_ms=max(1, int(timeout_s * 1000)),
        )
        return GroupPushes([(r.endpoint, r.push_handoff(request, timeout_s + 5.0)) for r in self.remotes])

    async def wait_ready(self, slot: int, generation: int, timeout_s: float) -> list[tuple[int, int]]:
        return list(
            await asyncio.gather(*(asyncio.to_thread(r.wait_ready, slot, generation, timeout_s) for r in self.remotes))
        )

    def labels(self) -> dict[str, str]:
        members = [self.leader_id, *(f.worker_id for f in self.followers)]
        return {"layer_shards": str(len(members)), "group_members": ",".join(members)}

    def close(self) -> None:
        for remote in self.remotes:
            remote.close()


async def connect_group(settings: WorkerSettings, own_layers: range, max_message: int) -> LayerShardGroup:
    """The leader's group: its followers (`settings.peers[1:]`), described once they are up
    (they load their model meanwhile). Raises LayerShardError if one does not answer in time."""
    remotes = [
        RemoteLayerShard(peer, settings.token, settings.peer_tls, max_message=max_message)
        for peer in settings.peers[1:]
    ]
    try:
        followers = await asyncio.to_thread(describe_followers, remotes)
    except LayerShardError:
        for remote in remotes:
            remote.close()
        raise
    return LayerShardGroup(settings.member_id, own_layers, remotes, followers)
