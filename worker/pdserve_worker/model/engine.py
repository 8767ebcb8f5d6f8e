"""Continuous batching: requests join and leave a batch between decode steps.

`Generator.step()` advances every running request by one token in a single batched
`decode_step`. A request joins with its prompt's KV already in a slot and its first token
known (`add_prefilled`): a prefill worker pushed the KV (decode), or this process computed it
(`prefill_first_token`: the colocated baseline and `pdserve generate`). The slots are the
caller's: the Generator is told which slot a request uses and reports when the request
finished, and the caller (the decode's `SlotTable`) frees the slot then. It never picks a slot
itself, so one table says who owns which slot.

What it drives is a `Decoder` (`LlamaModel`, or a layer-sharded group's `LayerShardDecoder`)
over a `KVView` (a `KVCache`, or the group's `GroupKV`).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Generic, Protocol, TypeVar

import torch

from pdserve_common.kv_layout import KVLayout
from pdserve_common.logs import kv
from pdserve_worker.kv.cache import KVCache, dtype_name
from pdserve_worker.model.config import ModelConfig
from pdserve_worker.model.layers.llama import LlamaModel, PrefillOutputs
from pdserve_worker.model.sampling.grammar_mask import GrammarMatcher, mask_rows
from pdserve_worker.model.sampling.params import FinishReason, SamplingParams, TokenLogprobs
from pdserve_worker.model.sampling.sampler import (
    Draw,
    Sampler,
    StopStringMatcher,
    draw_first,
    prompt_token_logprobs,
    stop_token_ids,
)
from pdserve_worker.model.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)


class KVView(Protocol):
    """What the Generator reads of a KV pool: its geometry and dtype (never its bytes)."""

    @property
    def layout(self) -> KVLayout: ...

    @property
    def dtype(self) -> torch.dtype: ...


CacheT = TypeVar("CacheT", bound=KVView)
CacheT_contra = TypeVar("CacheT_contra", bound=KVView, contravariant=True)


class Decoder(Protocol[CacheT_contra]):
    """What the Generator drives: one batched decode step over slots of a pool."""

    @property
    def config(self) -> ModelConfig: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def decode_step(
        self, cache: CacheT_contra, slots: Sequence[int], positions: Sequence[int], token_ids: Sequence[int]
    ) -> torch.Tensor:
        """Logits `[B, vocab]` of one token per slot (the token is written at its position)."""
        ...


@dataclass(frozen=True)
class StepOutput:
    """One request's progress in one step: its new token and text (either may be empty)."""

    request_id: str
    token_id: int | None
    text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    logprobs: TokenLogprobs | None = None  # the token's, when the request asked for them


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
    grammar: GrammarMatcher | None = None  # structured outputs: what may come next


@dataclass(frozen=True)
class Detached:
    """A running request taken out of the batch with everything needed to go on elsewhere:
    its KV holds `kv_tokens` positions (every token but the last output, which the next step
    would have written), and replaying `output_ids` on a fresh request with the same `seed`
    rebuilds its sampler index, detokenizer and stop-string state exactly."""

    request_id: str
    slot: int
    prompt_ids: list[int]
    output_ids: list[int]
    seed: int

    @property
    def kv_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) - 1


@dataclass(frozen=True)
class Completion:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: FinishReason
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per output token, if asked for
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # prompt tokens 1..n-1's, if asked for


class Generator(Generic[CacheT]):
    """Runs many requests through one decoder and one KV pool, one caller-owned slot per request."""

    # Whether `idle` must run while no work comes (a tensor-parallel decode's: its ranks wait on
    # collectives, ranks/decode.py); the generation loop then wakes every tick to call it.
    ticks_when_idle = False

    def idle(self) -> None:
        """Called on the loop's thread while nothing comes, where `ticks_when_idle`."""

    def __init__(self, model: Decoder[CacheT], tokenizer: Tokenizer, cache: CacheT) -> None:
        if cache.layout.layer_range != range(model.config.num_layers):
            raise ValueError(f"a Generator needs every layer in its pool, got {cache.layout.layer_range}")
        if cache.dtype != model.dtype:
            raise ValueError(f"KV pool dtype {cache.dtype} differs from the model's {model.dtype}")
        self.model = model
        self.tokenizer = tokenizer
        self.cache = cache
        self.stats = GenerationStats()
        self._running: dict[str, _Request] = {}
        self._slots: dict[int, str] = {}  # slot -> the running request in it
        self._ids = itertools.count()

    # ---- requests ------------------------------------------------------------------------------

    @property
    def max_len(self) -> int:
        return self.cache.layout.max_len

    @property
    def num_slots(self) -> int:
        return self.cache.layout.num_slots

    def has_work(self) -> bool:
        return bool(self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def check_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        """The prompt as ints; ValueError if it is empty or leaves no room in a slot."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt has no tokens")
        if len(prompt) >= self.max_len:
            raise ValueError(f"prompt of {len(prompt)} tokens leaves no room in a KV slot of {self.max_len}")
        return prompt

    def add_prefilled(
        self,
        prompt_ids: Sequence[int],
        slot: int,
        first_token: int,
        params: SamplingParams,
        request_id: str | None = None,
        num_generated: int = 0,
        first_logprobs: TokenLogprobs | None = None,
    ) -> tuple[str, StepOutput]:
        """Adopt a request whose prompt KV is already in `slot` and whose first token is known
        (with its logprobs, drawn where it was drawn, when the request asks for them).

        The slot stays the caller's: it must not hold another running request, and it is free
        for the caller again once this request's last output (`finished`) came out, or after
        `abort`.

        Resuming (`num_generated > 0`): the last `num_generated` of `prompt_ids` are tokens
        another worker already emitted (its stream broke). They count as this request's
        output: the sampler index, `max_tokens` and the detokenizer go on where that worker
        was, so the text deltas of the rest are exactly those it would have streamed.
        `first_token` is then the token at index `num_generated`.
        """
        ids = self.check_prompt(prompt_ids)
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} outside the pool's {self.num_slots} slots")
        if slot in self._slots:
            raise ValueError(f"slot {slot} already holds running request {self._slots[slot]!r}")
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
        self._slots[slot] = request.request_id
        try:
            return request.request_id, self._accept(request, first_token, first_logprobs)
        except ValueError:  # a first token its grammar does not allow: the request never joined
            self._finish(request)
            raise

    def abort(self, request_id: str) -> StepOutput | None:
        """Take a request out of the batch (its slot is the caller's again); None if unknown."""
        request = self._running.get(request_id)
        if request is None:
            return None
        self._finish(request)
        return StepOutput(request_id, None, "", True, FinishReason.ABORT)

    def detach(self, request_id: str) -> Detached | None:
        """Take a running request out of the batch to continue it elsewhere (a migration); its
        slot is the caller's again and its KV stays there untouched. None if unknown."""
        request = self._running.get(request_id)
        if request is None:
            return None
        self._finish(request)
        return Detached(
            request.request_id, request.slot, list(request.prompt_ids), list(request.output_ids), request.sampler.seed
        )

    # ---- the loop ----------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """One token for every running request."""
        # Sorted by slot: consecutive slots are read as one view of the pool (see LlamaModel).
        decoding = sorted(self._running.values(), key=lambda r: r.slot)
        if not decoding:
            return []
        started = time.perf_counter()
        logits = self.model.decode_step(
            self.cache,
            [r.slot for r in decoding],
            [r.position for r in decoding],
            [r.last_token for r in decoding],
        )
        mask_rows(logits, [r.grammar for r in decoding])  # one bitmask over the batch; none without grammars
        argmax = _plain_greedy_tokens(logits, decoding)
        outputs = []
        for row, request in enumerate(decoding):
            request.position += 1
            if argmax is not None and _plain_greedy(request.params):
                outputs.append(self._accept(request, argmax[row]))
            else:
                outputs.append(self._sample_and_accept(request, logits[row]))
        self.stats.decode_seconds += time.perf_counter() - started
        self.stats.decode_steps += 1
        self.stats.decode_tokens += len(decoding)
        return outputs

    def stream(self) -> Iterator[StepOutput]:
        """Step until every request has finished, yielding outputs as they come."""
        while self.has_work():
            yield from self.step()

    # ---- internals ---------------------------------------------------------------------------------

    def _new_request(self, prompt: list[int], params: SamplingParams, request_id: str | None) -> _Request:
        return _Request(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_ids=prompt,
            params=params,
            sampler=Sampler(params),
            stops=stop_token_ids(params, self.tokenizer.eos_token_ids),
            detok=self.tokenizer.detokenizer(skip_special_tokens=params.skip_special_tokens),
            matcher=StopStringMatcher(tuple(params.stop), include=params.include_stop_str_in_output),
            grammar=GrammarMatcher.start(self.tokenizer, self.model.config.vocab_size, params.grammar),
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
        if request.grammar is not None:  # its state is the tokens it consumed: nothing to carry
            request.grammar.consume(emitted)
        if emitted:
            request.last_token = emitted[-1]

    def _sample_and_accept(self, request: _Request, logits: torch.Tensor) -> StepOutput:
        """Draw the request's next token and record it. A draw that fails (parameters its
        sampler cannot honour) aborts this request alone: the batch's other requests never
        pay for one client's sampling parameters."""
        try:
            drawn = request.sampler.draw(
                logits, len(request.output_ids), request.prompt_ids, request.output_ids, tuple(request.stops)
            )
            return self._accept(request, drawn.token, drawn.logprobs)
        except (RuntimeError, ValueError) as exc:  # (ValueError: also a token its grammar refused)
            log.error(kv(event="sampling_failed", request=request.request_id, error=repr(exc)))
            self._finish(request)
            return StepOutput(request.request_id, None, "", True, FinishReason.ABORT)

    def _accept(self, request: _Request, token: int, logprobs: TokenLogprobs | None = None) -> StepOutput:
        """Record a sampled token: emit its text, or finish the request."""
        request.output_ids.append(token)
        request.last_token = token
        matcher = request.matcher
        if token in request.stops:
            # The stop token's own text only with include_stop_str_in_output (vLLM's
            # detokenizer: skipped_stop_token_id); a special one still needs skip_special_tokens=false.
            last = request.detok.push(token) if request.params.include_stop_str_in_output else ""
            text = matcher.feed(last + request.detok.flush()) + matcher.finish()
            return self._done(request, token, text, FinishReason.STOP, logprobs)
        if request.grammar is not None:
            request.grammar.consume([token])  # (GrammarError, a ValueError, for a token it does not allow)
        text = matcher.feed(request.detok.push(token))
        if matcher.matched is not None or (request.grammar is not None and request.grammar.done):
            tail = matcher.feed(request.detok.flush()) if matcher.matched is None else ""
            return self._done(request, token, text + tail + matcher.finish(), FinishReason.STOP, logprobs)
        if len(request.output_ids) >= request.params.max_tokens or request.position >= self.max_len:
            tail = matcher.feed(request.detok.flush())
            reason = FinishReason.STOP if matcher.matched is not None else FinishReason.LENGTH
            return self._done(request, token, text + tail + matcher.finish(), reason, logprobs)
        return StepOutput(request.request_id, token, text, logprobs=logprobs)

    def _done(
        self, request: _Request, token: int, text: str, reason: FinishReason, logprobs: TokenLogprobs | None
    ) -> StepOutput:
        self._finish(request)
        return StepOutput(request.request_id, token, text, True, reason, logprobs)

    def _finish(self, request: _Request) -> None:
        self._running.pop(request.request_id, None)
        self._slots.pop(request.slot, None)


def _plain_greedy(params: SamplingParams) -> bool:
    """Greedy with nothing else to compute: no logits processor, no logprobs, no grammar (its
    draw is the argmax of the row, as `Sampler.draw` takes it, and cannot fail)."""
    return params.greedy and not params.processed and params.logprobs is None and params.grammar is None


def _plain_greedy_tokens(logits: torch.Tensor, decoding: Sequence[_Request]) -> list[int] | None:
    """Every row's argmax in one op where some row is plain greedy (None where none is): one
    fp32 copy and argmax of the batch instead of one per row (4x cheaper at 16 rows; benchmarks/
    README.md); the same token as `Sampler.draw`'s, first maximum."""
    if not any(_plain_greedy(r.params) for r in decoding):
        return None
    return [int(t) for t in logits.detach().to("cpu", torch.float32).argmax(-1).tolist()]


def colocated_cache(model: LlamaModel, num_slots: int, max_len: int | None = None) -> KVCache:
    """A pool of its own for `model` (every layer, the model's dtype and device)."""
    length = max_len or min(model.config.max_position_embeddings, 4096)
    return KVCache.allocate(model.config.kv_layout(num_slots, length, dtype_name(model.dtype)), model.device)


@torch.inference_mode()
def warm_up(model: LlamaModel) -> float:
    """Run a short prefill and decode steps at batch 1 and 2 on a scratch pool, so that the first
    request does not pay for what the first call of each op costs (oneDNN's kernel generation, the
    native ops' load, first-touch allocations: a cold first request's TTFT was several times the
    next one's; benchmarks/README.md). Returns the seconds it took; a layer-sharded member (part of the
    layers) is not warmed (its steps need the group)."""
    if model.layer_range != range(model.config.num_layers):
        return 0.0
    started = time.perf_counter()
    cache = colocated_cache(model, 2, 64)
    prompt = list(range(3, 3 + 16))
    for slot in (0, 1):
        model.prefill(prompt, cache, slot)
    model.decode_step(cache, [0], [16], [prompt[-1]])
    model.decode_step(cache, [0, 1], [17, 16], [prompt[-1], prompt[-1]])
    return time.perf_counter() - started


@dataclass(frozen=True)
class FirstDraw:
    """How a prefill draws a prompt's first token: `index`, the output index that token has (> 0
    for a resumed request, whose last `index` prompt tokens are its output so far);
    `layers_per_chunk`; `start`, positions already holding the prompt's KV (a cached prefix);
    `stop_ids`, what min_tokens keeps from being drawn; `tokenizer`, what a request's grammar
    is matched against."""

    index: int = 0
    layers_per_chunk: int | None = None
    start: int = 0
    stop_ids: Sequence[int] = ()
    tokenizer: Tokenizer | None = None


@torch.inference_mode()
def prefill_first_token(
    model: LlamaModel,
    cache: KVCache,
    slot: int,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    how: FirstDraw = FirstDraw(),
) -> int:
    """Compute a prompt's KV into `slot` and draw its first token, as a prefill worker does."""
    return prefill_first_draw(model, cache, slot, prompt_ids, params, how).token


@torch.inference_mode()
def prefill_first_draw(
    model: LlamaModel,
    cache: KVCache,
    slot: int,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    how: FirstDraw = FirstDraw(),
) -> Draw:
    """`prefill_first_token`, with the token's logprobs when the request asks for them, and the
    prompt's (`params.prompt_logprobs`; then `start` must be 0: a cached prefix has no states)."""
    draw = (params, prompt_ids, how.index, how.stop_ids, how.tokenizer)
    if params.prompt_logprobs is None:
        return draw_first(model.prefill(prompt_ids, cache, slot, how.layers_per_chunk, start=how.start), *draw)
    if how.start:
        raise ValueError("prompt logprobs need the whole prompt computed (start 0)")
    final: list[torch.Tensor] = []
    logits = model.prefill(prompt_ids, cache, slot, how.layers_per_chunk, outputs=PrefillOutputs(on_final=final.append))
    prompt = prompt_token_logprobs(model.head, final[0], prompt_ids, params.prompt_logprobs)
    return replace(draw_first(logits, *draw), prompt_logprobs=prompt)


@torch.inference_mode()
def prefill_first_tokens(
    model: LlamaModel,
    cache: KVCache,
    slots: Sequence[int],
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    stop_ids: Sequence[Sequence[int]] | None = None,
    tokenizer: Tokenizer | None = None,
) -> list[Draw]:
    """`prefill_first_draw` of several prompts in one forward pass (`LlamaModel.prefill_batch`:
    the prompts packed into one row, every matrix product once over all of them)."""
    stops = stop_ids if stop_ids is not None else [()] * len(prompts)
    if len(prompts) == 1 or any(p.prompt_logprobs is not None for p in params):  # (the states of each alone)
        return [
            prefill_first_draw(model, cache, slot, prompt, p, FirstDraw(stop_ids=stop, tokenizer=tokenizer))
            for slot, prompt, p, stop in zip(slots, prompts, params, stops, strict=True)
        ]
    logits = model.prefill_batch(prompts, cache, slots)
    return [draw_first(logits[row], p, prompts[row], 0, stops[row], tokenizer) for row, p in enumerate(params)]


def packed_batches(lengths: Sequence[int], token_budget: int) -> list[range]:
    """Consecutive runs of prompts whose lengths add up to at most `token_budget` (a run's
    first prompt always goes, however long): the prefill passes `generate` makes."""
    if token_budget < 1:
        raise ValueError(f"prefill_token_budget must be positive, got {token_budget}")
    runs: list[range] = []
    start, tokens = 0, 0
    for i, n in enumerate(lengths):
        if i > start and tokens + n > token_budget:
            runs.append(range(start, i))
            start, tokens = i, 0
        tokens += n
    if start < len(lengths):
        runs.append(range(start, len(lengths)))
    return runs


class _Collected:
    """What `generate` gathers per request from the outputs it sees, until the completions."""

    def __init__(self, count: int) -> None:
        self.ids = [f"req-{slot}" for slot in range(count)]
        self.texts: dict[str, list[str]] = {i: [] for i in self.ids}
        self.tokens: dict[str, list[int]] = {i: [] for i in self.ids}
        self.logprobs: dict[str, list[TokenLogprobs]] = {i: [] for i in self.ids}
        self.prompt_logprobs: dict[str, tuple[TokenLogprobs, ...] | None] = {}
        self.reasons: dict[str, FinishReason] = {}

    def record(self, out: StepOutput) -> None:
        self.texts[out.request_id].append(out.text)
        if out.token_id is not None:
            self.tokens[out.request_id].append(out.token_id)
        if out.logprobs is not None:
            self.logprobs[out.request_id].append(out.logprobs)
        if out.finished:
            self.reasons[out.request_id] = out.finish_reason or FinishReason.STOP

    def completions(self, prompts: Sequence[Sequence[int]]) -> list[Completion]:
        return [
            Completion(
                i,
                list(p),
                self.tokens[i],
                "".join(self.texts[i]),
                self.reasons[i],
                self.logprobs[i],
                self.prompt_logprobs.get(i),
            )
            for i, p in zip(self.ids, prompts, strict=True)
        ]


def generate(
    model: LlamaModel,
    tokenizer: Tokenizer,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    *,
    max_len: int | None = None,
    prefill_token_budget: int = 4096,
    stats: GenerationStats | None = None,
) -> list[Completion]:
    """Run a set of prompts to completion together, one slot each, in one process; results in
    prompt order (the colocated reference of tests, benchmarks and `pdserve generate`).

    Prompts are prefilled together, packed into passes of up to `prefill_token_budget` tokens
    (`packed_batches`); `stats`, if given, receives the prefill and decode figures."""
    plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(plist) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling parameter sets")
    gen = Generator(model, tokenizer, colocated_cache(model, len(prompts), max_len))
    stats = stats if stats is not None else GenerationStats()
    gen.stats = stats
    checked = [gen.check_prompt(p) for p in prompts]
    got = _Collected(len(prompts))
    for run in packed_batches([len(p) for p in checked], prefill_token_budget):
        started = time.perf_counter()
        firsts = prefill_first_tokens(
            model,
            gen.cache,
            list(run),
            [checked[i] for i in run],
            [plist[i] for i in run],
            stop_ids=[tuple(stop_token_ids(plist[i], tokenizer.eos_token_ids)) for i in run],
            tokenizer=tokenizer,
        )
        stats.prefill_seconds += time.perf_counter() - started
        stats.prefill_tokens += sum(len(checked[i]) for i in run)
        for slot, first in zip(run, firsts, strict=True):
            request_id = got.ids[slot]
            got.prompt_logprobs[request_id] = first.prompt_logprobs
            added = gen.add_prefilled(checked[slot], slot, first.token, plist[slot], request_id, 0, first.logprobs)
            got.record(added[1])
    for out in gen.stream():
        got.record(out)
    return got.completions(prompts)


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
