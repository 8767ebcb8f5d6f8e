"""Tool calls: OpenAI's `tools` and `tool_choice` on /v1/chat/completions.

The model's own chat template gets the tools, and the model answers in its own format, which
the router turns back into OpenAI's `tool_calls`; the format is read off the template's source
(`tool_format`):
- `hermes` (Qwen2.5, Hermes, and the default): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
- `llama3_json` (Llama 3.1): the whole answer is `{"name": ..., "parameters": {...}}`,
  possibly after `<|python_tag|>`.
`tool_choice`: `none` parses nothing; `auto` lets the model choose; `required` and a named
function are enforced with a grammar (model/sampling/grammar.py) over the allowed tools'
`parameters` schemas. Streaming: text is streamed until the format's opening shows (held back
while it could still be one), then the calls are sent as `tool_calls` deltas once the answer is
whole, one delta per call with its name and all its arguments.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

from pdserve_worker.model.sampling import grammar as grammars

Format = Literal["hermes", "llama3_json"]
MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any] | None  # (None: any object)

    def template(self) -> dict[str, Any]:
        """The tool as HF chat templates take it: OpenAI's shape, with what the client gave."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools and what it asks of them."""

    tools: tuple[Tool, ...]
    choice: Literal["none", "auto", "required", "named"]
    named: str | None = None
    parallel: bool = True
    schemas: tuple[grammars.Ask, ...] = ()  # each tool's `parameters`, as `parse` checked them

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools for the template: with `none` too (the model knows them but the answer is
        not parsed), as OpenAI and vLLM's default (`--exclude-tools-when-tool-choice-none` off)."""
        return [t.template() for t in self.tools] or None

    def asks(self) -> list[grammars.Ask]:
        """Each tool's `parameters` schema as a grammar to compile (checked in shape and size
        by `parse`): one that cannot be served is refused (a 400 naming the tool), whatever the choice."""
        return list(self.schemas)

    def grammar(self, fmt: Format) -> grammars.Ask | None:
        """The grammar `required` and a named choice are enforced with (None otherwise)."""
        if self.choice not in ("required", "named"):
            return None
        allowed = [t for t in self.tools if self.choice == "required" or t.name == self.named]
        key = "parameters" if fmt == "llama3_json" else "arguments"
        schemas = [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, key: t.parameters or {"type": "object"}},
                "required": ["name", key],
                "additionalProperties": False,
            }
            for t in allowed
        ]
        # compact JSON, as for response_format (grammar.py): the options go on the top-level schema
        call = json.dumps(
            {**(schemas[0] if len(schemas) == 1 else {"anyOf": schemas}), "x-guidance": {"whitespace_flexible": False}}
        )
        if fmt == "llama3_json":
            return grammars.ask("grammar", f"start: %json {call}", "tool_choice")
        repeat = ' ("\\n" call)*' if self.parallel else ""
        lark = f'start: call{repeat}\ncall: "{HERMES_OPEN}\\n" %json {call} "\\n{HERMES_CLOSE}"'
        return grammars.ask("grammar", lark, "tool_choice")


def _tool(raw: Any, index: int) -> Tool:
    if not isinstance(raw, dict) or raw.get("type") != "function" or not isinstance(raw.get("function"), dict):
        raise ValueError(f"tools[{index}] must be {{type: function, function: {{name, ...}}}}")
    fn = raw["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"tools[{index}].function.name must be 1-64 of a-z, A-Z, 0-9, _ and -, got {name!r}")
    parameters = fn.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise ValueError(f"tools[{index}].function.parameters must be a JSON schema object")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise ValueError(f"tools[{index}].function.description must be a string")
    return Tool(name, description, parameters)


def parse(tools: Any, choice: Any, parallel: Any) -> ToolSpec | None:
    """A request's tool fields as a ToolSpec (None without tools); ValueError naming what is wrong."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ValueError(f"tool_choice {choice!r} needs tools")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ValueError(f"tools is a list of at most {MAX_TOOLS} functions")
    parsed = tuple(_tool(raw, i) for i, raw in enumerate(tools))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise ValueError(f"tool names must be distinct, got {names}")
    # Shape and size here; compiled by the router (ToolSpec.asks).
    schemas = tuple(
        grammars.ask("json_schema", t.parameters, f"tools[{i}].function.parameters")
        for i, t in enumerate(parsed)
        if t.parameters is not None
    )
    spec = ToolSpec(parsed, "auto", None, parallel is not False, schemas)
    if choice in (None, "auto", "none", "required"):
        return ToolSpec(parsed, choice or "auto", None, spec.parallel, schemas)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools {names}")
        return ToolSpec(parsed, "named", name, False, schemas)
    raise ValueError(f"tool_choice is none, auto, required or {{type: function, function: {{name}}}}, got {choice!r}")


def tool_format(template_source: str | None) -> Format:
    """Which format the model's template trains it to call tools in."""
    source = template_source or ""
    if HERMES_OPEN in source:
        return "hermes"
    if PYTHON_TAG in source or "ipython" in source:
        return "llama3_json"
    return "hermes"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call(obj: Any, names: set[str], key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments = obj.get(key, obj.get("arguments" if key == "parameters" else "parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def parse_calls(text: str, fmt: Format, spec: ToolSpec) -> tuple[str | None, list[ToolCall]]:
    """The answer as (content, tool calls): calls the format's parser finds for the request's
    tools, and the text before them; an answer that is not a well-formed call is all content."""
    names = {t.name for t in spec.tools}
    if fmt == "llama3_json":
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        try:
            found = [_call(json.loads(part), names, "parameters") for part in body.split(";") if part.strip()]
        except json.JSONDecodeError:
            return text, []
        calls = [c for c in found if c is not None]
        return (text, []) if not calls or len(calls) != len(found) else (None, calls)
    blocks = list(re.finditer(re.escape(HERMES_OPEN) + r"\s*(.*?)\s*" + re.escape(HERMES_CLOSE), text, re.DOTALL))
    calls = []
    for block in blocks:
        try:
            call = _call(json.loads(block.group(1)), names, "arguments")
        except json.JSONDecodeError:
            call = None
        if call is None:
            return text, []
        calls.append(call)
    if not calls:
        return text, []
    content = text[: blocks[0].start()].strip()
    return content or None, calls


class ToolStream:
    """Splits a streamed answer into text to send now and the calls held back for the end."""

    def __init__(self, fmt: Format, spec: ToolSpec) -> None:
        self.fmt, self.spec = fmt, spec
        self._held = ""  # text that is (or may become) a call
        self._calling = False
        self._content = False  # (llama3_json) decided: the answer is text

    def feed(self, text: str) -> str:
        """The part of `text` that may be streamed as content now."""
        if self._calling:
            self._held += text
            return ""
        pending = self._held + text
        if self.fmt == "llama3_json":
            return self._feed_json(pending)
        at = pending.find(HERMES_OPEN)
        if at >= 0:
            self._calling, self._held = True, pending[at:]
            return pending[:at]
        # hold back a tail that may be the start of the opening tag
        keep = next(
            (n for n in range(min(len(pending), len(HERMES_OPEN) - 1), 0, -1) if HERMES_OPEN.startswith(pending[-n:])),
            0,
        )
        self._held = pending[len(pending) - keep :]
        return pending[: len(pending) - keep]

    def _feed_json(self, pending: str) -> str:
        """Llama 3's calls are the whole answer: decided by its first characters."""
        if self._content:
            self._held = ""
            return pending
        start = pending.lstrip()
        if start.startswith("{") or start.startswith(PYTHON_TAG):
            self._calling, self._held = True, pending
            return ""
        if not start or PYTHON_TAG.startswith(start):  # not decided yet
            self._held = pending
            return ""
        self._content, self._held = True, ""
        return pending

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What was held back: (text to stream still, the calls)."""
        if not self._calling:
            return self._held, []
        content, calls = parse_calls(self._held, self.fmt, self.spec)
        if not calls:
            return self._held, []
        return content or "", calls
