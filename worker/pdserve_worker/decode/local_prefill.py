"""A decode's own prefill: the prompt's KV computed into the request's blocks on this decode,
a chunk at a time between decode steps (the router's conditional disaggregation).

`LocalPrefill` is the `generation_loop.ChunkedPrefill` of a decode that registers
`local_prefill`: the generation loop gives it at most `prefill_chunk_tokens` prompt positions
per turn while other requests decode, so a local prefill delays each running stream's step by
one chunk at most (vLLM's and SGLang's chunked prefill; the colocated role does the same). It
runs through the `Engine` seam (`engine.prefill` into the decode's pool, over the blocks the
Generate call bound first), and draws the first token as a prefill worker would
(`draw_first`). The router asks for it only for a request that starts from token 0, shares no
blocks with another copy and wants no prompt logprobs (router/disaggregation.py); blocks its
grant took from the decode's prefix cache are not computed again (`begin`).

The chunks' rate goes to the decode's `CostMeter` (serving/costs.py), which its keepalive reports.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from pdserve_worker.decode.generation_loop import GenerationLoop
from pdserve_worker.engines.base import Engine, PrefillPass
from pdserve_worker.model.sampling.params import SamplingParams
from pdserve_worker.model.sampling.sampler import Draw, draw_first, stop_token_ids
from pdserve_worker.serving.costs import CostMeter
from pdserve_worker.serving.settings import WorkerSettings


class LocalPrefill:
    """Computes prompts into their bound blocks, `budget` positions per call (module doc)."""

    def __init__(self, engine: Engine, cache: Any, meter: CostMeter, device: str = "cpu") -> None:
        self.engine, self.cache, self.meter, self.device = engine, cache, meter, device
        self.eos = tuple(engine.tokenizer.eos_token_ids)
        self._done: dict[int, int] = {}  # slot -> positions of its prompt whose KV is in its blocks

    def advance(self, prompt: list[int], slot: int, params: SamplingParams, budget: int) -> tuple[int, Draw | None]:
        if params.prompt_logprobs is not None:
            raise ValueError("a local prefill draws no prompt logprobs (the router sends such a request to a prefill)")
        done = self._done.get(slot, 0)
        stop = min(len(prompt), done + max(budget, 1))
        last = stop == len(prompt)
        started = time.perf_counter()
        logits = self.engine.prefill(self.cache, PrefillPass([prompt[:stop]], [slot], [done], logits=last))
        synchronize(self.device)  # (a GPU's kernels run after the call returns: time them whole)
        self.meter.prefilled(stop - done, time.perf_counter() - started)
        if not last:
            self._done[slot] = stop
            return stop - done, None
        self._done.pop(slot, None)
        stops = tuple(stop_token_ids(params, self.eos))
        return stop - done, draw_first(logits[0], params, prompt, 0, stops, self.engine.tokenizer)

    def begin(self, slot: int, cached: int) -> None:
        """A prompt starts in `slot` with its first `cached` positions' KV there already (blocks
        shared read-only: the prefix cache's, or another copy's)."""
        if cached:
            self._done[slot] = cached
        else:
            self._done.pop(slot, None)

    def abandon(self, slot: int) -> None:
        self._done.pop(slot, None)


def synchronize(device: Any) -> None:
    """Wait for the work queued on `device` (nothing to wait for on the CPU)."""
    kind = torch.device(device).type
    if kind != "cpu" and torch.accelerator.is_available():
        torch.accelerator.synchronize()


def decode_loop(
    generator: Any, settings: WorkerSettings, engine: Engine, cache: Any, meter: CostMeter, plain: bool
) -> tuple[LocalPrefill | None, GenerationLoop]:
    """A decode's generation loop, with its local prefill where it computes prompts when asked
    (`settings.local_prefill`, and a `plain` decode: no layer-sharded or tensor-parallel group)."""
    local = LocalPrefill(engine, cache, meter, settings.device) if settings.local_prefill and plain else None
    loop = GenerationLoop(
        generator, prefill=local, prefill_chunk_tokens=settings.prefill_chunk_tokens, name="decode-loop"
    )
    return local, loop
