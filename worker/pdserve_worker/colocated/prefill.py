"""The colocated process's prompts, computed into their slots a chunk at a time.

`GenerationLoop` (decode/generation_loop.py) gives each turn a budget of prompt positions
(`prefill_chunk_tokens`) before its decode step, and asks `ColocatedPrefill.advance` for them,
oldest waiting prompt first. A prompt's first call takes its cached prefix from the prefix
store (kv/prefix_store.py), which stays pinned until the prompt is whole and published; its
last call draws the first token. So a long prompt arriving among running requests delays each
of their steps by one chunk instead of by the whole prompt (vLLM's and SGLang's chunked
prefill); a prompt that asks for its prompt logprobs is computed in one piece (its positions'
final states are needed together).

Per slot, until the request's first event has read them: the prompt tokens taken from the
cache (`cached`) and the prompt logprobs (`prompt_logprobs`); and the cache scope of the
request (`scope`), which the backend sets before it submits the request.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve_worker.kv.cache import KVCache
from pdserve_worker.kv.prefix_store import PrefixStore, PrefixUse
from pdserve_worker.model.engine import FirstDraw, prefill_first_draw
from pdserve_worker.model.layers.llama import LlamaModel, PrefillOutputs
from pdserve_worker.model.sampling.params import SamplingParams, TokenLogprobs
from pdserve_worker.model.sampling.sampler import Draw, stop_token_ids
from pdserve_worker.model.tokenizer import Tokenizer


@dataclass
class _Progress:
    done: int  # positions of the prompt whose KV is in the slot
    use: PrefixUse | None  # the prefix store's hold on the prompt's blocks, until it is whole


class ColocatedPrefill:
    """`generation_loop.ChunkedPrefill` over one model, its pool and (optionally) a prefix store."""

    def __init__(self, model: LlamaModel, cache: KVCache, store: PrefixStore | None, tokenizer: Tokenizer) -> None:
        self.model, self.cache, self.store, self.tokenizer = model, cache, store, tokenizer
        self.eos = tuple(tokenizer.eos_token_ids)
        self.scope: dict[int, str] = {}  # slot -> the cache scope of the request it holds
        self.cached: dict[int, int] = {}  # slot -> prompt tokens its prefill took from the prefix cache
        self.prompt_logprobs: dict[int, tuple[TokenLogprobs, ...] | None] = {}
        self._progress: dict[int, _Progress] = {}

    def advance(self, prompt: list[int], slot: int, params: SamplingParams, budget: int) -> tuple[int, Draw | None]:
        progress = self._progress.get(slot)
        if progress is None:  # a new prompt in the slot: forget what an earlier request left
            self.prompt_logprobs.pop(slot, None)
            self.cached.pop(slot, None)
            if params.prompt_logprobs is not None:  # every position computed, in one piece
                return len(prompt), self._whole(prompt, slot, params)
            progress = self._progress[slot] = self._begin(prompt, slot)
        stop = min(len(prompt), progress.done + budget)
        if stop < len(prompt):
            self.model.prefill(
                prompt[:stop], self.cache, slot, start=progress.done, outputs=PrefillOutputs(logits=False)
            )
            used, progress.done = stop - progress.done, stop
            return used, None
        try:
            stops = tuple(stop_token_ids(params, self.eos))
            how = FirstDraw(start=progress.done, stop_ids=stops, tokenizer=self.tokenizer)
            drawn = prefill_first_draw(self.model, self.cache, slot, prompt, params, how)
            if progress.use is not None:
                assert self.store is not None
                self.store.finish(progress.use, self.cache, slot)
                self.cached[slot] = progress.use.cached_tokens
        finally:
            self.abandon(slot)
        return len(prompt) - progress.done, drawn

    def abandon(self, slot: int) -> None:
        progress = self._progress.pop(slot, None)
        if progress is not None and progress.use is not None:
            assert self.store is not None
            self.store.end(progress.use)

    def _begin(self, prompt: list[int], slot: int) -> _Progress:
        if self.store is None:
            return _Progress(0, None)
        use = self.store.begin(prompt, self.cache, slot, self.scope[slot])
        return _Progress(use.cached_tokens, use)

    def _whole(self, prompt: list[int], slot: int, params: SamplingParams) -> Draw:
        stops = tuple(stop_token_ids(params, self.eos))
        how = FirstDraw(stop_ids=stops, tokenizer=self.tokenizer)
        drawn = prefill_first_draw(self.model, self.cache, slot, prompt, params, how)
        self.prompt_logprobs[slot] = drawn.prompt_logprobs
        return drawn
