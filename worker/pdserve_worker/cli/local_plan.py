"""What `pdserve local` starts: the plan of a local deployment, checked when it is made."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class LocalPlan:
    prefill: int = 1
    decode: int = 2
    port: int = 8000
    model: str | None = None  # GGUF or HF folder; None: the bundled default
    dtype: str = "auto"  # auto: see auto_dtype()
    weights: str = "auto"  # model/layers/weight_routes.py
    slots: int = 8
    max_len: int | None = None  # tokens per request; None: 2048, or the model's context if shorter
    kv_block_tokens: int = 16  # decode KV blocks (0: max-length slots)
    kv_tokens: int = 0  # decode KV pool in tokens (0: slots x max_len)
    prefix_cache_tokens: int | None = None  # prefill prefix cache in tokens (None: auto, a memory share; 0: off)
    prefix_disk_dir: Path | None = None  # the prefix cache's disk tier: one subfolder per prefill (None: none)
    prefix_disk_gib: float = 0.0  # its bound per prefill (0: 10 GiB)
    routers: int = 1  # router processes (the first on `port`, the others on free ports: deployment.json)
    threads: int = 0  # torch threads per model process; 0: the CPUs shared among them
    colocated: bool = False
    layers_per_chunk: int = 4
    prefill_chunk_tokens: int = 512  # colocated, or a decode's local prefill: prompt positions between two decode steps
    disaggregation: str = "auto"  # the router's: always | never | auto (router/disaggregation.py)
    layer_shards: int = 1  # processes per decode group (a leader and layer_shards - 1 followers)
    prefill_tp: int = 1  # tensor-parallel ranks per prefill instance (rank 0 starts the others)
    decode_tp: int = 1  # the same per decode instance
    epp_port: int = 0  # router-0's endpoint picker (gateway/ext_proc.py); 0: none
    readiness: str = "interrupt"
    engine: str = "native"  # the model engine of every worker (engines/registry.py): native, vllm, module:Class
    # KV transport: the host engine ("cpu", one-sided), or "two-sided", the gloo send/recv
    # baseline of seed 002's experiment (transfer/backends/two_sided.py; never the default).
    transfer: str = "cpu"
    tls: bool = False  # a CA for the run; mutual TLS on every gRPC hop, HTTPS at the router
    api_keys: Path | None = None  # keys file (api/keys.py) the router requires; None: no authentication
    # A broker already running (an operator's) to attach the workers to, with the service token
    # from `token_file` (the operator's Secret); "": start a broker of our own with a new token.
    broker: str = ""
    token_file: Path | None = None
    log_dir: Path | None = None
    extra_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.weights not in ("auto", "dequantized", "int8", "int4"):
            raise ValueError(f"weights must be auto, dequantized, int8 or int4, got {self.weights!r}")
        if self.disaggregation not in ("always", "never", "auto"):
            raise ValueError(f"disaggregation must be always, never or auto, got {self.disaggregation!r}")
        if self.transfer not in ("cpu", "two-sided"):
            raise ValueError(f"transfer must be cpu or two-sided, got {self.transfer!r}")
        if (self.broker == "") != (self.token_file is None):
            raise ValueError(f"--broker and --token-file go together, got {self.broker!r} and {self.token_file}")
        if self.broker and (self.tls or self.colocated):
            raise ValueError(
                f"--broker {self.broker} is plaintext gRPC with PD workers: not with --tls nor --colocated"
            )
        if self.colocated:
            return
        if self.routers < 1:
            raise ValueError(f"a PD deployment needs at least 1 router, got {self.routers}")
        if self.prefill < 1 or self.decode < 1:
            raise ValueError(f"a PD deployment needs at least 1 prefill and 1 decode, got {self.prefill}/{self.decode}")
        if self.layer_shards < 1:
            raise ValueError(f"layer_shards must be >= 1, got {self.layer_shards}")
        if self.prefill_tp < 1 or self.decode_tp < 1:
            raise ValueError(f"prefill_tp and decode_tp must be >= 1, got {self.prefill_tp}/{self.decode_tp}")
        if self.decode_tp > 1 and self.layer_shards > 1:
            raise ValueError("a decode is tensor-parallel (--decode-tp) or layer-sharded (--layer-shards), not both")
        if self.decode_tp > 1 and not self.kv_block_tokens:
            raise ValueError("--decode-tp needs a paged KV pool: --kv-block-tokens > 0")

    @property
    def model_processes(self) -> int:
        return (
            1 if self.colocated else self.prefill * self.prefill_tp + self.decode * self.layer_shards * self.decode_tp
        )

    def memory_share(self) -> float:
        """The part of the machine's memory each model process may size its caches from."""
        return 1.0 / self.model_processes

    def threads_per_process(self) -> int:
        if self.threads:
            return self.threads
        return max(1, len(os.sched_getaffinity(0)) // self.model_processes)
