"""A colocated backend: prefill and decode in one process, one continuous batch (the baseline).

The engine's `Generator` admits a waiting prompt between decode steps and prefills it in the
same thread, so while a long prompt is prefilled every running request waits: this is the
interference that PD disaggregation removes, and what `benchmarks/serve.py` measures it
against. Requests beyond the free slots wait in the Generator's queue (no 429).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from pdserve_worker.model.generate import Generator
from pdserve_worker.model.loader import LoadedModel
from pdserve_worker.model.sampling import FINISH_LENGTH, FINISH_STOP
from pdserve_worker.model.sampling_params import SamplingParams
from pdserve_worker.roles.backend import BackendError, RequestInfo, TokenEvent
from pdserve_worker.roles.generation_loop import GenerationLoop, RequestFailed
from pdserve_worker.roles.tokenizing import ModelTokenizing

_REASONS = {FINISH_STOP: "stop", FINISH_LENGTH: "length"}
_COLOCATED = RequestInfo(disaggregated=False, kv_bytes=0)


class ColocatedBackend(ModelTokenizing):
    """`roles.backend.Backend` over a Generator on its own scheduler thread."""

    def __init__(self, loaded: LoadedModel, *, slots: int, max_len: int, model_name: str | None = None) -> None:
        self.model_name = model_name or loaded.name
        self.max_model_len = max_len
        self._tokenizer = loaded.tokenizer
        generator = Generator(loaded.model, loaded.tokenizer, num_slots=slots, max_len=max_len)
        self.loop = GenerationLoop(generator, external_slots=False, name="colocated-loop")

    def start(self) -> None:
        self.loop.start()

    def close(self) -> None:
        self.loop.stop()

    def health(self) -> dict[str, object]:
        return {"ready": True, "members": {"colocated": 1}}

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> AsyncIterator[TokenEvent]:
        stream = self.loop.submit(request_id, prompt_ids, params)
        finished = False
        first = True
        try:
            async for out in stream:
                if out.token_id is None:  # aborted inside the loop
                    raise BackendError(f"request {request_id} was aborted: {out.finish_reason}")
                reason = _REASONS.get(out.finish_reason or "") if out.finished else None
                if out.finished and reason is None:
                    raise BackendError(f"request {request_id} ended with {out.finish_reason!r}")
                finished = out.finished  # before the yield: the router closes us once it has the last event
                yield TokenEvent(out.token_id, out.text, reason, _COLOCATED if first else None)  # type: ignore[arg-type]
                first = False
                if finished:
                    return
        except RequestFailed as exc:
            raise BackendError(str(exc)) from None
        finally:
            if not finished:
                self.loop.cancel(stream)
