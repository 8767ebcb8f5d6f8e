"""The model families the engine serves: one module each, named here once.

| model_type | q/k/v bias            | o bias          | q/k RMSNorm | sliding window                       | GGUF |
|------------|-----------------------|-----------------|-------------|--------------------------------------|------|
| llama      | `attention_bias`      | `attention_bias`| no          | none                                 | llama (Q/K permuted) |
| mistral    | no                    | no              | no          | `sliding_window`, every layer        | as llama |
| qwen2      | always                | no              | no          | `use_sliding_window`, layers from `max_window_layers` | qwen2 |
| qwen3      | `attention_bias`      | `attention_bias`| per head    | as qwen2                             | qwen3 |

Each row is what transformers' own modeling code does (`models/{llama,mistral,qwen2,qwen3}/
modeling_*.py`, transformers 5.x), including the defaults its config classes give to keys a
`config.json` leaves out (tests/unit/test_model_config.py compares them with the installed
transformers, for every family named here).
"""

from __future__ import annotations

from importlib import import_module

from pdserve_worker.model.families.base import Family

# One line per family: the module (in this package) whose FAMILY it is, named by its model_type.
NAMES = ("llama", "mistral", "qwen2", "qwen3")

FAMILIES: dict[str, Family] = {name: import_module(f"{__name__}.{name}").FAMILY for name in NAMES}
GGUF_FAMILIES: dict[str, Family] = {f.gguf_architecture: f for f in FAMILIES.values() if f.gguf_architecture}


def family(model_type: str, source: str = "config.json model_type") -> Family:
    """The family of `model_type`, or a refusal naming where the value came from and what is served."""
    if model_type not in FAMILIES:
        raise ValueError(f"{source} {model_type!r} is not supported; expected one of {NAMES}")
    return FAMILIES[model_type]


for _name, _family in FAMILIES.items():
    if _family.model_type != _name:
        raise RuntimeError(f"model/families/{_name}.py declares model_type {_family.model_type!r}")
