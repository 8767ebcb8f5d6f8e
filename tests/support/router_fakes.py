"""A deterministic in-process backend for the router's tests, and helpers to serve it.

`ScriptedBackend` tokenizes one token per character and answers every request with the same
scripted pieces (one piece per token), so tests know the exact text, the token counts and
where each token boundary falls. It records what it was asked and whether each generator was
closed or cancelled, which is how the tests see that a disconnect reached the backend.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from pdserve_worker.api.backend import Backend, BackendError, InvalidPrompt, RequestInfo, TokenEvent
from pdserve_worker.api.server import build_router_server
from pdserve_worker.model.sampling.params import SamplingParams, TokenLogprobs


@dataclass
class Call:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    cache_scope: str = ""
    tokens_sent: int = 0
    finished: bool = False  # the event with a finish_reason was handed out
    closed: bool = False  # the generator's finally ran (aclose, cancellation or normal end)
    cancelled: bool = False  # closed (GeneratorExit, CancelledError) before its final event
    done: threading.Event = field(default_factory=threading.Event)


def fake_logprobs(params: SamplingParams, i: int) -> TokenLogprobs | None:
    """Token i's logprobs as the scripted backend reports them: the chosen token 1000+i first,
    then 2000+k, each 0.5 lower (None when the request asked for none)."""
    if params.logprobs is None:
        return None
    chosen = -0.1 * (i + 1)
    top = [(1000 + i, chosen)] + [(2000 + k, chosen - 0.5 * k) for k in range(1, params.logprobs)]
    return TokenLogprobs(chosen, tuple(top[: params.logprobs]))


def fake_prompt_logprobs(call: Call) -> tuple[TokenLogprobs, ...] | None:
    """Prompt token j's logprob is -j (j = 1..n-1), rank j + 1, its one alternative 3000+j; None
    unless asked."""
    if call.params.prompt_logprobs is None:
        return None
    top = call.params.prompt_logprobs
    return tuple(TokenLogprobs(-float(j), ((3000 + j, -0.5),)[:top], j + 1) for j in range(1, len(call.prompt_ids)))


class ScriptedBackend(Backend):
    model_name = "fake-model"
    # Capabilities a test may switch on for one backend (the `Backend` base declares them read-only).
    shares_prompt_prefill = False
    vocab_size: int | None = None

    def __init__(
        self,
        pieces: Sequence[str] = ("Hello", ",", " world", "!"),
        *,
        finish: str = "stop",
        delay_s: float = 0.0,
        first_delay_s: float = 0.0,
        max_model_len: int = 64,
        error: BackendError | None = None,
        error_after: int = 0,
        info: RequestInfo | None = None,
        honour_max_tokens: bool = True,
        on_close: Callable[[Call], None] | None = None,
    ) -> None:
        self.pieces = list(pieces)
        self.finish = finish
        self.delay_s = delay_s
        self.first_delay_s = first_delay_s
        self.max_model_len = max_model_len
        self.error = error
        self.error_after = error_after
        self.info = info
        self.honour_max_tokens = honour_max_tokens  # False: overrun max_tokens, as a buggy backend would
        self.on_close = on_close
        self.calls: list[Call] = []
        self.generators: list[AsyncIterator[TokenEvent]] = []
        self.chats: list[list[dict]] = []

    def tokenize_prompt(self, prompt: str) -> list[int]:
        return [ord(c) for c in prompt]

    def detokenize(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def encode_words(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def tokenize_chat(self, messages: list[dict]) -> list[int]:
        self.chats.append(messages)
        if messages[-1]["role"] == "assistant":
            raise InvalidPrompt("the conversation must end with a user message")
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
        return [ord(c) for c in text]

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, *, cache_scope: str
    ) -> AsyncIterator[TokenEvent]:
        call = Call(list(prompt_ids), params, request_id, cache_scope=cache_scope)
        self.calls.append(call)
        generator = self._generate(call)
        # Held for the test's lifetime so garbage collection can never close a generator the
        # router forgot: only an explicit aclose or a cancellation can set `closed`.
        self.generators.append(generator)
        return generator

    async def _generate(self, call: Call) -> AsyncIterator[TokenEvent]:
        params = call.params
        try:
            if self.first_delay_s:
                await asyncio.sleep(self.first_delay_s)
            for i, piece in enumerate(self.pieces):
                if self.error is not None and i == self.error_after:
                    raise self.error
                if i and self.delay_s:
                    await asyncio.sleep(self.delay_s)
                last = i == len(self.pieces) - 1
                at_limit = self.honour_max_tokens and i + 1 >= params.max_tokens
                finish = self.finish if last else ("length" if at_limit else None)
                call.tokens_sent += 1
                call.finished = finish is not None
                prompt_logprobs = fake_prompt_logprobs(call) if i == 0 else None
                yield TokenEvent(
                    1000 + i, piece, finish, self.info if i == 0 else None, fake_logprobs(params, i), prompt_logprobs
                )
                if finish is not None:
                    return
        except (GeneratorExit, asyncio.CancelledError):
            call.cancelled = not call.finished
            raise
        finally:
            call.closed = True
            call.done.set()
            if self.on_close is not None:
                self.on_close(call)

    def wait_closed(self, index: int = -1, timeout: float = 5.0) -> Call:
        deadline = time.monotonic() + timeout
        while not self.calls and time.monotonic() < deadline:
            time.sleep(0.01)
        call = self.calls[index]
        closed = call.done.wait(max(0.0, deadline - time.monotonic()))
        assert closed, f"backend generator of {call.request_id} never closed"
        return call


@contextmanager
def running_router(app, port: int, grace_s: float = 1.0) -> Iterator[str]:
    """Serve `app` with uvicorn on 127.0.0.1:`port` in a thread; yields the base URL."""
    server = build_router_server(app, "127.0.0.1", port, grace_s=grace_s)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "router did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        assert not thread.is_alive(), "router did not stop"
