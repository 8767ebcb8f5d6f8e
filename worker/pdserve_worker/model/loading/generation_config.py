"""An HF folder's `generation_config.json`: the end-of-sequence ids and the sampling its authors recommend.

Qwen2.5-Instruct ends a turn with `<|im_end|>` but its base vocabulary's EOS is
`<|endoftext|>`; the file lists both (`"eos_token_id": [151645, 151643]`), and a server that
stops at only one of them runs past the answer. Its sampling values (temperature 0.7, top_p
0.8, top_k 20, ...) are what transformers' `generate` and vLLM use when a request leaves them
unset; `sampling_defaults` gives those this engine implements.

Torch-free (`pdserve info` reads it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FILE = "generation_config.json"


@dataclass(frozen=True)
class GenerationDefaults:
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None  # a request's default (model/sampling/processors.py)
    max_new_tokens: int | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerationDefaults:
        """From the file's object; a value of the wrong type or out of range is an error naming the key."""
        eos = data.get("eos_token_id")
        eos_list = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in eos_list):
            raise ValueError(f"{FILE} eos_token_id must be a token id or a list of them, got {eos!r}")
        return cls(
            eos_token_ids=tuple(dict.fromkeys(eos_list)),
            bos_token_id=_number(data, "bos_token_id", int, 0, None),
            do_sample=_bool(data, "do_sample"),
            temperature=_number(data, "temperature", float, 0.0, 100.0),
            top_p=_number(data, "top_p", float, 0.0, 1.0, open_low=True),
            top_k=_number(data, "top_k", int, 0, None),
            repetition_penalty=_number(data, "repetition_penalty", float, 0.0, None, open_low=True),
            max_new_tokens=_number(data, "max_new_tokens", int, 1, None),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> GenerationDefaults:
        """The folder's generation_config.json, or no defaults when it has none."""
        path = Path(folder) / FILE
        if not path.is_file():
            return cls()
        try:
            data = json.loads(path.read_text())
        except ValueError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected an object, got {type(data).__name__}")
        return cls.from_dict(data)

    def sampling_defaults(self) -> dict[str, float | int]:
        """SamplingParams fields for a request that sets none of them: the file's temperature,
        top_p and top_k, and greedy when it says `do_sample: false` (transformers' meaning);
        its repetition_penalty either way (transformers applies it to greedy search too)."""
        values: dict[str, float | int] = {}
        keys = ("temperature", "top_p", "top_k") if self.do_sample is not False else ()
        for key in (*keys, "repetition_penalty"):
            if (value := getattr(self, key)) is not None:
                values[key] = value
        if self.do_sample is False:
            values["temperature"] = 0.0
        return values

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v not in (None, ())}


def _bool(data: dict[str, Any], key: str) -> bool | None:
    value = data.get(key)
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{FILE} {key} must be true or false, got {value!r}")
    return value


def _number(data: dict[str, Any], key: str, kind: type, low: float, high: float | None, open_low: bool = False) -> Any:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ValueError(f"{FILE} {key} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    if value < low or (open_low and value == low) or (high is not None and value > high):
        bound = f"{'(' if open_low else '['}{low}, {high if high is not None else 'inf'}]"
        raise ValueError(f"{FILE} {key} {value!r} outside {bound}")
    return kind(value)
