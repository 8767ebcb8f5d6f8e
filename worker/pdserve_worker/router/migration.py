"""The router's side of a live migration: move a stream off a draining decode without a prefill.

A draining decode ends its token stream with a `handover` event (worker.proto; decode/migration.py
is that side). The router, which holds every token the client was sent, then:
1. reserves KV on another decode with normal admission (`Grants.reserve_decode`, never the source
   or a decode this request already failed on), as a resume would;
2. opens `Generate(migrated=True)` there with prompt + streamed tokens and the source's seed,
   with a short readiness wait (the KV comes within one Migrate call, not after a prefill);
3. calls the source's `Migrate` with the new grant(s): the source pushes its KV and notifies the
   target. The target's stream then starts at the next token: no gap, no token twice.
Any failure on the way raises `MigrationFailed`, and the caller resumes the request the old way
(re-prefill on another decode) with the handover's seed, so the text is the same. The target's
grant is given back on every failure (free at once when the source's push is settled).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve_common.logs import kv
from pdserve_common.membership import Member
from pdserve_worker.api.backend import BackendError, NoCapacity
from pdserve_worker.model.sampling.params import SamplingParams
from pdserve_worker.router.request import RoutedRequest
from pdserve_worker.rpc.convert import sampling_to_proto
from pdserve_worker.rpc.trailers import push_settled

if TYPE_CHECKING:
    from pdserve_worker.api.metrics import RouterMetrics

log = logging.getLogger(__name__)

MIGRATE_S = 10.0  # the Migrate call, and the target's wait for the KV after it


class DecodePort(Protocol):
    """What a migration needs of the router, and no more (router/grants.Grants is one): take KV on a decode
    with normal admission, reach a member, give a grant back, run a task past the request."""

    async def reserve_decode(
        self, request_id: str, num_prompt_tokens: int, max_tokens: int, avoid: Mapping[str, int]
    ) -> tuple[Member, worker_pb2.Grant]: ...

    async def release_decode(self, decode: Member, grant: worker_pb2.Grant, push_settled: bool) -> bool | None: ...

    def channel(self, member: Member) -> grpc.aio.Channel: ...

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None: ...


def push_targets(grant: worker_pb2.Grant) -> list[worker_pb2.Grant]:
    """Where the prefill pushes: every member of a layer-sharded group (its leader lists them
    in `group_grants`), else the one decode that granted the slot."""
    return list(grant.group_grants) or [grant]


class MigrationFailed(BackendError):
    """The request could not be moved; the caller resumes it by re-prefilling."""


@dataclass
class Moved:
    """The request's new home: the target decode, its grant and the open Generate call."""

    decode: Member
    grant: worker_pb2.Grant
    call: Any  # grpc.aio.UnaryStreamCall
    kv_bytes: int
    seconds: float


async def migrate(
    port: DecodePort,
    request: RoutedRequest,
    params: SamplingParams,
    source: Member,
    source_grant: worker_pb2.Grant,
    handover: worker_pb2.Handover,
) -> Moved:
    """Move the request off `source` (see the module docstring); raises MigrationFailed."""
    started = time.monotonic()
    request_id, emitted = request.request_id, request.emitted
    if handover.num_generated != len(emitted) or not emitted:
        raise MigrationFailed(
            f"decode {source.worker_id} handed request {request_id} over after "
            f"{handover.num_generated} tokens, the client has {len(emitted)}"
        )
    tokens = request.prompt_ids + emitted
    sampling = sampling_to_proto(params)
    sampling.seed = handover.seed  # the source's (it chose one if the request had none)
    try:
        target, grant = await port.reserve_decode(
            request_id, len(tokens), params.max_tokens - len(emitted), {**request.avoid, source.worker_id: 0}
        )
    except (NoCapacity, BackendError) as exc:
        raise MigrationFailed(f"no decode could take request {request_id} over: {exc}") from None
    call = None
    settled = False
    ok = False
    try:
        call = worker_pb2_grpc.DecodeStub(port.channel(target)).Generate(
            _target_request(request_id, grant, tokens, sampling, len(emitted))
        )
        try:
            reply = await worker_pb2_grpc.DecodeStub(port.channel(source)).Migrate(
                worker_pb2.MigrateRequest(
                    request_id=request_id,
                    slot=source_grant.slot,
                    generation=source_grant.generation,
                    targets=push_targets(grant),
                ),
                timeout=MIGRATE_S,
            )
        except grpc.aio.AioRpcError as exc:
            # (The target is not avoided by the resume: a failed push may be the leaving source's
            # fault, and a target that is really gone refuses the resume's Reserve anyway.)
            settled = push_settled(exc)
            raise MigrationFailed(
                f"decode {source.worker_id} could not push request {request_id} to "
                f"{target.worker_id}: {exc.code().name} {exc.details()}"
            ) from None
        ok = True
        return Moved(target, grant, call, reply.kv_bytes, time.monotonic() - started)
    finally:
        if not ok:
            if call is not None:
                call.cancel()
            port.spawn(_give_back(port, target, grant, settled))


def _target_request(
    request_id: str, grant: worker_pb2.Grant, tokens: list[int], sampling: Any, num_generated: int
) -> worker_pb2.GenerateRequest:
    """The target's Generate: it waits for the source's push (twice the Migrate's time)."""
    return worker_pb2.GenerateRequest(
        request_id=request_id,
        slot=grant.slot,
        generation=grant.generation,
        prompt_token_ids=tokens,
        sampling=sampling,
        readiness_timeout_ms=int(MIGRATE_S * 2000),
        num_generated=num_generated,
        migrated=True,
    )


async def _give_back(port: DecodePort, target: Member, grant: worker_pb2.Grant, settled: bool) -> None:
    released = await port.release_decode(target, grant, settled)
    log.debug(
        kv(
            event="migration_grant_returned",
            decode=target.worker_id,
            slot=grant.slot,
            settled=settled,
            released=released,
        )
    )


def note(
    metrics: RouterMetrics | None, request_id: str, source: str, moved: Moved | None, error: BaseException | None = None
) -> None:
    """Log and count one migration's outcome."""
    if moved is not None:
        log.info(
            kv(
                event="request_migrated",
                request=request_id,
                source=source,
                target=moved.decode.worker_id,
                kv_bytes=moved.kv_bytes,
                seconds=f"{moved.seconds:.4f}",
            )
        )
    else:
        log.warning(kv(event="migration_fallback", request=request_id, source=source, error=str(error)))
    if metrics is not None:
        metrics.observe_migration(moved is not None, moved.seconds if moved else 0.0, moved.kv_bytes if moved else 0)
