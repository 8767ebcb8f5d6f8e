"""A colocated backend: prefill and decode in one process, one continuous batch (the baseline).

The generation loop prefills new prompts between decode steps, in the same thread, a chunk of
positions per step (colocated/prefill.py): while a long prompt is prefilled every running
request waits one chunk per token. That interference is what PD disaggregation removes, and
what `benchmarks/serve.py` measures it against.

With a prefix cache (`prefix_cache_tokens` > 0, or None: sized from memory as a prefill's is)
the prefill reuses cached prompt prefixes as a prefill worker does (kv/prefix_store.py), and
the first event reports the cached tokens.

Slots are owned as on a decode: a `SlotTable` grants one per request and takes it back when
the loop says the request left the batch. Requests beyond the free slots wait for one here,
in arrival order (no 429).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from pdserve_worker.api.backend import BackendError, RequestInfo, TokenEvent
from pdserve_worker.api.tokenizing import ModelTokenizing
from pdserve_worker.colocated.prefill import ColocatedPrefill
from pdserve_worker.decode.generation_loop import DEFAULT_PREFILL_CHUNK_TOKENS, GenerationLoop, RequestFailed
from pdserve_worker.kv.prefix_store import PrefixStore, PrefixStoreConfig, open_prefix_store
from pdserve_worker.kv.slots import SlotTable
from pdserve_worker.model.engine import Generator, colocated_cache
from pdserve_worker.model.loading.loader import LoadedModel
from pdserve_worker.model.sampling.params import FinishReason, SamplingParams

_COLOCATED = RequestInfo(disaggregated=False, kv_bytes=0)
_HOLD_S = 3600.0  # a grant is committed at once (nothing is pushed into it): its lease never runs


@dataclass(frozen=True)
class ColocatedConfig:
    """How a colocated backend is sized: `slots` requests of up to `max_len` tokens; a prefix
    cache of `prefix_cache_tokens` (0: none; None: sized from `memory_share` of the memory),
    spilling to `prefix_disk_dir` up to `prefix_disk_bytes`. `model_name` and `revision`
    default to the loaded model's name."""

    slots: int
    max_len: int
    model_name: str | None = None
    prefix_cache_tokens: int | None = 0
    prefix_block_tokens: int = 16
    memory_share: float = 1.0
    prefix_disk_dir: Path | None = None
    prefix_disk_bytes: int = 0
    revision: str = ""
    prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS


class ColocatedBackend(ModelTokenizing):
    """`router.backend.Backend` over a Generator on its own scheduler thread."""

    def __init__(self, loaded: LoadedModel, config: ColocatedConfig) -> None:
        self.model_name = config.model_name or loaded.name
        self.revision = config.revision or loaded.name  # (the system_fingerprint's)
        self.max_model_len = config.max_len
        self._tokenizer = loaded.tokenizer
        model = loaded.model
        cache = colocated_cache(model, config.slots, config.max_len)
        self.slots = SlotTable(cache.layout, quarantine_s=0.0)
        self._free: asyncio.Semaphore | None = None  # made on the serving event loop (start)
        self.prefix: PrefixStore | None = open_prefix_store(
            cache.layout,
            PrefixStoreConfig(
                config.prefix_cache_tokens,
                config.memory_share,
                config.prefix_block_tokens,
                config.revision or loaded.name,
                disk_dir=config.prefix_disk_dir,
                disk_bytes=config.prefix_disk_bytes,
            ),
            model.device,
        )
        self.prefill = ColocatedPrefill(model, cache, self.prefix, loaded.tokenizer)
        self.loop = GenerationLoop(
            Generator(model, loaded.tokenizer, cache),
            prefill=self.prefill,
            prefill_chunk_tokens=config.prefill_chunk_tokens,
            name="colocated-loop",
        )

    def start(self) -> None:
        self._free = asyncio.Semaphore(self.slots.layout.num_slots)
        self.loop.start()

    @property
    def shares_prompt_prefill(self) -> bool:
        """n copies of a prompt: the first's prefill leaves the prompt in the prefix cache, if
        there is one, for the others (api/prompt_copies.py)."""
        return self.prefix is not None

    def close(self) -> None:
        self.loop.stop()
        if self.prefix is not None:
            self.prefix.close()

    def health(self) -> dict[str, object]:
        return {"ready": True, "members": {"colocated": 1}}

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, *, cache_scope: str
    ) -> AsyncIterator[TokenEvent]:
        free = self._free
        if free is None:
            raise BackendError("ColocatedBackend.start() was not called")
        await free.acquire()  # a slot is free, or waits for the request ahead of us to leave
        grant = self.slots.reserve(request_id, _HOLD_S)
        self.slots.commit(grant.slot, grant.generation)
        event_loop = asyncio.get_running_loop()

        def done() -> None:  # on the generation loop's thread, once the request left the batch
            self.slots.release(grant.slot, grant.generation)
            with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody waits any more
                event_loop.call_soon_threadsafe(free.release)

        self.prefill.scope[grant.slot] = cache_scope  # read by the prefill on the loop's thread; the slot is ours
        try:
            stream = self.loop.submit(request_id, prompt_ids, grant.slot, params, done)
        except BaseException:
            done()
            raise
        finished = False
        first = True
        try:
            async for out in stream:
                if out.token_id is None or out.finish_reason is FinishReason.ABORT:  # aborted inside the loop
                    raise BackendError(f"request {request_id} was aborted: {out.finish_reason}")
                finished = out.finished  # before the yield: the router closes us once it has the last event
                info, prompt_logprobs = None, None
                if first:
                    cached = self.prefill.cached.pop(grant.slot, 0)
                    info = RequestInfo(disaggregated=False, kv_bytes=0, cached_tokens=cached) if cached else _COLOCATED
                    prompt_logprobs = self.prefill.prompt_logprobs.pop(grant.slot, None)
                yield TokenEvent(out.token_id, out.text, out.finish_reason, info, out.logprobs, prompt_logprobs)
                first = False
                if finished:
                    return
        except RequestFailed as exc:
            raise BackendError(str(exc)) from None
        finally:
            if not finished:
                self.loop.cancel(stream)
