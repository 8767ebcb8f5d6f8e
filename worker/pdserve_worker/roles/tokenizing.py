"""Prompt and chat tokenizing of the backends that hold the model's tokenizer (PD and colocated).

One place turns a chat template failure into the router's 400 (`InvalidPrompt`), so both
backends answer the same bad conversation with the same message.
"""

from __future__ import annotations

import jinja2

from pdserve_worker.model.tokenizer import Tokenizer, TokenizerError
from pdserve_worker.roles.backend import InvalidPrompt


class ModelTokenizing:
    """Mixin: the `Backend` protocol's tokenize methods over `self._tokenizer`."""

    _tokenizer: Tokenizer

    def tokenize_prompt(self, prompt: str) -> list[int]:
        return self._tokenizer.encode(prompt)

    def tokenize_chat(self, messages: list[dict]) -> list[int]:
        try:
            return self._tokenizer.encode_chat(messages)
        except (jinja2.TemplateError, TokenizerError) as exc:
            raise InvalidPrompt(f"the model's chat template rejected the messages: {exc}") from None
