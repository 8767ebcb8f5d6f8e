"""pdserve against vLLM (CPU) on this machine: same weights, same client, one run.

Setup (once; an optional peer, never a test dependency):  bash benchmarks/setup_vllm.sh
Run:    .venv/bin/python benchmarks/vs_vllm.py [--servers vllm,colocated,pd,colocated-int4]
                                               [--scenarios batch1,long,c8,c16,prefix,mixed] [--quick]

Both servers get one HF folder made from the bundled SmolLM2-135M GGUF by transformers
(`from_pretrained(gguf_file=...)`, saved with its tokenizer and generation config), in the
dtype `pdserve local` picks on this CPU (bfloat16 with native bf16, else float32; `--dtype` sets
it, and `--pdserve-dtype` sets pdserve's compute dtype apart: `--dtype bfloat16 --pdserve-dtype
auto` runs each server's own default on a bf16 checkpoint), and are started one at a time, each
with both cores:
- `vllm`: `python -m vllm.entrypoints.openai.api_server` from the peer venv, with
  VLLM_CPU_OMP_THREADS_BIND=0-<n-1> and VLLM_CPU_NUM_OF_RESERVED_CPU=0 (its default keeps a
  core for its front end), VLLM_CPU_KVCACHE_SPACE=4 GiB, its defaults otherwise (prefix
  caching, chunked prefill, torch.compile); its effective settings are read from its log;
- `colocated`: `pdserve local --colocated` on the same folder (dense weights);
- `pd`: `pdserve local --prefill 1 --decode 1 --disaggregation always` on the same folder (every
  prompt pushed by the prefill); `pd-auto` and `pd-never` (not in the default list): the same
  with the router's conditional disaggregation `auto` (its costs reported after the warm-up) or
  `never` (every prompt the decode can take computed there; router/disaggregation.py);
- `colocated-int4`: `pdserve local --colocated` on the GGUF itself (the default int4 weights);
- `colocated-int4-q8in` (not in the default list): the same with PDSERVE_QUANT_INPUTS=int8 (the
  block kernel's opt-in int8 inputs, llama.cpp's Q4 x Q8_0: faster, not the file's model exactly);
- `vllm-pd` (not in the default list): vLLM's own disaggregation, a prefill and a decode
  instance on a core each sharing KV through files (ExampleConnector), behind
  benchmarks/vllm_pd_proxy.py (what its examples' proxy does: max_tokens 1 to the prefill,
  then the request to the decode). The PD peer of `pd`.

The client is one streaming /v1/completions client for all (benchmarks/serve.py's `one`, with
ignore_eos so every request generates its max_tokens). Scenarios (prompts are word soup of
exactly the stated length):
- batch1: 3 requests one at a time, 128-token prompt, 128 out;
- long: 2 requests one at a time, 2,000-token prompt, 32 out;
- c8 / c16: 8 / 16 requests at once, 256-token prompts, 128 out (16 / 32 requests: two waves);
- prefix: 16 requests sharing a 1,500-token prefix (distinct 32-token tails), 4 at a time;
- mixed: streaming decodes (8 requests, 64-token prompts, 96 out) with 3 long prompts
  (1,500 tokens, 16 out) arriving among them; TPOT p99 of the streaming ones and goodput
  (requests meeting TTFT ≤ --slo-ttft and TPOT ≤ --slo-tpot, per second: DistServe's metric);
- sweep-concurrency: 1, 2, 4, 8 and 16 requests at once (twice that many in all), 256-token
  prompts, 64 out: output tokens/s and TPOT against concurrency (the plot's first two panels);
- sweep-length: one request at a time, prompts of 128, 512, 1,024 and 2,000 tokens, 8 out:
  TTFT against prompt length (the third panel).

Every scenario draws prompts of its own (seeded by its name): no prompt, and no prefix but the
prefix scenario's own, is shared between scenarios, so a server's prefix cache helps only
where the scenario means it to. Each server is warmed up the same way before it is measured
(a few requests of other lengths and batch sizes, prompts of their own), as vLLM warms itself
up at start.

Prints TTFT p50, TPOT p50/p99 and output tokens/s per server and scenario, and every ratio
pdserve ÷ vLLM; writes a JSON and PNG plots to --out.

`--rounds N` (N > 1): this machine is shared and its speed drifts over minutes, so one run per
server, a server's whole run after the other's, can decide a ratio by when each ran. With
rounds, every server is started first (one at a time) and stays up, idle while another is
measured (idle, a server costs little: over 30 s, 2026-12-06 on the 2-vCPU EPYC, 0.07 CPU-s
for `colocated`, 0.44 for vLLM, 0.83 for `pd`'s five processes); each scenario then runs N
times on every server, server after server, the order reversed every other round, each round
with prompts of its own. The tables and plots show each figure's median over the rounds, and
the ratios are also given paired by round: the median, lowest and highest of the N ratios of
runs a minute or two apart (and a plot of each round's pair, vs_vllm_rounds.png).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import httpx  # noqa: E402

import serve  # noqa: E402  (its client and percentile; it puts worker/ and the rest on sys.path)
from seed_transfer import machine  # noqa: E402

ROOT = serve.ROOT
VLLM_VENV = ROOT / ".venv-vllm"
KEEPALIVE_S = 4.0  # a worker's keepalive (the broker's 10 s lease / 3) and a little


@dataclass(frozen=True)
class Scenario:
    name: str
    prompt_tokens: int
    output_tokens: int
    requests: int
    concurrency: int  # requests in flight at once (1: one after the other)
    shared_prefix: int = 0  # tokens every prompt shares (the prefix scenario)


SCENARIOS = {
    "batch1": Scenario("batch1", 128, 128, 3, 1),
    "long": Scenario("long", 2000, 32, 2, 1),
    "c8": Scenario("c8", 256, 128, 16, 8),
    "c16": Scenario("c16", 256, 128, 32, 16),
    "prefix": Scenario("prefix", 1532, 32, 16, 4, shared_prefix=1500),
}


# ---- the shared weights ------------------------------------------------------------------------------
def hf_folder(dtype: str, cache: Path) -> Path:
    """The bundled GGUF as one HF folder (transformers' own conversion), made once."""
    folder = cache / f"smollm2-135m-{dtype}"
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from pdserve_worker.model.loading.default_model import default_model_path

    gguf = default_model_path()
    print(f"# converting {gguf.name} to an HF folder ({dtype}) for both servers ...", flush=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype))
    model.hf_quantizer = None  # FACTS.md: drop the GGUF quantizer marker before saving
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = Path(tempfile.mkdtemp(dir=cache))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id).save_pretrained(tmp)
    tmp.rename(folder)
    return folder


# ---- the servers --------------------------------------------------------------------------------------
@dataclass
class Server:
    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    settings: dict[str, Any]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # our own child's group: vLLM spawns an engine process
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float, announce: bool = False) -> None:
    """Until `url` answers /v1/models — and, for `pdserve local` (`announce`), until it printed
    its URL, which it does once every member serves (its router answers /v1/models before)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); its log: {log}\n{log.read_text()[-3000:]}")
        try:
            served = httpx.get(f"{url}/v1/models", timeout=2).status_code in (200, 401)  # 401: it has API keys
        except httpx.HTTPError:
            served = False
        if served and (not announce or any(line.strip() == url for line in log.read_text().splitlines())):
            return
        time.sleep(2)
    raise TimeoutError(f"{url} did not serve within {timeout_s:.0f} s; log {log}")


def start_vllm(
    folder: Path,
    dtype: str,
    port: int,
    logs: Path,
    python: Path,
    extra: tuple[str, ...] = (),
    omp_bind: str | None = None,  # default: every core to its one rank ("0-N"); "0|1": a core per rank
    name: str = "vllm",
) -> Server:
    cpus = len(os.sched_getaffinity(0))
    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": omp_bind or f"0-{cpus - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "HF_HUB_OFFLINE": "1",
    }
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
    argv += ["--served-model-name", "smollm2", "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--max-model-len", "4096", *extra]
    log = logs / f"{name}.log"
    proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    server = Server(name, url, proc, log, {})
    try:
        wait_ready(url, proc, log, 900)
    except BaseException:
        server.stop()  # a server that never served is not left behind
        raise
    server.settings = vllm_settings(log.read_text())
    return server


@dataclass
class Group:
    """Servers answering behind one URL (vLLM's PD: two instances and the proxy), stopped together."""

    name: str
    url: str
    parts: list[Server]
    settings: dict[str, Any]

    def stop(self) -> None:
        for part in reversed(self.parts):
            part.stop()


def start_vllm_pd(folder: Path, dtype: str, port: int, logs: Path, python: Path) -> Group:
    """vLLM's own disaggregation on this machine: a prefill instance (`kv_producer`) on core 0, a
    decode instance (`kv_consumer`) on core 1, sharing KV through files (ExampleConnector, its
    example connector and the one that needs no RDMA), behind benchmarks/vllm_pd_proxy.py."""
    store = logs / "vllm-pd-kv"
    store.mkdir(parents=True, exist_ok=True)
    parts: list[Server] = []

    def connector(role: str) -> tuple[str, ...]:
        extra = {"shared_storage_path": str(store)}
        config = {"kv_connector": "ExampleConnector", "kv_role": role, "kv_connector_extra_config": extra}
        return ("--kv-transfer-config", json.dumps(config))

    try:
        for index, role in enumerate(("kv_producer", "kv_consumer")):
            name = f"vllm-{role.removeprefix('kv_')}"
            parts.append(start_vllm(folder, dtype, port + 100 + index, logs, python, connector(role), str(index), name))
        argv = [sys.executable, str(ROOT / "benchmarks" / "vllm_pd_proxy.py"), "--port", str(port)]
        argv += ["--prefill", parts[0].url, "--decode", parts[1].url]
        log = logs / "vllm-pd-proxy.log"
        proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
        parts.append(Server("vllm-pd-proxy", f"http://127.0.0.1:{port}", proc, log, {}))
        wait_ready(parts[-1].url, proc, log, 60)
    except BaseException:
        Group("vllm-pd", "", parts, {}).stop()
        raise
    return Group("vllm-pd", parts[-1].url, parts, {"prefill": parts[0].settings, "decode": parts[1].settings})


def vllm_settings(text: str) -> dict[str, Any]:
    """What vLLM says it runs with (its startup log), for the record."""
    found: dict[str, Any] = {}
    for key, pattern in (
        ("version", r"vLLM API server version ([\w.+-]+)"),
        ("prefix_caching", r"enable_prefix_caching=(\w+)"),
        ("chunked_prefill", r"enable_chunked_prefill=(\w+)"),
        ("max_num_batched_tokens", r"max_num_batched_tokens=(\d+)"),
        ("max_num_seqs", r"max_num_seqs=(\d+)"),
        ("compilation", r"compilation_config=(\{[^}]{0,200})"),
        ("kv_cache_gib", r"KV cache space[^\d]*([\d.]+)"),
        ("kv_cache_tokens", r"KV cache size: ([\d,]+) tokens"),
        # vLLM 0.32 logs its token budget as the compile range's end, not by name
        ("compile_range_end_tokens", r"'compile_ranges_endpoints': \[(\d+)\]"),
        ("non_default_args", r"non-default args: (\{[^}]*\})"),
        ("omp_bind", r"OMP threads binding[^\n]*"),
    ):
        match = re.search(pattern, text)
        if match:
            found[key] = match.group(1) if match.groups() else match.group(0)
    return found


def start_pdserve(name: str, model: str, dtype: str, port: int, logs: Path, extra: list[str]) -> Server:
    argv = [str(ROOT / ".venv" / "bin" / "pdserve"), "local", "--model", model, "--dtype", dtype]
    argv += ["--port", str(port), "--max-len", "4096", "--slots", "16", "--log-dir", str(logs / name), *extra]
    log = logs / f"{name}.log"
    proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    server = Server(name, url, proc, log, {"argv": " ".join(argv[1:])})
    try:
        wait_ready(url, proc, log, 600, announce=True)
    except BaseException:
        server.stop()
        raise
    return server


# ---- the load ----------------------------------------------------------------------------------------
def prompt_text(tokenizer: Any, tokens: int, rng: random.Random) -> str:
    words = " ".join(rng.choice(serve.WORDS) for _ in range(tokens + 8))
    ids = tokenizer.encode(words)[:tokens]
    return tokenizer.decode(ids, skip_special_tokens=True)


def seed_of(name: str) -> int:
    """A scenario's own prompt seed (stable across runs and servers)."""
    return zlib.crc32(name.encode())


def scenario_requests(s: Scenario, tokenizer: Any, seed: int) -> list[serve.Request]:
    rng = random.Random(seed)
    prefix = prompt_text(tokenizer, s.shared_prefix, rng) if s.shared_prefix else ""
    out = []
    for _ in range(s.requests):
        tail = prompt_text(tokenizer, s.prompt_tokens - s.shared_prefix, rng)
        text = f"{prefix} {tail}" if prefix else tail
        out.append(serve.Request(0.0, text, len(tokenizer.encode(text))))
    return out


async def run_scenario(url: str, s: Scenario, requests: list[serve.Request]) -> tuple[list[serve.Result], float]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=10.0)) as http:
        model = (await http.get(f"{url}/v1/models")).json()["data"][0]["id"]
        await serve.one(http, url, model, serve.Request(0.0, "hello there", 2), 4, time.monotonic())  # warm-up
        gate = asyncio.Semaphore(s.concurrency)

        async def limited(r: serve.Request) -> serve.Result:
            async with gate:
                return await serve.one(http, url, model, r, s.output_tokens, time.monotonic())

        started = time.monotonic()
        results = await asyncio.gather(*(limited(r) for r in requests))
        return list(results), time.monotonic() - started


async def run_mixed(url: str, tokenizer: Any, args: argparse.Namespace, round_: int = 0) -> dict[str, Any]:
    """Streaming decodes with long prompts arriving among them (the PD case)."""
    rng = random.Random(7 + round_)
    short = [serve.Request(0.5 * i, prompt_text(tokenizer, 64, rng), 64) for i in range(8)]
    long = [serve.Request(1.0 + 2.0 * i, prompt_text(tokenizer, 1500, rng), 1500) for i in range(3)]
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=10.0)) as http:
        model = (await http.get(f"{url}/v1/models")).json()["data"][0]["id"]
        await serve.one(http, url, model, serve.Request(0.0, "hello there", 2), 4, time.monotonic())
        start = time.monotonic()
        results = await asyncio.gather(
            *(serve.one(http, url, model, r, 96, start) for r in short),
            *(serve.one(http, url, model, r, 16, start) for r in long),
        )
        wall = time.monotonic() - start
    streaming = [r for r in results[: len(short)] if r.error is None]
    tpots = [r.tpot for r in streaming if r.tpot is not None]
    good = [
        r
        for r in results
        if r.error is None and r.ttft is not None and r.ttft <= args.slo_ttft and (r.tpot or 0) <= args.slo_tpot
    ]
    return {
        "tpot_p50_ms": serve.pct(tpots, 50) * 1e3,
        "tpot_p99_ms": serve.pct(tpots, 99) * 1e3,
        "ttft_p50_s": serve.pct([r.ttft for r in results if r.ttft is not None], 50),
        "goodput_rps": len(good) / wall,
        "failed": sum(1 for r in results if r.error),
    }


def summarize(results: list[serve.Result], wall: float) -> dict[str, Any]:
    ok = [r for r in results if r.error is None and r.token_times]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    return {
        "ttft_p50_s": serve.pct(ttft, 50),
        "tpot_p50_ms": serve.pct(tpot, 50) * 1e3,
        "tpot_p99_ms": serve.pct(tpot, 99) * 1e3,
        "tok_per_s": sum(r.completion_tokens for r in ok) / wall if wall else 0.0,
        "failed": len(results) - len(ok),
    }


SWEEP_CONCURRENCY = (1, 2, 4, 8, 16)
SWEEP_LENGTHS = (128, 512, 1024, 2000)
SWEEPS = ("sweep-concurrency", "sweep-length")


def sweep_scenarios(name: str) -> dict[str, Scenario]:
    """The points of a sweep, each a scenario with prompts of its own."""
    if name == "sweep-concurrency":
        return {str(c): Scenario(f"{name}-{c}", 256, 64, 2 * c, c) for c in SWEEP_CONCURRENCY}
    return {str(n): Scenario(f"{name}-{n}", n, 8, 2, 1) for n in SWEEP_LENGTHS}


def warm_up(server: Server | Group, tokenizer: Any) -> None:
    """The same warm-up for every server: one long prompt alone, then a batch of short ones."""
    started = time.perf_counter()
    for s in (Scenario("warmup-long", 600, 8, 1, 1), Scenario("warmup-batch", 100, 16, 4, 4)):
        asyncio.run(run_scenario(server.url, s, scenario_requests(s, tokenizer, seed_of(s.name))))
    if server.name == "pd-auto":  # the workers' costs reach its router with their next keepalive (ttl/3);
        time.sleep(KEEPALIVE_S)  # then the warm-up's remote requests measure the remote road's overhead
        s = Scenario("warmup-batch", 100, 16, 4, 4)
        asyncio.run(run_scenario(server.url, s, scenario_requests(s, tokenizer, seed_of(s.name) + 1)))
    print(f"  [{server.name}] warmed up ({time.perf_counter() - started:.0f} s)", flush=True)


def shortened(s: Scenario) -> Scenario:
    """--quick: one wave, 32 output tokens at most."""
    return Scenario(
        s.name,
        s.prompt_tokens,
        min(s.output_tokens, 32),
        min(s.requests, s.concurrency),
        s.concurrency,
        s.shared_prefix,
    )


def run_one(server: Server | Group, s: Scenario, tokenizer: Any, quick: bool, round_: int = 0) -> dict[str, Any]:
    """One scenario on one server. Round r draws prompts of its own (seed + r): a repeated
    scenario would otherwise find its prompts in the server's prefix cache."""
    s = shortened(s) if quick else s
    requests = scenario_requests(s, tokenizer, seed_of(s.name) + round_)
    results, wall = asyncio.run(run_scenario(server.url, s, requests))
    return summarize(results, wall)


def measure_scenario(
    server: Server | Group, name: str, args: argparse.Namespace, tokenizer: Any, round_: int = 0
) -> dict[str, Any]:
    started = time.perf_counter()
    tag = f"[{server.name}]" + (f" round {round_ + 1}" if args.rounds > 1 else "")
    if name == "mixed":
        row: dict[str, Any] = asyncio.run(run_mixed(server.url, tokenizer, args, round_))
    elif name in SWEEPS:
        row = {}
        for point, s in sweep_scenarios(name).items():
            row[point] = run_one(server, s, tokenizer, args.quick, round_)
            print(f"  {tag} {name} {point}: {row[point]}", flush=True)
    else:
        row = run_one(server, SCENARIOS[name], tokenizer, args.quick, round_)
    print(f"  {tag} {name}: {row} ({time.perf_counter() - started:.0f} s)", flush=True)
    return row


def measure(server: Server | Group, args: argparse.Namespace, tokenizer: Any) -> dict[str, dict[str, Any]]:
    warm_up(server, tokenizer)
    return {name: measure_scenario(server, name, args, tokenizer) for name in args.scenarios.split(",")}


def measure_rounds(
    servers: dict[str, Server | Group], args: argparse.Namespace, tokenizer: Any
) -> list[dict[str, dict[str, Any]]]:
    """--rounds N: every server up (idle while another runs), each scenario run N times on each,
    server after server, the order reversed every other round, so a pair of runs to compare is
    a minute or two apart rather than a whole server's run, and neither server always goes first.
    On a shared machine whose speed drifts over minutes, the median of the paired ratios is the
    figure to quote (print_round_ratios)."""
    for server in servers.values():
        warm_up(server, tokenizer)
    rounds: list[dict[str, dict[str, Any]]] = [{name: {} for name in servers} for _ in range(args.rounds)]
    for name in args.scenarios.split(","):
        for r in range(args.rounds):
            order = list(servers) if r % 2 == 0 else list(reversed(servers))
            for server_name in order:
                rounds[r][server_name][name] = measure_scenario(servers[server_name], name, args, tokenizer, r)
    return rounds


def median_table(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each server's, scenario's (and sweep point's) figures: the median over the rounds (failed
    requests: their sum)."""

    def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
        if isinstance(next(iter(rows[0].values())), dict):  # a sweep: its points
            return {point: median_row([r[point] for r in rows]) for point in rows[0]}
        # failures add up over the rounds (a median would hide one round's)
        return {key: (sum if key == "failed" else statistics.median)([r[key] for r in rows]) for key in rows[0]}

    first = rounds[0]
    return {sv: {sc: median_row([r[sv][sc] for r in rounds]) for sc in first[sv]} for sv in first}


def round_ratios(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, dict[str, list[float | None]]]]:
    """Per server (not vLLM), scenario and metric: pdserve ÷ vLLM in each round (the pairs);
    None where vLLM's figure is 0 (no request of its met the mixed scenario's SLO: no ratio)."""
    keys = {"mixed": ("tpot_p99_ms", "goodput_rps")}
    default = ("ttft_p50_s", "tpot_p50_ms", "tok_per_s")
    flats = [flat(r) for r in rounds]
    out: dict[str, dict[str, dict[str, list[float | None]]]] = {}
    for sv in flats[0]:
        if sv == "vllm" or "vllm" not in flats[0]:
            continue
        out[sv] = {}
        for sc in flats[0][sv]:
            out[sv][sc] = {
                key: [f[sv][sc][key] / f["vllm"][sc][key] if f["vllm"][sc][key] else None for f in flats]
                for key in keys.get(sc, default)
            }
    return out


def spread(ratios: list[float | None]) -> str:
    """The median [lowest – highest] of the rounds that have a ratio, and how many have none."""
    values = [v for v in ratios if v is not None]
    missing = (
        f" ({len(ratios) - len(values)} of {len(ratios)} rounds: vLLM 0, no ratio)" if len(values) < len(ratios) else ""
    )
    if not values:
        return "—" + missing
    return f"{statistics.median(values):.2f} [{min(values):.2f} – {max(values):.2f}]" + missing


def print_round_ratios(rounds: list[dict[str, dict[str, Any]]]) -> None:
    for sv, rows in round_ratios(rounds).items():
        print(f"\n{sv} ÷ vLLM, paired by round: median [lowest – highest] of {len(rounds)}")
        for sc, metrics in rows.items():
            print(f"  {sc}: " + ", ".join(f"{key} {spread(v)}" for key, v in metrics.items()))


# ---- report --------------------------------------------------------------------------------------------
def flat(table: dict[str, dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Each sweep's points as rows of their own ("sweep-length 512")."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for server, rows in table.items():
        out[server] = {}
        for name, row in rows.items():
            if name in SWEEPS:
                out[server].update({f"{name} {point}": r for point, r in row.items()})
            else:
                out[server][name] = row
    return out


def print_report(table: dict[str, dict[str, dict[str, Any]]]) -> None:
    table = flat(table)
    servers = list(table)
    scenarios = list(next(iter(table.values())))
    print("\n| scenario | " + " | ".join(servers) + " |")
    print("|---|" + "---|" * len(servers))
    for sc in scenarios:
        cells = []
        for sv in servers:
            r = table[sv].get(sc, {})
            if sc == "mixed":
                cells.append(
                    f"TPOT p99 {r.get('tpot_p99_ms', float('nan')):.0f} ms, goodput {r.get('goodput_rps', 0):.2f}/s"
                )
            else:
                cells.append(
                    f"TTFT {r.get('ttft_p50_s', float('nan')):.2f} s, TPOT {r.get('tpot_p50_ms', float('nan')):.0f} ms, "
                    f"{r.get('tok_per_s', 0):.1f} tok/s"
                )
        print(f"| {sc} | " + " | ".join(cells) + " |")
    if "vllm" not in table:
        return
    base = table["vllm"]
    print("\n| scenario | " + " | ".join(f"{sv} ÷ vLLM: TTFT / TPOT / tok/s" for sv in servers if sv != "vllm") + " |")
    print("|---|" + "---|" * (len(servers) - 1))
    for sc in scenarios:
        cells = []
        for sv in servers:
            if sv == "vllm":
                continue
            r, b = table[sv].get(sc, {}), base.get(sc, {})
            if sc == "mixed":
                cells.append(
                    f"TPOT p99 {r['tpot_p99_ms'] / b['tpot_p99_ms']:.2f}, goodput "
                    f"{r['goodput_rps'] / b['goodput_rps'] if b['goodput_rps'] else float('nan'):.2f}"
                )
            else:
                cells.append(
                    f"{r['ttft_p50_s'] / b['ttft_p50_s']:.2f} / {r['tpot_p50_ms'] / b['tpot_p50_ms']:.2f} / "
                    f"{r['tok_per_s'] / b['tok_per_s']:.2f}"
                )
        print(f"| {sc} | " + " | ".join(cells) + " |")


def plot(table: dict[str, dict[str, dict[str, Any]]], path: Path, where: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = [sc for sc in next(iter(table.values())) if sc != "mixed" and sc not in SWEEPS]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    width = 0.8 / len(table)
    for ax, (key, label) in zip(
        axes, (("ttft_p50_s", "TTFT p50 (s)"), ("tpot_p50_ms", "TPOT p50 (ms)"), ("tok_per_s", "output tokens/s"))
    ):
        for i, (server, rows) in enumerate(table.items()):
            ax.bar(
                [j + i * width for j in range(len(scenarios))], [rows[sc][key] for sc in scenarios], width, label=server
            )
        ax.set_xticks([j + width * (len(table) - 1) / 2 for j in range(len(scenarios))], scenarios)
        ax.set_title(label, fontsize=9)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"pdserve and vLLM (CPU), same weights and client — {where}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweeps(table: dict[str, dict[str, Any]], path: Path, where: str) -> bool:
    """tok/s and TPOT against concurrency, TTFT against prompt length: one line per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("sweep-concurrency", "tok_per_s", "output tokens/s", "requests at once"),
        ("sweep-concurrency", "tpot_p50_ms", "TPOT p50 (ms)", "requests at once"),
        ("sweep-length", "ttft_p50_s", "TTFT p50 (s)", "prompt tokens"),
    )
    if not any(sweep in rows for rows in table.values() for sweep, *_ in panels):
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (sweep, key, label, xlabel) in zip(axes, panels):
        for server, rows in table.items():
            points = rows.get(sweep, {})
            if points:
                xs = [int(x) for x in points]
                ax.plot(xs, [points[x][key] for x in points], marker="o", label=server)
        ax.set_xlabel(xlabel, fontsize=9)
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"pdserve and vLLM (CPU) against load and prompt length — {where}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def start_server(
    name: str, args: argparse.Namespace, folder: Path, dtype: str, port: int, logs: Path
) -> Server | Group | None:
    """One configuration of --servers, serving (None: vLLM's venv is not set up)."""
    from pdserve_worker.model.loading.default_model import default_model_path

    started = time.perf_counter()
    if name in ("vllm", "vllm-pd") and not args.vllm_python.exists():
        print(f"# {name} skipped: {args.vllm_python} missing (bash benchmarks/setup_vllm.sh)", flush=True)
        return None
    if name == "vllm":
        server: Server | Group = start_vllm(folder, dtype, port, logs, args.vllm_python)
    elif name == "vllm-pd":
        server = start_vllm_pd(folder, dtype, port, logs, args.vllm_python)
    elif name == "colocated-int4":
        server = start_pdserve(name, str(default_model_path()), args.pdserve_dtype, port, logs, ["--colocated"])
    elif name == "colocated-int4-q8in":
        extra = ["--colocated", "--env", "PDSERVE_QUANT_INPUTS=int8"]
        server = start_pdserve(name, str(default_model_path()), args.pdserve_dtype, port, logs, extra)
    elif name == "colocated":
        server = start_pdserve(name, str(folder), args.pdserve_dtype, port, logs, ["--colocated"])
    elif name in ("pd", "pd-auto", "pd-never"):
        policy = {"pd": "always", "pd-auto": "auto", "pd-never": "never"}[name]
        pd = ["--prefill", "1", "--decode", "1", "--disaggregation", policy]
        server = start_pdserve(name, str(folder), args.pdserve_dtype, port, logs, pd)
    else:
        raise SystemExit(f"unknown server {name!r}")
    print(f"# {name} serving after {time.perf_counter() - started:.0f} s: {server.settings}", flush=True)
    return server


def run_rounds(
    args: argparse.Namespace, folder: Path, dtype: str, logs: Path, tokenizer: Any
) -> tuple[dict[str, dict[str, Any]], dict[str, Any], list[dict[str, dict[str, Any]]]]:
    """--rounds N: every server started (one at a time) and kept up, then measure_rounds."""
    servers: dict[str, Server | Group] = {}
    try:
        for index, name in enumerate(args.servers.split(",")):
            server = start_server(name, args, folder, dtype, 18600 + index, logs)
            if server is not None:
                servers[name] = server
        rounds = measure_rounds(servers, args, tokenizer) if servers else []
    finally:
        for server in servers.values():
            server.stop()
    if not rounds:
        return {}, {}, []
    return median_table(rounds), {name: s.settings for name, s in servers.items()}, rounds


def plot_round_ratios(rounds: list[dict[str, dict[str, Any]]], path: Path, where: str) -> bool:
    """--rounds: pdserve ÷ vLLM per scenario, a dot per round and a bar at the median."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = round_ratios(rounds)
    if not ratios:
        return False
    labels = {
        "ttft_p50_s": "TTFT p50 ÷ vLLM",
        "tpot_p50_ms": "TPOT p50 ÷ vLLM",
        "tok_per_s": "tokens/s ÷ vLLM",
        "tpot_p99_ms": "TPOT p99 ÷ vLLM (mixed)",
        "goodput_rps": "goodput ÷ vLLM (mixed)",
    }
    present = {key for rows in ratios.values() for metrics in rows.values() for key in metrics}
    panels = [(key, label) for key, label in labels.items() if key in present]  # (the mixed trace has its own)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.5), squeeze=False)
    width = 0.8 / len(ratios)
    for ax, (key, label) in zip(axes[0], panels):
        scenarios = sorted({sc for rows in ratios.values() for sc, metrics in rows.items() if key in metrics})
        for i, (server, rows) in enumerate(ratios.items()):
            for j, sc in enumerate(scenarios):
                values = [v for v in rows.get(sc, {}).get(key, []) if v is not None]
                if not values:
                    continue
                x = j + i * width
                ax.scatter([x] * len(values), values, s=14, color=f"C{i + 1}", label=server if j == 0 else None)
                ax.hlines(statistics.median(values), x - width / 3, x + width / 3, color=f"C{i + 1}")
        ax.set_xticks([j + width * (len(ratios) - 1) / 2 for j in range(len(scenarios))], scenarios, fontsize=8)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"pdserve ÷ vLLM, each round's pair (dots) and their median (bar) — {where}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default="vllm,colocated,pd,colocated-int4")
    parser.add_argument("--scenarios", default="batch1,long,c8,c16,prefix,mixed,sweep-concurrency,sweep-length")
    parser.add_argument("--vllm-python", type=Path, default=VLLM_VENV / "bin" / "python")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument(
        "--pdserve-dtype",
        choices=["auto", "bfloat16", "float32"],
        help="pdserve's --dtype on the same folder (default: --dtype's), e.g. each server's own default",
    )
    parser.add_argument("--slo-ttft", type=float, default=5.0, help="mixed: TTFT bound of goodput, s")
    parser.add_argument("--slo-tpot", type=float, default=0.15, help="mixed: TPOT bound of goodput, s")
    parser.add_argument("--quick", action="store_true", help="one wave per scenario, 32 output tokens at most")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run each scenario this many times on each server, all servers up, alternating (medians)",
    )
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "pdserve-vs-vllm")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "figures")
    parser.add_argument(
        "--merge", action="store_true", help="add these servers' results to the JSON in --out (a rerun of one server)"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    from pdserve_worker.cli.local_deployment import auto_dtype
    from pdserve_worker.model.tokenizer import Tokenizer

    dtype = auto_dtype() if args.dtype == "auto" else args.dtype
    ours = args.pdserve_dtype or args.dtype
    args.pdserve_dtype = auto_dtype() if ours == "auto" else ours
    args.cache.mkdir(parents=True, exist_ok=True)
    folder = hf_folder(dtype, args.cache)
    tokenizer = Tokenizer.from_dir(folder)
    where = f"{machine()}, {datetime.date.today()}, SmolLM2-135M {dtype}"
    if args.pdserve_dtype != dtype:
        where += f" (pdserve computing in {args.pdserve_dtype})"
    print(f"# vs_vllm {datetime.datetime.now().isoformat(timespec='seconds')} on {where}", flush=True)
    logs = Path(tempfile.mkdtemp(prefix="vs-vllm-logs-"))
    table: dict[str, dict[str, dict[str, Any]]] = {}
    settings: dict[str, Any] = {}
    rounds: list[dict[str, dict[str, Any]]] = []
    if args.rounds > 1:
        table, settings, rounds = run_rounds(args, folder, dtype, logs, tokenizer)
    else:
        for index, name in enumerate(args.servers.split(",")):
            server = start_server(name, args, folder, dtype, 18600 + index, logs)
            if server is None:
                continue
            try:
                table[name] = measure(server, args, tokenizer)
                settings[name] = server.settings
            finally:
                server.stop()
    if not table:
        return 1
    if args.merge and (args.out / "vs_vllm.json").is_file():
        earlier = json.loads((args.out / "vs_vllm.json").read_text())
        table = {**{k: v for k, v in earlier["results"].items() if k not in table}, **table}
        settings = {**earlier.get("settings", {}), **settings}
    print_report(table)
    if rounds:
        print_round_ratios(rounds)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine(), "date": str(datetime.date.today()), "dtype": dtype, "settings": settings}
    report["pdserve_dtype"] = args.pdserve_dtype
    if rounds:  # the table is then each figure's median over the rounds; the rounds themselves too
        report |= {"rounds": rounds, "paired_ratios": round_ratios(rounds)}
    (args.out / "vs_vllm.json").write_text(json.dumps(report | {"results": table}, indent=1))
    try:
        plot(table, args.out / "vs_vllm.png", where)
        print(f"plot: {args.out / 'vs_vllm.png'}")
        if plot_sweeps(table, args.out / "vs_vllm_sweeps.png", where):
            print(f"plot: {args.out / 'vs_vllm_sweeps.png'}")
        if rounds and plot_round_ratios(rounds, args.out / "vs_vllm_rounds.png", f"{where}, {len(rounds)} rounds"):
            print(f"plot: {args.out / 'vs_vllm_rounds.png'}")
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install -e '.[plots]')")
    shutil.rmtree(logs, ignore_errors=True) if not any(
        r.get("failed") for t in table.values() for r in t.values()
    ) else None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
