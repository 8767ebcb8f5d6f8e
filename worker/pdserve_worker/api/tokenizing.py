"""Prompt and chat tokenizing of the backends that hold the model's tokenizer (PD and colocated),
and the bounded pool the router tokenizes long prompts in.

One place turns a chat template failure into the router's 400 (`InvalidPrompt`), so both
backends answer the same bad conversation with the same message.

Tokenizing is CPU work of the router's event loop's process: a long prompt must neither stall
the streams that share the loop nor let a flood of long prompts queue without end. So:
- a prompt longer than `max_prompt_chars(...)` is refused before it is tokenized: with no
  token longer than `max_token_chars` characters, it cannot fit the context anyway;
- long prompts are tokenized in a few worker threads (`TokenizerPool`), and past a bound of
  waiting prompts the router answers 429 instead of queueing more.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import jinja2
import llguidance

from pdserve_worker.api import tools
from pdserve_worker.api.backend import Backend, InvalidPrompt, NoCapacity
from pdserve_worker.model.sampling import grammar as grammars
from pdserve_worker.model.tokenizer import Tokenizer, TokenizerError

T = TypeVar("T")

TOKENIZE_THREADS = 2
TOKENIZE_QUEUE = 64  # prompts tokenizing or waiting for a thread; more are answered 429
BUSY_RETRY_S = 1.0


class ModelTokenizing(Backend):
    """A `Backend` whose tokenizing is the model's own `self._tokenizer`: the tokenize methods and
    the optional capabilities a tokenizer gives (detokenize, bad words, grammars, tool format)."""

    _tokenizer: Tokenizer

    def tokenize_prompt(self, prompt: str) -> list[int]:
        return self._tokenizer.encode(prompt)

    def encode_words(self, text: str) -> list[int]:
        """Token ids of `text` without BOS or other added tokens (bad_words: api/bad_words.py)."""
        return self._tokenizer.encode(text, add_special_tokens=False)

    def detokenize(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids)

    @functools.cached_property
    def tool_format(self) -> tools.Format:
        """How the model's template has it call tools (api/tools.py)."""
        return tools.tool_format(self._tokenizer.chat_template)

    @functools.cached_property
    def vocab_size(self) -> int:
        """Token ids are 0..vocab_size-1 (the tokenizer's, added tokens included)."""
        return self._tokenizer.vocab_size

    def tokenize_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        try:
            return self._tokenizer.encode_chat(messages, tools=tools)
        except (jinja2.TemplateError, TokenizerError) as exc:
            raise InvalidPrompt(f"the model's chat template rejected the messages: {exc}", public=True) from None

    def grammar_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary (grammar.grammar_tokenizer: built once): the
        router builds each grammar's matcher with it, as the workers will (api/grammar_compiler.py)."""
        return grammars.grammar_tokenizer(self._tokenizer, self.vocab_size)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most input characters one token can stand for: the longest vocabulary entry.

        A byte-level BPE entry has one character per byte it matches (so at least as many as
        the characters it covers); a SentencePiece entry is its text, a byte-fallback entry
        `<0xNN>` longer than its byte. (A normalizer that merges characters could in theory
        beat this bound; none of the supported tokenizers has one.)"""
        vocab = self._tokenizer.backend.get_vocab(with_added_tokens=True)
        return max((len(token) for token in vocab), default=1)


def max_prompt_chars(max_model_len: int, max_token_chars: int) -> int:
    """Characters past which a prompt cannot fit `max_model_len` tokens."""
    return max_model_len * max(max_token_chars, 1)


class TokenizerPool:
    """Runs tokenizing calls in at most `threads` threads; refuses work beyond `queue` calls
    in progress (running or waiting) with `NoCapacity`, so a flood of long prompts costs the
    flooder 429s rather than everyone unbounded latency and memory."""

    def __init__(self, threads: int = TOKENIZE_THREADS, queue: int = TOKENIZE_QUEUE) -> None:
        if threads < 1 or queue < threads:
            raise ValueError(f"need threads >= 1 and queue >= threads, got threads={threads} queue={queue}")
        self._limiter = anyio.CapacityLimiter(threads)
        self.queue = queue
        self.in_progress = 0

    async def run(self, fn: Callable[[], T]) -> T:
        if self.in_progress >= self.queue:
            raise NoCapacity(BUSY_RETRY_S, f"tokenizer busy: {self.in_progress} prompts in progress")
        self.in_progress += 1
        try:
            # Cancelled while waiting for a thread, a request leaves at once; a call already running
            # is waited for (not abandoned), so no more than `threads` ever run.
            return await anyio.to_thread.run_sync(fn, limiter=self._limiter)
        finally:
            self.in_progress -= 1
