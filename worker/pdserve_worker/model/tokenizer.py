"""Text ↔ token ids, the model's chat template, and streaming detokenization.

Built on the `tokenizers` library (the same Rust tokenizer HF uses), from either an HF
`tokenizer.json` (+ `tokenizer_config.json` for the chat template and special tokens) or a
GGUF file's tokenizer metadata. The chat template is rendered with jinja2 in a sandbox with
the options HF uses (trim_blocks, lstrip_blocks, loopcontrols), so templates written for HF
render identically.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.decoders import DecodeStream

# GGUF token types (llama.cpp's llama_token_type).
GGUF_CONTROL, GGUF_USER_DEFINED = 3, 4
# Tokens llama.cpp treats as end of generation by their text, whatever the metadata's eos id says
# (llama_vocab::impl::load's EOG detection): a Qwen GGUF stops on <|endoftext|> as on <|im_end|>.
GGUF_EOG_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<｜end▁of▁sentence｜>",
)

# Pre-tokenizer splits by GGUF `tokenizer.ggml.pre`: the regex llama.cpp applies before BPE.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2 (llama-vocab.cpp): Qwen2's tokenizer.json regex, which splits
# every digit on its own (`\p{N}`, where llama3 takes up to three).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_PRES = {None, "default", "gpt2", "gpt-2"}
# These split every digit off before the GPT-2 regex (llama.cpp: "\p{N}" then the GPT-2 split).
_DIGIT_PRES = {"smollm", "starcoder", "refact", "codeshell", "exaone", "minerva"}
_LLAMA3_PRES = {"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx"}
# llama.cpp maps these names to LLAMA_VOCAB_PRE_TYPE_QWEN2 (DeepSeek-R1-Distill-Qwen keeps Qwen's tokenizer).
_QWEN2_PRES = {"qwen2", "deepseek-r1-qwen"}


class TokenizerError(ValueError):
    pass


def _token_content(value: Any) -> str | None:
    """A special token in tokenizer_config.json is a string or {"content": ...}."""
    if isinstance(value, dict):
        content = value.get("content")
        return None if content is None else str(content)
    return None if value is None else str(value)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class IncrementalDetokenizer:
    """Text deltas for a stream of token ids, never splitting a UTF-8 character.

    `tokenizers.decoders.DecodeStream` holds back tokens while they end in an incomplete
    character; `flush` returns whatever the full decode has beyond what was emitted (a stream
    that really ends mid-character yields its replacement character there, once). The deltas
    concatenated equal `Tokenizer.decode` of all ids.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._emitted: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._emitted)

    def push(self, token_id: int) -> str:
        """Add one token; returns the newly complete text (possibly empty)."""
        self._ids.append(token_id)
        delta = self._stream.step(self._tokenizer.backend, token_id) or ""
        if delta:
            self._emitted.append(delta)
        return delta

    def flush(self) -> str:
        """The text still held back at the end of the stream."""
        full = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip)
        done = self.text
        rest = full[len(done) :] if full.startswith(done) else ""
        if rest:
            self._emitted.append(rest)
        return rest


class Tokenizer:
    def __init__(
        self,
        backend: BackendTokenizer,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        ids = list(eos_token_ids)
        if eos_token is not None and (eid := backend.token_to_id(eos_token)) is not None and eid not in ids:
            ids.insert(0, eid)
        self.eos_token_ids: tuple[int, ...] = tuple(ids)
        self._template = _compile_template(chat_template) if chat_template else None
        self._specials: tuple[str, ...] | None = None  # special tokens' text (encode_chat)
        self._pieces: dict[tuple[bool, bool], BackendTokenizer] = {}  # (escape, first) -> backend

    # ---- construction --------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path, extra_eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """From an HF folder: tokenizer.json, tokenizer_config.json, chat_template.jinja if present."""
        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(f"no tokenizer.json in {folder}")
        backend = BackendTokenizer.from_file(str(tok_file))
        cfg: dict[str, Any] = {}
        if (folder / "tokenizer_config.json").is_file():
            cfg = json.loads((folder / "tokenizer_config.json").read_text())
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        return cls(
            backend,
            chat_template=template,
            bos_token=_token_content(cfg.get("bos_token")),
            eos_token=_token_content(cfg.get("eos_token")),
            eos_token_ids=extra_eos_token_ids,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Rebuild the tokenizer a GGUF file describes (byte-level BPE, `tokenizer.ggml.model` gpt2)."""
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerError(
                f"GGUF tokenizer.ggml.model {kind!r} is not supported (only byte-level BPE 'gpt2'); "
                "pass an HF folder with tokenizer.json instead"
            )
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        backend.pre_tokenizer = _gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == GGUF_CONTROL]
        )
        backend.add_tokens(
            [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == GGUF_USER_DEFINED]
        )

        def token(key: str) -> str | None:
            index = meta.get(f"tokenizer.ggml.{key}")
            return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

        bos = token("bos_token_id")
        if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
            )
        eog = [
            int(meta[f"tokenizer.ggml.{key}"])
            for key in ("eos_token_id", "eot_token_id", "eom_token_id")
            if meta.get(f"tokenizer.ggml.{key}") is not None
        ]
        eog += [vocab[text] for text in GGUF_EOG_TEXTS if text in vocab]
        return cls(
            backend,
            chat_template=meta.get("tokenizer.chat_template"),
            bos_token=bos,
            eos_token=token("eos_token_id"),
            eos_token_ids=list(dict.fromkeys(eog)),
        )

    def save(self, folder: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (loadable here and by HF AutoTokenizer)."""
        folder = Path(folder)
        self.backend.save(str(folder / "tokenizer.json"))
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "chat_template": self.chat_template,
            "clean_up_tokenization_spaces": False,
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))

    # ---- use -------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens spelled in it (e.g. `<|im_start|>`) map to their ids."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The prompt text of a conversation in the model's own format."""
        if self._template is None:
            raise TokenizerError("this model has no chat template; send a plain prompt instead")
        for i, message in enumerate(messages):
            if "role" not in message or "content" not in message:
                raise TokenizerError(f"message {i} needs 'role' and 'content', got keys {sorted(message)}")
        return self._template.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **extra,
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of a conversation: the template writes any BOS itself, so none is added.

        A message's content is text, never markup: a special token spelled in it
        (`<|im_end|>`, `<|im_start|>system`, `<|eot_id|>`) is encoded as the characters it is
        made of, so content cannot close its turn or open another. That is the `tokenizers`
        library's own switch (`encode_special_tokens`, what transformers' `split_special_tokens`
        sets), applied to the content only: the template's markup keeps its control tokens."""
        extra = {"tools": list(tools)} if tools else {}  # (HF templates take them as `tools`)
        specials = self._special_strings()
        self._refuse_markup_outside_content(messages, tools, specials)
        text = self.apply_chat_template(messages, add_generation_prompt, **extra)
        if not any(isinstance(m.get("content"), str) and any(t in m["content"] for t in specials) for m in messages):
            return self.encode(text, add_special_tokens=False)
        ids: list[int] = []
        for i, (piece, is_content) in enumerate(self._content_pieces(messages, add_generation_prompt, text, extra)):
            ids += self._piece_backend(is_content, i == 0).encode(piece, add_special_tokens=False).ids
        return ids

    @staticmethod
    def _refuse_markup_outside_content(
        messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None, specials: tuple[str, ...]
    ) -> None:
        """The client's text the template writes outside a message's content (the tools' schemas
        and descriptions, earlier turns' tool calls) is not cut out as content is, so a special
        token spelled there would be markup: refused, naming it."""
        outside: dict[str, Any] = {"tools": tools or []}
        outside.update(
            {f"messages[{i}]": {k: v for k, v in m.items() if k != "content"} for i, m in enumerate(messages)}
        )
        for where, value in outside.items():
            text = json.dumps(value, ensure_ascii=False, default=str)
            found = next((t for t in specials if t in text), None)
            if found is not None:
                raise TokenizerError(f"{where} spells the model's control token {found!r} outside a message's content")

    def _special_strings(self) -> tuple[str, ...]:
        if self._specials is None:
            decoder = self.backend.get_added_tokens_decoder()
            self._specials = tuple(t.content for t in decoder.values() if t.special and t.content)
        return self._specials

    def _piece_backend(self, escape: bool, first: bool) -> BackendTokenizer:
        """The backend for one piece of a conversation cut at its contents: a copy that encodes
        special tokens as plain text for content (its own object: the switch is tokenizer
        state, and the shared tokenizer is used from several threads), and, for a piece that
        does not start the text, one whose Metaspace pre-tokenizer prepends no "▁" (a
        SentencePiece tokenizer marks only the start of the whole text)."""
        key = (escape, first)
        if key == (False, True):
            return self.backend
        if key not in self._pieces:
            backend = BackendTokenizer.from_str(self.backend.to_str())
            backend.encode_special_tokens = escape
            pre = backend.pre_tokenizer
            if not first and isinstance(pre, pre_tokenizers.Metaspace) and pre.prepend_scheme != "never":
                pre.prepend_scheme = "never"
                backend.pre_tokenizer = pre
            self._pieces[key] = backend
        return self._pieces[key]

    def _content_pieces(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, text: str, extra: Mapping[str, Any]
    ) -> list[tuple[str, bool]]:
        """`text` (the rendered conversation) cut into (piece, is message content), found by
        rendering once more with each content between two private-use marks. A template that
        trims content (llama 3's `| trim`) is followed; one that changes it otherwise is refused
        rather than guessed at."""
        mark_open, mark_close = "\ue000", "\ue001"
        if any(mark_open in str(m.get("content")) or mark_close in str(m.get("content")) for m in messages):
            raise TokenizerError("message content holds U+E000/U+E001, which this server reserves")
        marked = [
            {**m, "content": f"{mark_open}{m['content']}{mark_close}"} if isinstance(m.get("content"), str) else dict(m)
            for m in messages
        ]
        rendered = self.apply_chat_template(marked, add_generation_prompt, **extra)
        pieces: list[tuple[str, bool]] = []
        for i, chunk in enumerate(rendered.split(mark_open)):
            content, sep, rest = chunk.partition(mark_close) if i else ("", "", chunk)
            if sep:
                pieces.append((content, True))
            pieces.append((rest, False))
        for trim in (False, True):
            candidate = [(p.strip() if trim and inside else p, inside) for p, inside in pieces]
            if "".join(p for p, _ in candidate) == text:
                return [(p, inside) for p, inside in candidate if p]
        raise TokenizerError("the chat template rewrites message content; cannot keep its special tokens as text")

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)


def _gguf_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2_PRES:
        return byte_level
    if pre in _DIGIT_PRES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    for names, split in ((_LLAMA3_PRES, _LLAMA3_SPLIT), (_QWEN2_PRES, _QWEN2_SPLIT)):
        if pre in names:
            return pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
    raise TokenizerError(f"GGUF tokenizer.ggml.pre {pre!r} is not supported")
