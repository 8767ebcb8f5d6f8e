"""Colocated generation with continuous batching: requests join and leave between steps.

`Generator.step()` first admits waiting requests into free KV slots (prefill, first token),
then advances every running request by one token in a single batched `decode_step`. A
finished request frees its slot at once, so the next step may admit another. The decode role
reuses the same loop for requests whose KV a prefill worker pushed (`add_prefilled`).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from pdserve_worker.kv.cache import KVCache, dtype_name
from pdserve_worker.model.llama import LlamaModel
from pdserve_worker.model.sampling import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    Sampler,
    StopStringMatcher,
    stop_token_ids,
)
from pdserve_worker.model.sampling_params import SamplingParams
from pdserve_worker.model.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True)
class StepOutput:
    """One request's progress in one step: its new token and text (either may be empty)."""

    request_id: str
    token_id: int | None
    text: str
    finished: bool = False
    finish_reason: str | None = None


@dataclass
class GenerationStats:
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_ms_per_step(self) -> float:
        return 1000 * self.decode_seconds / self.decode_steps if self.decode_steps else 0.0


@dataclass
class _Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sampler: Sampler
    stops: frozenset[int]
    detok: IncrementalDetokenizer
    matcher: StopStringMatcher
    slot: int = -1
    position: int = 0  # where the next input token's KV goes
    last_token: int = -1
    output_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Completion:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str


class Generator:
    """Runs many requests through one model and one KV pool (one slot per request)."""

    def __init__(
        self,
        model: LlamaModel,
        tokenizer: Tokenizer,
        num_slots: int = 8,
        max_len: int | None = None,
        cache: KVCache | None = None,
        layers_per_chunk: int | None = None,
        prefill_token_budget: int = 4096,
    ) -> None:
        if prefill_token_budget < 1:
            raise ValueError(f"prefill_token_budget must be positive, got {prefill_token_budget}")
        self.model = model
        self.prefill_token_budget = prefill_token_budget
        self.tokenizer = tokenizer
        if cache is None:
            length = max_len or min(model.config.max_position_embeddings, 4096)
            layout = model.config.kv_layout(num_slots, length, dtype_name(model.dtype))
            cache = KVCache.allocate(layout, model.device)
        if cache.layout.layer_range != range(model.config.num_layers):
            raise ValueError(f"a colocated Generator needs every layer in its pool, got {cache.layout.layer_range}")
        if cache.dtype != model.dtype:
            raise ValueError(f"KV pool dtype {cache.dtype} differs from the model's {model.dtype}")
        self.cache = cache
        self.layers_per_chunk = layers_per_chunk
        self.stats = GenerationStats()
        self._free: list[int] = list(range(cache.layout.num_slots))  # a heap: lowest slot first keeps batches compact
        self._waiting: deque[_Request] = deque()
        self._running: dict[str, _Request] = {}
        self._ids = itertools.count()

    # ---- requests ------------------------------------------------------------------------------

    @property
    def max_len(self) -> int:
        return self.cache.layout.max_len

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def add(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Queue a prompt; it is prefilled when a slot is free (at the next `step`)."""
        request = self._new_request(prompt_ids, params, request_id)
        self._waiting.append(request)
        return request.request_id

    def reserve_slot(self) -> int:
        """Take a free slot for KV that arrives from elsewhere (a prefill worker)."""
        if not self._free:
            raise RuntimeError(f"no free KV slot (all {self.cache.layout.num_slots} in use)")
        return heapq.heappop(self._free)

    def release_slot(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.cache.layout.num_slots:
            raise ValueError(f"slot {slot} is not reserved")
        heapq.heappush(self._free, slot)

    def add_prefilled(
        self,
        prompt_ids: Sequence[int],
        slot: int,
        first_token: int,
        params: SamplingParams,
        request_id: str | None = None,
        num_generated: int = 0,
    ) -> tuple[str, StepOutput]:
        """Adopt a request whose prompt KV is already in `slot` (reserved) and whose first token is known.

        Resuming (`num_generated > 0`): the last `num_generated` of `prompt_ids` are tokens
        another worker already emitted (its stream broke). They count as this request's
        output: the sampler index, `max_tokens` and the detokenizer go on where that worker
        was, so the text deltas of the rest are exactly those it would have streamed.
        `first_token` is then the token at index `num_generated`.
        """
        ids = [int(t) for t in prompt_ids]
        if not 0 <= num_generated < len(ids):
            raise ValueError(f"num_generated ({num_generated}) must leave a prompt: {len(ids)} tokens in the slot")
        if num_generated >= params.max_tokens:
            raise ValueError(f"num_generated ({num_generated}) already reaches max_tokens ({params.max_tokens})")
        split = len(ids) - num_generated
        request = self._new_request(ids[:split], params, request_id)
        self._replay(request, ids[split:])
        request.slot = slot
        request.position = len(ids)
        self._running[request.request_id] = request
        return request.request_id, self._accept(request, first_token)

    def abort(self, request_id: str) -> StepOutput | None:
        for request in list(self._waiting):
            if request.request_id == request_id:
                self._waiting.remove(request)
                return StepOutput(request_id, None, "", True, FINISH_ABORT)
        request = self._running.get(request_id)
        if request is None:
            return None
        self._finish(request)
        return StepOutput(request_id, None, "", True, FINISH_ABORT)

    # ---- the loop ----------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Admit what fits, then one token for every running request."""
        outputs = self._admit()
        admitted = {o.request_id for o in outputs}
        # Sorted by slot: consecutive slots are read as one view of the pool (see LlamaModel).
        decoding = sorted((r for r in self._running.values() if r.request_id not in admitted), key=lambda r: r.slot)
        if decoding:
            started = time.perf_counter()
            logits = self.model.decode_step(
                self.cache,
                [r.slot for r in decoding],
                [r.position for r in decoding],
                [r.last_token for r in decoding],
            )
            for row, request in enumerate(decoding):
                request.position += 1
                token = request.sampler.sample(logits[row], len(request.output_ids))
                outputs.append(self._accept(request, token))
            self.stats.decode_seconds += time.perf_counter() - started
            self.stats.decode_steps += 1
            self.stats.decode_tokens += len(decoding)
        return outputs

    def stream(self) -> Iterator[StepOutput]:
        """Step until every request has finished, yielding outputs as they come."""
        while self.has_work():
            yield from self.step()

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]) -> list[Completion]:
        """Run a set of prompts to completion together; results in prompt order."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [self.add(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        texts: dict[str, list[str]] = {i: [] for i in ids}
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        reasons: dict[str, str] = {}
        for out in self.stream():
            texts[out.request_id].append(out.text)
            if out.token_id is not None:
                tokens[out.request_id].append(out.token_id)
            if out.finished:
                reasons[out.request_id] = out.finish_reason or FINISH_STOP
        return [Completion(i, list(p), tokens[i], "".join(texts[i]), reasons[i]) for i, p in zip(ids, prompts)]

    # ---- internals ---------------------------------------------------------------------------------

    def _new_request(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None) -> _Request:
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt has no tokens")
        if len(prompt) >= self.max_len:
            raise ValueError(f"prompt of {len(prompt)} tokens leaves no room in a KV slot of {self.max_len}")
        return _Request(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_ids=prompt,
            params=params,
            sampler=Sampler(params),
            stops=stop_token_ids(params, self.tokenizer.eos_token_ids),
            detok=self.tokenizer.detokenizer(skip_special_tokens=True),
            matcher=StopStringMatcher(tuple(params.stop)),
        )

    @staticmethod
    def _replay(request: _Request, emitted: list[int]) -> None:
        """Bring a fresh request to the state it had after emitting `emitted` (text discarded).

        The detokenizer and stop-string matcher are fed as they were the first time, so what
        they held back then (an incomplete character, a possible stop-string start) is still
        held and comes out with the next tokens, as it would have.
        """
        for token in emitted:
            request.output_ids.append(token)
            request.matcher.feed(request.detok.push(token))
        if emitted:
            request.last_token = emitted[-1]

    def _admit(self) -> list[StepOutput]:
        """Prefill what waits and fits: prompts admitted together share one forward pass
        (`LlamaModel.prefill_batch`), up to `prefill_token_budget` tokens (the first always goes)."""
        outputs = []
        while self._waiting and self._free:
            batch: list[_Request] = []
            tokens = 0
            while self._waiting and self._free:
                if batch and tokens + len(self._waiting[0].prompt_ids) > self.prefill_token_budget:
                    break
                request = self._waiting.popleft()
                request.slot = heapq.heappop(self._free)
                batch.append(request)
                tokens += len(request.prompt_ids)
            started = time.perf_counter()
            if len(batch) == 1:
                logits = self.model.prefill(batch[0].prompt_ids, self.cache, batch[0].slot, self.layers_per_chunk)[None]
            else:
                logits = self.model.prefill_batch([r.prompt_ids for r in batch], self.cache, [r.slot for r in batch],
                                                  self.layers_per_chunk)
            self.stats.prefill_seconds += time.perf_counter() - started
            self.stats.prefill_tokens += tokens
            for row, request in enumerate(batch):
                request.position = len(request.prompt_ids)
                self._running[request.request_id] = request
                outputs.append(self._accept(request, request.sampler.sample(logits[row], 0)))
        return outputs

    def _accept(self, request: _Request, token: int) -> StepOutput:
        """Record a sampled token: emit its text, or finish the request."""
        request.output_ids.append(token)
        request.last_token = token
        if token in request.stops:
            return self._done(request, token, request.matcher.feed(request.detok.flush()) + request.matcher.finish(), FINISH_STOP)
        text = request.matcher.feed(request.detok.push(token))
        if request.matcher.matched is not None:
            return self._done(request, token, text, FINISH_STOP)
        if len(request.output_ids) >= request.params.max_tokens or request.position >= self.max_len:
            tail = request.matcher.feed(request.detok.flush())
            reason = FINISH_STOP if request.matcher.matched is not None else FINISH_LENGTH
            return self._done(request, token, text + tail + request.matcher.finish(), reason)
        return StepOutput(request.request_id, token, text)

    def _done(self, request: _Request, token: int, text: str, reason: str) -> StepOutput:
        self._finish(request)
        return StepOutput(request.request_id, token, text, True, reason)

    def _finish(self, request: _Request) -> None:
        self._running.pop(request.request_id, None)
        if request.slot >= 0:
            heapq.heappush(self._free, request.slot)
            request.slot = -1


@torch.inference_mode()
def greedy_tokens(model: LlamaModel, cache: KVCache, slot: int, prompt_ids: Sequence[int], count: int) -> list[int]:
    """`count` greedy tokens after a prompt, one request alone (a reference for tests and benchmarks)."""
    logits = model.prefill(prompt_ids, cache, slot)
    out = [int(torch.argmax(logits))]
    position = len(prompt_ids)
    while len(out) < count:
        logits = model.decode_step(cache, [slot], [position], [out[-1]])
        out.append(int(torch.argmax(logits[0])))
        position += 1
    return out
