"""`pdserve worker --role prefill|decode|router|colocated`: one worker process.

In a pod every setting comes from the environment the operator renders (pod_env.py); the
flags here override it for local runs. The broker token is read from $PDSERVE_BROKER_TOKEN
or `--broker-token-file`, never from a flag (command lines are visible to every user of the
host). Exits 0 after a clean stop (SIGTERM/SIGINT), 1 when the worker could not start, 2 on
invalid settings.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pdserve_worker.transfer.registry import NAMES

# flag dest -> WorkerSettings field (flags left unset do not override the environment)
_FLAG_FIELDS = {
    "role": "role",
    "service": "service",
    "broker": "broker_address",
    "worker_id": "worker_id",
    "host": "bind_host",
    "advertise_host": "advertise_host",
    "http_port": "http_port",
    "grpc_port": "grpc_port",
    "transfer_port": "transfer_port",
    "model": "model_source",
    "engine": "engine",
    "model_name": "model_name",
    "dtype": "model_dtype",
    "weights": "weights",
    "max_len": "max_length",
    "device": "device",
    "threads": "threads",
    "transfer_backend": "transfer_backend",
    "slots": "slots",
    "kv_block_tokens": "kv_block_tokens",
    "kv_tokens": "kv_tokens",
    "prefix_cache_tokens": "prefix_cache_tokens",
    "prefix_disk_dir": "prefix_disk_dir",
    "prefix_disk_bytes": "prefix_disk_bytes",
    "layers_per_chunk": "layers_per_chunk",
    "readiness": "readiness_mode",
    "drain_timeout": "drain_timeout_seconds",
    "layer_shards": "layer_shards",
    "shard_index": "shard_index",
    "group_peers": "group_peers",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="run one worker: prefill, decode, router (or colocated)")
    # A flag left out falls back to the environment the operator sets (serving/settings.py).
    _membership_flags(p.add_argument_group("membership"))
    _model_flags(p.add_argument_group("model"))
    _kv_flags(p.add_argument_group("kv"))
    _decode_flags(p.add_argument_group("decode"))
    p.set_defaults(func=run)


def _membership_flags(p: argparse._ArgumentGroup) -> None:
    """Who the worker is, where it listens, and how it reaches the broker and its peers."""
    p.add_argument(
        "--role",
        choices=["prefill", "decode", "router", "colocated"],
        default=None,
        help="the worker's role (else $PDSERVE_ROLE)",
    )
    p.add_argument("--service", default=None, help="service key namespace/name (else $PDSERVE_SERVICE)")
    p.add_argument("--broker", default=None, help="broker host:port (else $PDSERVE_BROKER_ADDRESS)")
    p.add_argument(
        "--broker-token-file",
        type=Path,
        default=None,
        help="file holding the service's broker token (else $PDSERVE_BROKER_TOKEN)",
    )
    p.add_argument("--worker-id", default=None, help="member id in the service (else $PDSERVE_POD_NAME)")
    p.add_argument("--host", default=None, help="address to listen on (default 0.0.0.0)")
    p.add_argument("--advertise-host", default=None, help="address peers reach us at (else $PDSERVE_POD_IP)")
    p.add_argument("--http-port", type=int, default=None)
    p.add_argument("--grpc-port", type=int, default=None)
    p.add_argument("--transfer-port", type=int, default=None, help="the transfer engine's port")
    p.add_argument("--transfer-backend", choices=NAMES, default=None)


def _model_flags(p: argparse._ArgumentGroup) -> None:
    """The model and where it runs."""
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: the bundled SmolLM2)")
    p.add_argument(
        "--engine",
        default=None,
        help="the model engine (else $PDSERVE_ENGINE; default native): native, pdserve's own torch engine; "
        "vllm, vLLM with pdserve's KV connector (install it with `bash scripts/setup.sh --engine vllm`); "
        "or module:Class of an engine outside pdserve",
    )
    p.add_argument("--model-name", default=None, help="name the API serves the model under")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None)
    p.add_argument(
        "--weights",
        choices=["auto", "dequantized", "int8", "int4"],
        default=None,
        help="how weight matrices are held (else $PDSERVE_WEIGHTS; default auto: a GGUF's Q4_0/Q4_1/Q8_0 "
        "stay quantized on the CPU)",
    )
    p.add_argument("--max-len", type=int, default=None, help="tokens per request, prompt plus output")
    p.add_argument("--device", choices=["cpu", "cuda", "npu"], default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (0: all this process may use)")


def _kv_flags(p: argparse._ArgumentGroup) -> None:
    """The KV pool (decode) and the prefix cache (prefill)."""
    p.add_argument(
        "--slots", type=int, default=None, help="decode: concurrent requests (and, without blocks, KV slots)"
    )
    p.add_argument(
        "--kv-block-tokens", type=int, default=None, help="decode: tokens per KV block (0: max-length slots)"
    )
    p.add_argument("--kv-tokens", type=int, default=None, help="decode: KV pool in tokens (0: slots x max-len)")
    p.add_argument(
        "--prefix-cache-tokens", type=int, default=None, help="prefill: prefix cache in tokens (default: auto; 0: off)"
    )
    p.add_argument("--prefix-disk-dir", default=None, help="prefill: folder of the prefix cache's disk tier")
    p.add_argument("--prefix-disk-bytes", type=int, default=None, help="prefill: the disk tier's bound (0: default)")
    p.add_argument("--layers-per-chunk", type=int, default=None, help="prefill: layers between two KV pushes")


def _decode_flags(p: argparse._ArgumentGroup) -> None:
    """A decode's readiness, drain and layer-sharded group."""
    p.add_argument("--readiness", choices=["interrupt", "poll", "spin"], default=None, help="decode: readiness mode")
    p.add_argument("--drain-timeout", type=float, default=None, help="decode: seconds /drain may wait")
    p.add_argument("--layer-shards", type=int, default=None, help="decode: processes in this worker's group")
    p.add_argument(
        "--shard-index",
        type=int,
        default=None,
        help="decode: this worker's member index in its group (else from the pod ordinal)",
    )
    p.add_argument(
        "--group-peers",
        default=None,
        help="decode: gRPC host:port of members 0..N-1, comma-separated (else from the headless Service)",
    )


def settings_from_args(args: argparse.Namespace):
    """WorkerSettings from the environment with the given flags on top (ValidationError if invalid)."""
    from pdserve_worker.serving.settings import WorkerSettings

    overrides = {field: getattr(args, flag) for flag, field in _FLAG_FIELDS.items() if getattr(args, flag) is not None}
    if args.broker_token_file is not None:
        overrides["broker_token"] = args.broker_token_file.read_text().strip()
    return WorkerSettings(**overrides)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from pydantic import ValidationError

    from pdserve_common import logs
    from pdserve_worker.process.worker_main import run_worker

    try:
        settings = settings_from_args(args)
    except (ValidationError, OSError) as exc:
        print(f"pdserve worker: invalid settings: {exc}", file=sys.stderr)
        return 2
    logs.setup(f"{settings.role}:{settings.member_id}")
    return asyncio.run(run_worker(settings))
