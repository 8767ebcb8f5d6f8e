"""vLLM's `bad_words`: words the answer must not contain, as token sequences the sampler bans.

The rule is vLLM's (vllm/sampling_params.py, `SamplingParams.update_from_tokenizer`): each word
is tokenized without special tokens twice — as written (leading spaces stripped) and with one
leading space, so it is banned at the start of the text and after a space — and the spaced
form is kept only when it is a different word token of the same length. The sampler then
bans a sequence's last token whenever the output so far ends with the rest of it
(model/sampling/processors.py; vllm/v1/sample/ops/bad_words.py). A word that tokenizes to
nothing is refused, as vLLM refuses it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

MAX_BAD_WORD_SEQUENCES = 128  # vLLM's VLLM_MAX_NUM_BAD_WORDS default
MAX_BAD_WORD_TOKENS = 64  # one word's tokens: a ban longer than that is not a word


class BadWordsError(ValueError):
    """A bad word that cannot be enforced; the message names it."""


def bad_word_ids(words: Sequence[str], encode: Callable[[str], list[int]]) -> tuple[tuple[int, ...], ...]:
    """The token sequences to ban for `words` (duplicates dropped, in order)."""
    out: list[tuple[int, ...]] = []
    for word in dict.fromkeys(words):
        plain = tuple(encode(word.lstrip()))
        if not plain:
            raise BadWordsError(f"bad_words entry {word[:40]!r} tokenizes to no token")
        spaced = tuple(encode(" " + word.lstrip()))
        forms = [plain]
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            forms.append(spaced)
        for form in forms:
            if len(form) > MAX_BAD_WORD_TOKENS:
                raise BadWordsError(
                    f"bad_words entry {word[:40]!r} is {len(form)} tokens, at most {MAX_BAD_WORD_TOKENS}"
                )
            if form not in out:  # ("ab" and " ab" are one word; vLLM keeps both copies, to no effect)
                out.append(form)
    if len(out) > MAX_BAD_WORD_SEQUENCES:
        raise BadWordsError(f"bad_words make {len(out)} token sequences, at most {MAX_BAD_WORD_SEQUENCES}")
    return tuple(out)
