"""One scheduler thread running the continuous-batching `Generator` for an asyncio server.

The model blocks, the servers are asyncio: the `Generator` lives on one thread, the only one
that touches it. Each turn applies the commands that arrived (add, cancel), then runs one
`step()`; each request's outputs go back to its event loop as a `RequestStream`.

Every request comes with the caller's slot and an `on_done`, called here once the request has
left the batch for good: only then may the slot be granted again. `submit(..., Prefilled(t))`
starts a request whose KV a prefill pushed (decode); without a first token the loop computes
the prompt itself between decode steps, `prefill_chunk_tokens` positions per turn (chunked
prefill, colocated), at least `IDLE_PREFILL_CHUNK_TOKENS` while nothing decodes.
The full account: docs/roles.md.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from pdserve_common.logs import kv
from pdserve_worker.model.engine import Detached, Generator, StepOutput
from pdserve_worker.model.sampling.params import SamplingParams, TokenLogprobs
from pdserve_worker.model.sampling.sampler import Draw
from pdserve_worker.ranks.group import GroupError

log = logging.getLogger(__name__)

_END = object()

# (prompt, slot, params) -> the first token (or its Draw, with logprobs), after writing the
# prompt's KV into the slot: a whole prompt at once.
Prefill = Callable[[list[int], int, SamplingParams], int | Draw]

DEFAULT_PREFILL_CHUNK_TOKENS = 512
IDLE_PREFILL_CHUNK_TOKENS = 2048  # the budget while nothing decodes (vLLM CPU's max_num_batched_tokens)
IDLE_TICK_S = 1.0  # how often an idle generator hook runs while no command comes


@runtime_checkable
class ChunkedPrefill(Protocol):
    """Computes prompts' KV into their slots a chunk at a time (the colocated backend's)."""

    def advance(self, prompt: list[int], slot: int, params: SamplingParams, budget: int) -> tuple[int, Draw | None]:
        """Compute up to `budget` more of the prompt's positions into `slot` (a cached prefix
        counts on the first call): the positions computed, and the first token's Draw once
        the prompt is whole (else None)."""
        ...

    def abandon(self, slot: int) -> None:
        """The request left before its prompt was whole: let go of what `advance` holds for it."""
        ...


class _WholePrompt:
    """A `Prefill` function as a `ChunkedPrefill` that takes each prompt in one piece."""

    def __init__(self, fn: Prefill) -> None:
        self._fn = fn

    def advance(self, prompt: list[int], slot: int, params: SamplingParams, budget: int) -> tuple[int, Draw | None]:
        drawn = self._fn(prompt, slot, params)
        return len(prompt), drawn if isinstance(drawn, Draw) else Draw(drawn)

    def abandon(self, slot: int) -> None:
        pass


class RequestFailed(RuntimeError):
    """The loop could not serve a request (bad input for the engine, or a failed step)."""


class InstanceEnding(RequestFailed):
    """The request failed because this decode is ending (stopping, or its tensor-parallel group
    broke): not the request's fault, and a restart of this decode may take it up again."""


class RequestStream:
    """The outputs of one request, delivered on the event loop that submitted it.

    Iterate it with `async for`; it ends after the output with `finished` set, and raises
    `RequestFailed` if the loop failed the request.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, request_id: str) -> None:
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._ended = False

    def _put(self, item: Any) -> None:
        """Called from the scheduler thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StepOutput:
        if self._ended:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _END:
            self._ended = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        if isinstance(item, Parked) or item.finished:
            self._ended = True
        return item


@dataclass
class _Entry:
    stream: RequestStream
    on_done: Callable[[], None]
    keep_kv: Callable[[list[int]], None] | None = None
    token_ids: list[int] = field(default_factory=list)  # with keep_kv: the prompt, then each token drawn
    drawn: int = 0


@dataclass
class _Add:
    entry: _Entry
    internal_id: str
    prompt_ids: list[int]
    slot: int
    params: SamplingParams
    first_token: int | None
    num_generated: int = 0
    first_logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class Prefilled:
    """A request whose prompt's KV is already in its slot: the first token (drawn by a prefill),
    how many of the prompt's last tokens were already emitted elsewhere (a resumed stream, see
    `Generator.add_prefilled`), and the first token's logprobs."""

    first_token: int
    num_generated: int = 0
    first_logprobs: TokenLogprobs | None = None


@dataclass
class _Cancel:
    internal_id: str


# (what was detached, the request's on_done) -> the handoff that now owns the request's slot.
Park = Callable[[Detached, Callable[[], None]], Any]


@dataclass
class _ParkAll:
    park: Park


@dataclass(frozen=True)
class Parked:
    """A stream's last item when its request was parked for a migration (decode/migration.py):
    `handoff` (what `park` returned) now frees the slot, not the loop."""

    handoff: Any


@dataclass
class LoopStats:
    steps: int = 0
    tokens: int = 0
    requests: int = 0
    failures: int = 0
    busy_s: float = field(default=0.0)


class GenerationLoop:
    def __init__(
        self,
        generator: Generator[Any],
        *,
        prefill: Prefill | ChunkedPrefill | None = None,
        prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
        name: str = "generation-loop",
    ) -> None:
        if prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be positive, got {prefill_chunk_tokens}")
        self._gen = generator
        self._prefill = prefill if prefill is None or isinstance(prefill, ChunkedPrefill) else _WholePrompt(prefill)
        self._chunk = prefill_chunk_tokens
        self._waiting: collections.deque[tuple[_Add, list[int]]] = collections.deque()  # (request, its prompt)
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._entries: dict[str, _Entry] = {}
        self._parked: dict[str, Any] = {}  # internal id -> its handoff (released on cancel or stop)
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._stopping = threading.Event()
        self.stats = LoopStats()

    @property
    def generator(self) -> Generator[Any]:
        return self._gen

    @property
    def active(self) -> int:
        """Requests submitted and not yet finished (approximate: read from another thread)."""
        return len(self._entries)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Fail whatever is still running and end the thread."""
        self._stopping.set()
        self._commands.put(None)
        if self._thread.ident is not None:  # started (a worker that failed to start never did)
            self._thread.join(timeout_s)

    # ---- submitting (any thread; streams are bound to the running event loop) ----------------

    def submit(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        slot: int,
        params: SamplingParams,
        on_done: Callable[[], None],
        prefilled: Prefilled | None = None,
        keep_kv: Callable[[list[int]], None] | None = None,
    ) -> RequestStream:
        """Run a request in `slot`; `on_done` runs once the slot is no longer used, however the
        request ends (also when it is refused). `keep_kv`, called just before `on_done` when
        the request finished or was cancelled after its first token, gets the tokens whose KV
        its slot holds (the prompt, then what it drew but the last: that one was never fed).

        With `prefilled` the prompt's KV is already in the slot; without it this loop's
        `prefill` computes it first.
        """
        if prefilled is None and self._prefill is None:
            raise RuntimeError("this loop decodes KV computed elsewhere: pass the request's first_token")
        if self._stopping.is_set():
            raise InstanceEnding("the generation loop is stopping")
        # The Generator keys requests by id; ids from outside need not be unique here.
        internal = f"{request_id}#{next(self._ids)}"
        stream = RequestStream(asyncio.get_running_loop(), internal)
        ids = [int(t) for t in prompt_ids]
        entry = _Entry(stream, on_done, keep_kv, list(ids) if keep_kv is not None else [])
        if prefilled is None:
            self._commands.put(_Add(entry, internal, ids, slot, params, None))
        else:
            p = prefilled
            self._commands.put(
                _Add(entry, internal, ids, slot, params, p.first_token, p.num_generated, p.first_logprobs)
            )
        return stream

    def cancel(self, stream: RequestStream) -> None:
        """Stop a request early (the client went away); its `on_done` runs on the loop (a parked
        request's handoff is released instead)."""
        self._commands.put(_Cancel(stream.request_id))

    def park_all(self, park: Park) -> None:
        """After the current step, take every running request out of the batch (a draining
        decode migrates them): `park(detached, on_done)` makes each one's handoff, which its
        stream receives as its last item (`Parked`) and which frees its slot from then on."""
        self._commands.put(_ParkAll(park))

    # ---- the scheduler thread -----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._apply_commands(block=not (self._gen.has_work() or self._waiting))
            if self._stopping.is_set():
                self._fail_all(InstanceEnding("the generation loop stopped"))
                for handoff in self._parked.values():
                    handoff.release()
                self._parked.clear()
                return
            if self._waiting:
                self._prefill_some()
            if not self._gen.has_work():
                continue
            started = time.perf_counter()
            try:
                outputs = self._gen.step()
            except Exception as exc:  # a bug or a bad request inside the batch: fail the batch, keep serving
                log.exception(kv(event="generation_step_failed", running=len(self._entries), error=repr(exc)))
                self.stats.failures += 1
                ending = InstanceEnding if isinstance(exc, GroupError) else RequestFailed
                self._fail_all(ending(f"generation step failed: {exc}"))
                continue
            self.stats.busy_s += time.perf_counter() - started
            self.stats.steps += 1
            self.stats.tokens += sum(1 for o in outputs if o.token_id is not None)
            self._dispatch(outputs)

    def _apply_commands(self, block: bool) -> None:
        # A generator that ticks when idle (a tensor-parallel decode's: ranks/decode.py) has its
        # `idle` called while nothing comes, on this thread, the one that runs its collectives.
        idle = self._gen.idle if block and self._gen.ticks_when_idle else None
        try:
            command = self._commands.get(block=block, timeout=IDLE_TICK_S if idle is not None else None)
        except queue.Empty:
            if idle is not None:
                try:
                    idle()
                except Exception as exc:  # (the generator says how it fails: a broken group ends the process)
                    log.error(kv(event="generator_idle_failed", error=repr(exc)))
            return
        while True:
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Cancel):
                self._cancel(command.internal_id)
            elif isinstance(command, _ParkAll):
                self._park_all(command.park)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, command: _Add) -> None:
        self._entries[command.internal_id] = command.entry
        self.stats.requests += 1
        if command.first_token is None:  # this loop computes the prompt: it waits its turn
            try:
                self._waiting.append((command, self._gen.check_prompt(command.prompt_ids)))
            except ValueError as exc:  # refused before it joined: the slot was never the Generator's
                self._end(command.internal_id, RequestFailed(str(exc)))
            return
        self._join(command, command.first_token, command.first_logprobs)

    def _prefill_some(self) -> None:
        """Up to one chunk's worth of waiting prompts' positions, oldest prompt first (a bigger
        chunk while nothing decodes: module doc); each prompt that is whole joins the batch."""
        assert self._prefill is not None  # submit() checked
        budget = self._chunk if self._gen.num_running else max(self._chunk, IDLE_PREFILL_CHUNK_TOKENS)
        while budget > 0 and self._waiting:
            command, prompt = self._waiting[0]
            try:
                used, drawn = self._prefill.advance(prompt, command.slot, command.params, budget)
            except Exception as exc:  # (any failure fails this prompt alone: the loop goes on serving)
                self._waiting.popleft()
                self._prefill.abandon(command.slot)
                self._end(command.internal_id, RequestFailed(str(exc)))
                continue
            budget -= max(used, 1)
            if drawn is not None:
                self._waiting.popleft()
                self._join(command, drawn.token, drawn.logprobs)

    def _join(self, command: _Add, first: int, logprobs: TokenLogprobs | None) -> None:
        """The request, its prompt's KV in its slot and its first token known, joins the batch."""
        try:
            _, output = self._gen.add_prefilled(
                command.prompt_ids,
                command.slot,
                first,
                command.params,
                command.internal_id,
                command.num_generated,
                logprobs,
            )
        except (ValueError, RuntimeError, IndexError) as exc:
            # Refused before it joined the batch: the slot was never the Generator's.
            self._end(command.internal_id, RequestFailed(str(exc)))
            return
        self._dispatch([output])

    def _cancel(self, internal_id: str) -> None:
        handoff = self._parked.pop(internal_id, None)
        if handoff is not None:
            handoff.release()  # idempotent: a Migrate may have released it already
            return
        if internal_id not in self._entries:
            return  # finished meanwhile
        if self._drop_waiting(internal_id):
            self._end(internal_id, _END)
            return
        self._gen.abort(internal_id)
        self._end(internal_id, _END)

    def _park_all(self, park: Park) -> None:
        self._parked = {i: h for i, h in self._parked.items() if not h.settled}
        for internal_id in list(self._entries):
            detached = self._gen.detach(internal_id)
            if detached is None:
                continue
            entry = self._entries.pop(internal_id)
            try:
                handoff = park(detached, entry.on_done)
            except Exception as exc:  # never lose the slot: end the request the usual way
                log.exception(kv(event="park_failed", request=internal_id))
                self._entries[internal_id] = entry
                self._end(internal_id, RequestFailed(f"could not hand the request over: {exc}"))
                continue
            self._parked[internal_id] = handoff
            entry.stream._put(Parked(handoff))

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            entry = self._entries.get(out.request_id)
            if entry is not None:
                entry.drawn += 1  # (a final output too: its prompt's KV was whole)
            if out.finished:
                self._end(out.request_id, out)
                continue
            if entry is not None:
                if entry.keep_kv is not None and out.token_id is not None:
                    entry.token_ids.append(out.token_id)
                entry.stream._put(out)

    def _end(self, internal_id: str, final: Any) -> None:
        """The request leaves for good: `on_done` (which frees its slot) runs before the stream's
        last item is delivered, so whoever sees a stream end sees its slot free too."""
        entry = self._entries.pop(internal_id, None)
        if entry is None:
            return
        try:
            if entry.keep_kv is not None and entry.drawn and (final is _END or isinstance(final, StepOutput)):
                # Finished on a token: that one is not in token_ids and every one before it was
                # fed. Cancelled or aborted: the last token drawn was not fed yet.
                finished = isinstance(final, StepOutput) and final.token_id is not None
                entry.keep_kv(entry.token_ids if finished else entry.token_ids[:-1])
            entry.on_done()
        except Exception:
            log.exception(kv(event="on_done_failed", request=internal_id))
        if final is not None:
            entry.stream._put(final)

    def _drop_waiting(self, internal_id: str) -> bool:
        """Take a request whose prompt was not whole yet out of the wait (letting go of its part)."""
        for index, (command, _) in enumerate(self._waiting):
            if command.internal_id == internal_id:
                del self._waiting[index]
                assert self._prefill is not None
                self._prefill.abandon(command.slot)
                return True
        return False

    def _fail_all(self, error: RequestFailed) -> None:
        while self._waiting:
            self._drop_waiting(self._waiting[0][0].internal_id)
        for internal_id in list(self._entries):
            self._gen.abort(internal_id)
            self._end(internal_id, error)
