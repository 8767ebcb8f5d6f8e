"""Which grammar engine structured outputs use: mask cost per decode step at batch 16 (issue #31).

Run:    .venv/bin/python benchmarks/grammar_cost.py [--batch 16] [--engines pdserve,llguidance,xgrammar,outlines]
        (llguidance is a dependency; the two peers are optional:
        `pip install --no-deps --target /tmp/gextra xgrammar outlines-core apache-tvm-ffi`, then
        PYTHONPATH=/tmp/gextra: xgrammar's declared dependencies would pull triton)
`pdserve` is the production path (model/sampling/grammar_mask.py's `mask_rows`); the other three
are each engine's own fill-and-apply.

Each engine gets the bundled model's tokenizer (49,152 tokens) and one nested JSON schema (an
order: a customer object, an array of line objects with enums and a pattern, a nested address).
`--batch` matchers walk the token ids of one instance of the schema, each from a different
offset into it, as a decode batch does; one step is what the decode step would add: fill the
`[batch, vocab/32]` bitmask for every row, apply it to `[batch, vocab]` fp32 logits, and
advance every matcher by its token. Printed: compile time (first request of a schema), the
median step, and its ratio to the bundled model's own decode step at the same batch measured
in the same run (benchmarks/processors.py's way). The target is <= 0.10 of the step.
xgrammar pulls in transformers and triton (about 1 GB); llguidance and outlines-core nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve  # noqa: E402,F401  (puts worker/ and the rest on sys.path)
from processors import step_times  # noqa: E402
from seed_transfer import machine  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "email": {"type": "string"},
                "address": {
                    "type": "object",
                    "properties": {
                        "street": {"type": "string"},
                        "city": {"type": "string"},
                        "country": {"enum": ["FR", "DE", "CN", "US"]},
                    },
                    "required": ["street", "city", "country"],
                },
            },
            "required": ["name", "address"],
        },
        "lines": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "unit_price": {"type": "number"},
                    "kind": {"enum": ["item", "service", "fee"]},
                },
                "required": ["sku", "quantity", "kind"],
            },
            "minItems": 1,
        },
        "paid": {"type": "boolean"},
    },
    "required": ["order_id", "customer", "lines", "paid"],
}
LINE = {"sku": "A-1", "quantity": 2, "unit_price": 3.5, "kind": "item"}
INSTANCE = {
    "order_id": "ABC-1234",
    "customer": {
        "name": "Ada Lovelace",
        "email": "ada@example.org",
        "address": {"street": "12 Rue de la Paix", "city": "Paris", "country": "FR"},
    },
    "lines": [LINE, {**LINE, "sku": "B-22", "kind": "service"}, {**LINE, "sku": "C-3", "kind": "fee"}] * 3,
    "paid": True,
}


def byte_vocab(backend) -> list[bytes]:
    """Each token's bytes (GPT-2 byte-level BPE: every char of a token stands for one byte)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    char_to_byte = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(extra)}
    vocab = backend.get_vocab(with_added_tokens=True)
    out = [b""] * (max(vocab.values()) + 1)
    specials = {t.content for t in backend.get_added_tokens_decoder().values()}
    for token, index in vocab.items():
        out[index] = token.encode() if token in specials else bytes(char_to_byte[c] for c in token)
    return out


class Engine:
    """One engine's matchers over a batch: fill a bitmask, apply it, advance by tokens."""

    name = ""
    fill: Callable[[], None]
    advance: Callable[[list[int | None]], None]
    bitmask = None

    def apply(self, logits) -> None:
        raise NotImplementedError


_LLTOKENIZERS: dict[object, object] = {}  # per engine: what a worker builds once


def llguidance_engine(tok, schema: str, batch: int, vocab: int) -> Engine:
    import llguidance
    import llguidance.torch as lt

    if vocab not in _LLTOKENIZERS:  # once per worker: ~0.3 s
        _LLTOKENIZERS[vocab] = llguidance.LLTokenizer(
            tok.backend.to_str(), n_vocab=vocab, eos_token=list(tok.eos_token_ids)
        )
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    matchers = [llguidance.LLMatcher(_LLTOKENIZERS[vocab], grammar) for _ in range(batch)]
    engine = Engine()
    engine.name = "llguidance"
    engine.bitmask = lt.allocate_token_bitmask(batch, vocab)

    def fill() -> None:  # one row after another: a thread pool would fight torch's for 2 cores
        for row, m in enumerate(matchers):
            lt.fill_next_token_bitmask(m, engine.bitmask, row)

    engine.fill = fill
    engine.advance = lambda tokens: [m.consume_token(t) for m, t in zip(matchers, tokens, strict=True) if t is not None]
    engine.apply = lambda logits: lt.apply_token_bitmask_inplace(logits, engine.bitmask)
    engine.errors = lambda: [m.get_error() for m in matchers if m.is_error()]
    return engine


def xgrammar_engine(tok, schema: str, batch: int, vocab: int) -> Engine:
    import xgrammar as xg

    if ("xgrammar", vocab) not in _LLTOKENIZERS:  # once per worker, like llguidance's tokenizer
        info = xg.TokenizerInfo(
            byte_vocab(tok.backend), xg.VocabType.RAW, vocab_size=vocab, stop_token_ids=list(tok.eos_token_ids)
        )
        _LLTOKENIZERS["xgrammar", vocab] = xg.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compiled = _LLTOKENIZERS["xgrammar", vocab].compile_json_schema(schema)
    matchers = [xg.GrammarMatcher(compiled) for _ in range(batch)]
    engine = Engine()
    engine.name = "xgrammar"
    engine.bitmask = xg.allocate_token_bitmask(batch, vocab)

    def fill() -> None:
        for row, m in enumerate(matchers):
            m.fill_next_token_bitmask(engine.bitmask, row)

    engine.fill = fill
    engine.advance = lambda tokens: [m.accept_token(t) for m, t in zip(matchers, tokens, strict=True) if t is not None]
    engine.apply = lambda logits: xg.apply_token_bitmask_inplace(logits, engine.bitmask)
    engine.errors = lambda: []
    return engine


def outlines_engine(tok, schema: str, batch: int, vocab: int) -> Engine:
    import outlines_core as oc
    from outlines_core.kernels import torch as ok

    raw = byte_vocab(tok.backend)
    eos = tok.eos_token_ids[0]
    mapping: dict[bytes, list[int]] = {}
    for index, piece in enumerate(raw):
        if index != eos and piece:
            mapping.setdefault(piece, []).append(index)
    index = oc.Index(oc.json_schema.build_regex_from_schema(schema), oc.Vocabulary(eos, mapping))
    guides = [oc.Guide(index) for _ in range(batch)]
    import torch

    engine = Engine()
    engine.name = "outlines-core"
    engine.bitmask = torch.zeros(batch, (vocab + 31) // 32, dtype=torch.int32)

    def fill() -> None:
        for row, g in enumerate(guides):
            mask = engine.bitmask[row]
            g.write_mask_into(mask.data_ptr(), mask.numel(), 4)

    engine.fill = fill
    engine.advance = lambda tokens: [g.advance(t) for g, t in zip(guides, tokens, strict=True) if t is not None]
    engine.apply = lambda logits: ok.apply_token_bitmask_inplace(logits, engine.bitmask)
    engine.errors = lambda: []
    return engine


def pdserve_engine(tok, schema: str, batch: int, vocab: int) -> Engine:
    """What a decode step runs: model/sampling/grammar.py's grammar, grammar_mask's matchers and
    `mask_rows` (llguidance's masks, unpacked without its torch.compile kernel)."""
    from pdserve_worker.model.sampling.grammar import build
    from pdserve_worker.model.sampling.grammar_mask import GrammarMatcher, mask_rows

    grammar = build("json_schema", json.loads(schema))
    matchers = [GrammarMatcher.start(tok, vocab, grammar) for _ in range(batch)]
    engine = Engine()
    engine.name = "pdserve (llguidance)"
    engine.fill = lambda: None
    engine.apply = lambda logits: mask_rows(logits, matchers)
    engine.advance = lambda tokens: [m.consume([t]) for m, t in zip(matchers, tokens, strict=True) if t is not None]
    engine.errors = lambda: []
    return engine


ENGINES = {
    "pdserve": pdserve_engine,
    "llguidance": llguidance_engine,
    "xgrammar": xgrammar_engine,
    "outlines": outlines_engine,
}


def measure(make, tok, batch: int, vocab: int, tokens: list[int], steps: int) -> tuple[float, list[float]]:
    import torch

    schema = json.dumps(SCHEMA)
    started = time.perf_counter()
    engine = make(tok, schema, batch, vocab)
    compile_s = time.perf_counter() - started
    # Row r starts r tokens into the instance (advanced there first), so the rows are in
    # different places of the grammar, as the requests of a batch are.
    for r in range(batch - 1):
        engine.advance([tokens[r] if row > r else None for row in range(batch)])
    logits = torch.randn(batch, vocab)
    times = []
    for i in range(steps):
        step_tokens = [tokens[row + i] for row in range(batch)]
        t0 = time.perf_counter()
        engine.fill()
        engine.apply(logits)
        engine.advance(step_tokens)
        times.append(time.perf_counter() - t0)
    if errors := engine.errors():
        raise SystemExit(f"{engine.name} refused the instance's tokens: {errors[0]}")
    return compile_s, times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--engines", default="pdserve,llguidance,xgrammar,outlines")
    args = parser.parse_args(argv)
    import torch

    from pdserve_worker.cli.local_deployment import auto_dtype
    from pdserve_worker.model.loading.default_model import default_model_path
    from pdserve_worker.model.loading.loader import load_model
    from pdserve_worker.model.sampling.params import SamplingParams

    torch.set_num_threads(2)
    dtype = auto_dtype()
    loaded = load_model(str(default_model_path()), dtype=dtype)
    tok, vocab = loaded.tokenizer, loaded.model.config.vocab_size
    # Compact, as the production grammar writes JSON (model/sampling/grammar.py); the others take it too.
    tokens = tok.encode(json.dumps(INSTANCE, separators=(",", ":")), add_special_tokens=False)
    if len(tokens) < args.batch + args.steps:
        raise SystemExit(f"the instance has {len(tokens)} tokens, fewer than batch + steps")
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    print(
        f"# grammar engines on {machine()}, vocab {vocab}, batch {args.batch}, instance {len(tokens)} tokens",
        flush=True,
    )
    decode = step_times(loaded, plain, args.batch, 20)
    results = {}
    for name in args.engines.split(","):
        compile_s, times = [], []
        for r in range(3):
            c, t = measure(ENGINES[name], tok, args.batch, vocab, tokens, args.steps)
            compile_s.append(c)
            times += t if r else t[1:]  # the very first step of an engine also builds its lazy tables
            print(
                f"  round {r + 1}: {name} compile {c * 1e3:.0f} ms, first step {t[0] * 1e3:.1f} ms, "
                f"then p50 {statistics.median(t[1:]) * 1e3:.2f} ms max {max(t[1:]) * 1e3:.1f} ms",
                flush=True,
            )
        results[name] = (statistics.median(compile_s), statistics.median(times), max(times[1:]))
        decode += step_times(loaded, plain, args.batch, 20)  # interleaved: the host is shared
    base = statistics.median(decode)
    print(f"decode step p50 at batch {args.batch}: {base * 1e3:.1f} ms")
    for name, (c, step, worst) in results.items():
        print(
            f"  {name}: compile {c * 1e3:.0f} ms, mask step p50 {step * 1e3:.2f} ms (max after the first {worst * 1e3:.1f}), ratio {step / base:.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
