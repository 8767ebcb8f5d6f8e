"""The seam between the router's HTTP front and whatever produces tokens.

The router speaks OpenAI HTTP; a `Backend` turns token ids into a stream of `TokenEvent`s.
Two implement it: `router.pd_backend.PDBackend`, the PD orchestration (pick the least loaded decode,
reserve a slot, run prefill, stream decode), and `colocated.ColocatedBackend`, one process
(the baseline); the router's tests use a scripted fake. The HTTP code is the same for all.

Nothing here knows about HTTP: the backend raises domain errors (`NoCapacity`, ...) and the
router alone decides which status code each becomes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve_worker.model.sampling.params import FinishReason, SamplingParams, TokenLogprobs

if TYPE_CHECKING:
    import llguidance

    from pdserve_worker.api.tools import Format

# When a backend cannot say how long its longest token is: longer than any vocabulary seen.
DEFAULT_MAX_TOKEN_CHARS = 256


@dataclass(frozen=True)
class RequestInfo:
    """What the backend learned while serving one request, reported to the router in-band.

    Attached to a `TokenEvent` (usually the first one, once prefill and any KV push are done);
    the router keeps the latest one it saw and uses it for metrics and for the optional
    `pdserve` field of the response. In-band rather than a side channel so that it needs no
    shared state keyed by request id and cannot outlive a cancelled request.
    """

    disaggregated: bool = False
    kv_bytes: int = 0  # KV bytes pushed from prefill into the decode slot
    kv_transfer_s: float | None = None  # wall time of that push, first put to completion
    prefill: str | None = None  # id of the prefill instance that served the prompt
    decode: str | None = None  # id of the decode instance that generated the tokens
    retries: int = 0  # failed workers replaced while serving it (the request resumed elsewhere)
    cached_tokens: int = 0  # prompt tokens whose KV came from a prefix cache (the prefill's or the decode's)
    migrations: int = 0  # times a draining decode handed it over to another decode (its KV moved)

    def as_response_field(self, workers: bool = False) -> dict[str, object]:
        """The `pdserve` extension object of a response: JSON-ready, absent values left out.
        `workers`: name the prefill and decode that served it (internal topology: only for a
        request that asked with the debug header and whose key may, api/intake.py)."""
        field: dict[str, object] = {"disaggregated": self.disaggregated, "kv_bytes": self.kv_bytes}
        if self.kv_transfer_s is not None:
            field["kv_transfer_ms"] = round(self.kv_transfer_s * 1000.0, 3)
        if workers and self.prefill is not None:
            field["prefill"] = self.prefill
        if workers and self.decode is not None:
            field["decode"] = self.decode
        if self.retries:
            field["retries"] = self.retries
        if self.cached_tokens:
            field["cached_tokens"] = self.cached_tokens
        if self.migrations:
            field["migrations"] = self.migrations
        return field


@dataclass(frozen=True)
class TokenEvent:
    """One generated token: its id, the text it adds, and whether generation ends with it.

    `text` is the detokenized delta (possibly empty while a multi-byte character is
    incomplete, or the engine holds back what may begin a stop string). `finish_reason` is set
    on the last event only: STOP when EOS, a stop token id or a stop string ended generation
    (the text never holds the stop string), LENGTH when `max_tokens` or the context was reached.
    """

    token_id: int
    text: str
    finish_reason: FinishReason | None = None
    info: RequestInfo | None = None
    logprobs: TokenLogprobs | None = None  # when the request asked for them
    # On the first event, when the request asked for prompt logprobs: prompt tokens 1..n-1's.
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None


class Backend:
    """What the router needs from a token producer: the base class every backend inherits.

    `generate` is an async generator: the router closes it (`aclose`) or cancels the task
    iterating it when the client goes away or the answer is complete, and the backend must
    release what it holds for the request (a decode slot) in a `finally`.

    The members after the three methods are optional capabilities, declared here with what
    lacking them means; a backend overrides those it has (tokenizing.ModelTokenizing does for
    a backend that holds the model's tokenizer). The router reads them and probes nothing.
    """

    model_name: str
    max_model_len: int

    def tokenize_prompt(self, prompt: str) -> list[int]:
        """Token ids of a raw completion prompt (with BOS if the model wants one)."""
        raise NotImplementedError

    def tokenize_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a conversation after the model's chat template, ready for the reply; the
        request's `tools` go to the template (the router passes them only when there are some)."""
        raise NotImplementedError

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, *, cache_scope: str
    ) -> AsyncIterator[TokenEvent]:
        """Stream the tokens generated after `prompt_ids`; stop strings, stop token ids and EOS are
        the backend's job (its text never holds a stop string, and it ends with "stop").

        `cache_scope` (api/cache_scope.py) bounds which other prompts' cached prefix KV this
        one may reuse: a backend with a prefix cache roots the prompt's block hashes in it."""
        raise NotImplementedError

    revision: str = ""  # the model's revision (the system_fingerprint's)
    # Token ids to text; None: no tokenizer here, so no logprobs, echo of ids or /detokenize.
    detokenize: Callable[[list[int]], str] | None = None
    # Token ids of a text without BOS or other added tokens; None: no bad_words (api/bad_words.py).
    encode_words: Callable[[str], list[int]] | None = None
    # llguidance's view of the vocabulary, built on first call (in a compile thread); None: grammars
    # are checked without a tokenizer (api/grammar_compiler.py).
    grammar_tokenizer: Callable[[], llguidance.LLTokenizer] | None = None
    # What /health reports of the backend (its members); None: nothing beyond "ok".
    health: Callable[[], dict[str, object]] | None = None

    @property
    def shares_prompt_prefill(self) -> bool:
        """Whether n copies of a prompt gain from following the first's prefill (api/prompt_copies.py)."""
        return False

    @property
    def tool_format(self) -> Format:
        """How the model calls tools (api/tools.py): hermes unless the backend knows its template."""
        return "hermes"

    @property
    def vocab_size(self) -> int | None:
        """Token ids are 0..vocab_size-1; None: the backend cannot tell (the workers check)."""
        return None

    @property
    def max_token_chars(self) -> int:
        """The most input characters one token can stand for (bounds a prompt before tokenizing)."""
        return DEFAULT_MAX_TOKEN_CHARS


class BackendError(Exception):
    """Base of the errors a backend may raise for one request; the router maps each to HTTP.

    The message is for the logs: it may name workers, addresses and gRPC details. A client
    reads a generic message for the kind of error (`router.errors.from_backend_error`), unless
    the error is `public` (written about the client's own input, like a chat template's refusal).
    """

    public = False

    def __init__(self, message: str = "", *, public: bool | None = None) -> None:
        super().__init__(message)
        if public is not None:
            self.public = public


class InvalidPrompt(BackendError):
    """The backend cannot accept this input (e.g. the chat template rejects the role order)."""


class NoCapacity(BackendError):
    """Every decode slot is taken: the client should retry after `retry_after_s` seconds."""

    def __init__(self, retry_after_s: float = 1.0, message: str = "no free decode slot") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class BackendUnavailable(BackendError):
    """No prefill or decode instance can serve now (none registered, or all unreachable)."""


class RequestTimeout(BackendError):
    """The request did not complete in time (a KV transfer or a peer did not answer)."""


# The router's admission queue learns that a request holds capacity (its KV reservation) the
# moment the backend has it, long before the first token: `capacity_held()` tells it. A context
# variable rather than a parameter of `generate`, so backends and test fakes that cannot tell
# keep the protocol's signature; for them the first token is taken as the sign.
_capacity_listener: ContextVar[Callable[[], None] | None] = ContextVar("pdserve_capacity_listener", default=None)


def capacity_held() -> None:
    """Called by a backend, inside `generate`, once it holds the capacity the request needs."""
    listener = _capacity_listener.get()
    if listener is not None:
        listener()


@contextmanager
def capacity_listener(listener: Callable[[], None]) -> Iterator[None]:
    """Run `listener` when the backend reports `capacity_held()` within this block (same task)."""
    token = _capacity_listener.set(listener)
    try:
        yield
    finally:
        _capacity_listener.reset(token)
