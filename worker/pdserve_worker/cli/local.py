"""`pdserve local`: run a PD deployment (broker, decode, prefill, router) on this machine.

    pdserve local --prefill 1 --decode 2 [--port 8000] [--model PATH] [--dtype ...]
    pdserve local --demo        start, ask one question, show the answer and its timing, stop
    pdserve local --colocated   one process that prefills and decodes (the baseline)
    pdserve local --engine vllm prefill and decode on vLLM (pdserve's KV connector), not pdserve's engine
    pdserve local --tls         mutual TLS on every gRPC hop, HTTPS at the router (a CA made for the run)
    pdserve local --api-keys F  require API keys (a keys file, docs/admission.md) on the OpenAI endpoint
    pdserve local --trace-file spans.jsonl   OpenTelemetry spans of every process, one JSON object a line
    pdserve local --broker HOST:PORT --token-file F   attach the workers to an operator's broker

Progress goes to stderr; the router's URL goes to stdout once it serves. Ctrl-C or SIGTERM
stops every child. Exits non-zero, with the failing child's last log lines, if the
deployment does not come up.
"""

from __future__ import annotations

import argparse
import os
import ssl
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve_common.pod_env import DISAGGREGATION

if TYPE_CHECKING:
    from pdserve_worker.cli.local_deployment import LocalDeployment, StopFlag
    from pdserve_worker.cli.local_plan import LocalPlan

DEMO_QUESTION = "What is the capital of France?"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("local", help="run a prefill/decode deployment as local processes")
    _deployment_flags(p.add_argument_group("deployment"))
    _road_flags(p.add_argument_group("road"))
    _model_flags(p.add_argument_group("model"))
    _kv_flags(p.add_argument_group("kv"))
    _run_flags(p.add_argument_group("run"))
    p.set_defaults(func=run)


def _road_flags(p: argparse._ArgumentGroup) -> None:
    """Which road a request's KV takes."""
    p.add_argument(
        "--disaggregation",
        choices=["always", "never", "auto"],
        default=os.environ.get(DISAGGREGATION, "auto"),
        help="per request, a prefill pushes the prompt's KV (always), the decode computes it itself (never), "
        "or whichever the workers' measured costs say is sooner (auto; default: $PDSERVE_DISAGGREGATION, "
        "else auto; docs/roles.md)",
    )


def _deployment_flags(p: argparse._ArgumentGroup) -> None:
    """How many of each process, and how they talk."""
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    p.add_argument("--decode", type=int, default=2, help="decode workers (default 2)")
    p.add_argument("--port", type=int, default=8000, help="the router's port (default 8000)")
    p.add_argument(
        "--routers",
        type=int,
        default=1,
        help="router processes (default 1; the others listen on free ports, listed in deployment.json)",
    )
    p.add_argument("--colocated", action="store_true", help="one process that prefills and decodes (no PD)")
    p.add_argument(
        "--layer-shards",
        type=int,
        default=1,
        help="processes per decode instance, each holding a share of the layers (default 1)",
    )
    p.add_argument(
        "--prefill-tp",
        type=int,
        default=1,
        help="tensor-parallel ranks per prefill instance, one process each (default 1); must split the "
        "model's heads (pdserve info --tp N says)",
    )
    p.add_argument(
        "--epp-port",
        type=int,
        default=0,
        help="serve the Gateway API Inference Extension's endpoint picker (Envoy ext_proc) on this port "
        "from router-0 (default 0: off; docs/gateway.md)",
    )
    p.add_argument(
        "--decode-tp",
        type=int,
        default=1,
        help="tensor-parallel ranks per decode instance, one process each (default 1; not with --layer-shards)",
    )
    p.add_argument(
        "--transfer",
        choices=["cpu", "two-sided"],
        default="cpu",
        help="KV transport: cpu, the one-sided host engine (default); two-sided, gloo send/recv into a "
        "staging buffer, the baseline of seed 002's experiment (never the default, loopback only)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads per model process (default: CPUs shared)")
    p.add_argument(
        "--broker",
        default="",
        metavar="HOST:PORT",
        help="attach the workers to this broker (an operator's: `pdserve operator --broker-port`) instead of "
        "starting one; the service is local/pdserve; needs --token-file (default: a broker of the run's own)",
    )
    p.add_argument(
        "--token-file",
        type=Path,
        default=None,
        help="with --broker: the service's token, as the operator's Secret <name>-broker-token holds it",
    )


def _model_flags(p: argparse._ArgumentGroup) -> None:
    """The model and how its weights are held."""
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument(
        "--engine",
        default=None,
        help="the model engine of every prefill and decode (default $PDSERVE_ENGINE, else native, also with "
        "--demo): native, "
        "pdserve's own torch engine; vllm, vLLM with pdserve's KV connector (install it with `bash "
        "scripts/setup.sh --engine vllm`; refused at once, naming what is missing, when it is not installed); "
        "an engine an installed package registers (entry point group pdserve.engines); or module:Class",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float16", "float32"],
        default="auto",
        help="compute and KV dtype (default auto: bfloat16 where the CPU has native bf16, else float32)",
    )
    p.add_argument(
        "--weights",
        choices=["auto", "dequantized", "int8", "int4"],
        default="auto",
        help="how weight matrices are held (default auto: a GGUF's Q4_0/Q4_1/Q8_0 stay quantized on the CPU)",
    )
    p.add_argument(
        "--max-len",
        type=int,
        default=None,
        help="tokens per request, prompt plus output (default 2048, or the model's context if shorter)",
    )
    p.add_argument("--layers-per-chunk", type=int, default=4, help="prefill: layers between two KV pushes (default 4)")
    p.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        default=512,
        help="colocated, or a decode's own prefill: prompt positions computed between two decode steps "
        "(chunked prefill; default 512)",
    )


def _kv_flags(p: argparse._ArgumentGroup) -> None:
    """The decode's KV pool and the prefill's prefix cache."""
    p.add_argument(
        "--slots",
        type=int,
        default=8,
        help="concurrent requests per decode worker; with max-length slots (--kv-block-tokens 0) also "
        "the KV pool: slots x max-len tokens (default 8)",
    )
    p.add_argument(
        "--kv-block-tokens",
        type=int,
        default=16,
        help="decode: KV in blocks of this many tokens, a request reserving prompt + max_tokens "
        "(default 16; 0: one max-length slot per request)",
    )
    p.add_argument(
        "--kv-tokens",
        type=int,
        default=0,
        help="decode: KV pool size in tokens with blocks (default 0: slots x max-len, the memory of slots)",
    )
    p.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=None,
        help="prefill: tokens of prompt-prefix KV kept for reuse (default: a quarter of each prefill's "
        "share of the machine's memory; 0: no prefix cache)",
    )
    p.add_argument(
        "--prefix-disk-dir",
        type=Path,
        default=None,
        help="prefill: a disk tier for the prefix cache under this folder (one subfolder per prefill, "
        "kept across restarts; default: none)",
    )
    p.add_argument(
        "--prefix-disk-gib",
        type=float,
        default=0.0,
        help="prefill: the disk tier's bound per prefill in GiB (default 0: 10 GiB; a warning at start if the disk has less free)",
    )


def _run_flags(p: argparse._ArgumentGroup) -> None:
    """Security, logs, and what the command does once the deployment serves."""
    p.add_argument(
        "--tls",
        action="store_true",
        help="make a CA for the run: mutual TLS on every gRPC hop (no plaintext gRPC port), HTTPS "
        "at the router; clients verify it with ca.crt in the log folder",
    )
    p.add_argument(
        "--api-keys",
        type=Path,
        default=None,
        metavar="FILE",
        help="require API keys on the OpenAI endpoint: a keys file (docs/admission.md), re-read when "
        "it changes (default: no authentication)",
    )
    p.add_argument("--demo", action="store_true", help=f"ask {DEMO_QUESTION!r}, show the answer and timing, stop")
    p.add_argument(
        "--on-exit",
        choices=["stop", "restart", "ignore"],
        default="stop",
        help="when a child exits while serving: stop everything (default), restart it (as a pod's "
        "restart policy would), or carry on without it (fault-injection tests)",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an extra environment variable for every child (repeatable), e.g. PDSERVE_READINESS_TIMEOUT_MS=3000",
    )
    p.add_argument(
        "--trace-file",
        type=Path,
        default=None,
        help="OpenTelemetry spans of every process as JSON lines in this file (emptied first; needs "
        "the tracing extra: pip install pdserve[tracing])",
    )
    p.add_argument("--log-dir", type=Path, default=None, help="where the children's logs go (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the deployment to serve")


def run(args: argparse.Namespace) -> int:
    from pdserve_worker.cli.local_deployment import LocalDeployment, LocalStartError, StopFlag

    try:
        plan = _plan(args)
        _check_engine(plan)
    except ValueError as exc:  # (an EngineError too)
        print(f"pdserve local: {exc}", file=sys.stderr)
        return 2
    flag = StopFlag()
    flag.install()
    deployment = LocalDeployment(plan)
    try:
        try:
            url = deployment.start(args.timeout, stop_requested=flag.is_set)
        except LocalStartError as exc:
            print(f"pdserve local: failed to start: {exc}", file=sys.stderr)
            return 1
        except FileNotFoundError as exc:
            print(f"pdserve local: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130
        shape = "colocated" if plan.colocated else f"{plan.prefill} prefill, {plan.decode} decode"
        if args.demo:
            return _demo(url, shape, deployment.verify, os.environ.get("OPENAI_API_KEY"))
        print(url, flush=True)
        ca = f" --ca {deployment.certs.ca}" if deployment.certs is not None else ""
        print(
            f"pdserve local: serving at {url}/v1 ({shape}); try:\n"
            f"  pdserve complete --url {url}{ca} --chat --stream --prompt {DEMO_QUESTION!r}\n"
            f"Ctrl-C stops it.",
            file=sys.stderr,
            flush=True,
        )
        return _watch(deployment, flag, args.on_exit)
    finally:
        deployment.stop()


def _plan(args: argparse.Namespace) -> LocalPlan:
    """The deployment the flags ask for (ValueError names a flag that cannot be served)."""
    from pdserve_worker.cli.local_plan import LocalPlan

    extra_env = _parse_env(args.env)
    if args.trace_file is not None:
        extra_env.setdefault("PDSERVE_TRACE_FILE", str(_trace_file(args.trace_file)))
    names = (
        "prefill decode port model dtype weights slots max_len threads colocated kv_block_tokens kv_tokens "
        "prefix_cache_tokens prefix_disk_dir routers prefix_disk_gib layers_per_chunk prefill_chunk_tokens layer_shards "
        "prefill_tp decode_tp epp_port transfer tls broker token_file disaggregation "
        "api_keys log_dir"
    ).split()
    engine = _engine(args.engine, extra_env)
    return LocalPlan(**{name: getattr(args, name) for name in names}, engine=engine, extra_env=extra_env)


def _engine(flag: str | None, extra_env: dict[str, str]) -> str:
    """--engine, else --env PDSERVE_ENGINE=..., else $PDSERVE_ENGINE, else native; taken out of
    extra_env, so the engine checked here is the one every worker gets."""
    from pdserve_worker.serving.settings import ENGINE

    given = extra_env.pop(ENGINE, None)
    if flag is not None and given is not None and flag != given:
        raise ValueError(f"--engine {flag} and --env {ENGINE}={given} disagree")
    return flag or given or os.environ.get(ENGINE) or "native"


def _check_engine(plan: LocalPlan) -> None:
    """Refuse, before any process starts, an engine that is not installed (engines/registry.py
    names the missing module and the set-up step that installs it) or that does not run the
    groups the flags ask for."""
    from pdserve_worker.engines.base import LAYER_SHARDS, TENSOR_PARALLEL, EngineError
    from pdserve_worker.engines.registry import check_engine, engine_type

    check_engine(plan.engine)
    needs = {TENSOR_PARALLEL: plan.prefill_tp > 1 or plan.decode_tp > 1, LAYER_SHARDS: plan.layer_shards > 1}
    missing = sorted(
        need for need, asked in needs.items() if asked and need not in engine_type(plan.engine).capabilities
    )
    if missing and not plan.colocated:
        raise EngineError(
            f"engine {plan.engine!r} does not run {', '.join(missing)} (--prefill-tp, --decode-tp, --layer-shards)"
        )


def _watch(deployment: LocalDeployment, flag: StopFlag, on_exit: str) -> int:
    """Until Ctrl-C: per --on-exit, restart a child that died, report it, or stop (exit 1)."""
    reported: set[int] = set()
    while not flag.wait(0.5):
        if on_exit == "restart":
            deployment.restart_dead()
            continue
        if on_exit == "ignore":
            deployment.report_dead(reported)
            continue
        dead = deployment.dead_child()
        if dead is not None and on_exit == "stop":
            print(
                f"pdserve local: {dead.name} (pid {dead.pid}) exited with code {dead.exited()}; "
                f"its last log lines:\n{dead.tail()}",
                file=sys.stderr,
            )
            return 1
    return 0


def _parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"--env wants NAME=VALUE, got {pair!r}")
        env[name] = value
    return env


def _demo(url: str, shape: str, verify: ssl.SSLContext | bool = True, api_key: str | None = None) -> int:
    """One streamed chat request: the answer as it arrives, then what it cost.

    With --api-keys the router wants a key: the demo sends $OPENAI_API_KEY, as `pdserve
    complete` does, and says so when the router refuses it.
    """
    from pdserve_worker.cli.client import ApiCallError, RouterClient

    print(f"pdserve local: {shape} at {url}/v1", file=sys.stderr)
    print(f"> {DEMO_QUESTION}", flush=True)
    try:
        with RouterClient(url, timeout_s=300, verify=verify, api_key=api_key) as client:
            body = {
                "model": client.served_model(),
                "messages": [{"role": "user", "content": DEMO_QUESTION}],
                "temperature": 0,
                "max_tokens": 64,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            answer = client.complete(body, chat=True, on_text=lambda t: print(t, end="", flush=True))
    except ApiCallError as exc:
        print(f"\npdserve local: the demo request failed: {exc}", file=sys.stderr)
        if exc.status == 401:
            print("pdserve local: with --api-keys, set OPENAI_API_KEY to one of the file's keys", file=sys.stderr)
        return 1
    print(flush=True)
    print(answer.stats.summary(), flush=True)
    return 0


def _trace_file(path: Path) -> Path:
    """The trace file, absolute (children run elsewhere) and empty, so it holds this run only."""
    from pdserve_common import tracing

    if not tracing.available():
        raise ValueError("--trace-file needs the tracing extra: pip install 'pdserve[tracing]'")
    path = path.resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    return path
