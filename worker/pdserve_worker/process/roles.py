"""What a model-serving worker process runs: one `ServingRole`, whichever role it is.

The process lifecycle (`worker_main`) knows nothing of prefill, decode or a decode group's
follower: it loads the model, starts the transfer engine, asks `make_role` for the role, and
from then on only calls the methods below, in this order. Each role says what it serves
(`add_to`), what it starts (`start`), whether and how it joins the broker (`member_info`,
`load`), how it stops taking work (`drain`), and how it lets go of its KV pool (`close`, then,
after the engine is finalized, `free`).
"""

from __future__ import annotations

from functools import partial
from typing import Protocol

import grpc

from pdserve_common.channels import WORKER_MAX_MESSAGE
from pdserve_common.membership import Load, MemberInfo
from pdserve_worker.decode.group_hooks import GroupHooks
from pdserve_worker.decode.layer_shards import LayerShardFollower, connect_group, group_max_message, is_follower
from pdserve_worker.decode.service import DecodeRole
from pdserve_worker.decode.worker import decode_pool_layout
from pdserve_worker.engines.base import LAYER_SHARDS, Engine, group_engine
from pdserve_worker.prefill.service import PrefillRole
from pdserve_worker.ranks.decode import TPDecodeGroup
from pdserve_worker.ranks.group import TPGroup
from pdserve_worker.rpc.broker_client import BrokerClient
from pdserve_worker.serving.settings import WorkerSettings
from pdserve_worker.serving.worker_metrics import WorkerMetrics
from pdserve_worker.transfer.base import TransferBackend


class ServingRole(Protocol):
    # What /metrics serves (None: a group's follower, which reports through its leader), and why
    # the instance must restart once it has stopped (None: it need not; the process exits 1 else).
    metrics: WorkerMetrics | None
    fatal: str | None

    def add_to(self, server: grpc.aio.Server) -> None:
        """Add the role's gRPC services to the worker's server (not started yet)."""
        ...

    async def start(self, broker: BrokerClient) -> None:
        """Start serving (threads, membership watches); the gRPC server is up."""
        ...

    def member_info(self) -> MemberInfo | None:
        """What to register with the broker; None: not a broker member (a group's follower)."""
        ...

    def load(self) -> Load:
        """Reported with each keepalive."""
        ...

    async def drain(self, timeout_s: float) -> bool:
        """Take no new work and wait (at most `timeout_s`) for the work in hand; True if done."""
        ...

    def busy(self) -> int:
        """Work in hand (slots, queued prefills, a leader's open streams)."""
        ...

    def close(self) -> None:
        """Stop working and deregister the KV pool: the engine is finalized after this."""
        ...

    def free(self) -> None:
        """Free the pool's memory (after the engine is finalized: no peer can write any more)."""
        ...


def grpc_max_message(settings: WorkerSettings, hidden_size: int) -> int:
    """The largest message the worker's gRPC server takes (a group's hidden states are larger)."""
    return WORKER_MAX_MESSAGE if settings.layer_shards == 1 else group_max_message(settings.slots, hidden_size)


async def make_role(
    settings: WorkerSettings,
    engine: Engine,
    backend: TransferBackend,
    revision: str,
    tp_group: TPGroup | None = None,
) -> ServingRole:
    """The role `settings` asks for, over a loaded model engine and an initialized transfer
    engine. A group's leader first waits for its followers to describe their pools (LayerShardError
    if they do not); groups run on an engine that declares them (engines/base.group_engine)."""
    if is_follower(settings):
        return LayerShardFollower(settings, engine, backend)
    if settings.role == "decode":
        group: GroupHooks | None = None
        if tp_group is not None:
            group = TPDecodeGroup(settings, engine, tp_group, partial(decode_pool_layout, settings))
        elif settings.layer_shards > 1:
            max_message = grpc_max_message(settings, engine.config.hidden_size)
            group = await connect_group(settings, group_engine(engine, LAYER_SHARDS).layers, max_message)
        return DecodeRole(settings, engine, backend, revision, group=group)
    return PrefillRole(settings, engine, backend, revision, group=tp_group)
