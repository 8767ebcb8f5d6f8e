"""The environment each child of `pdserve local` gets: the variables the operator renders into
a pod (pdserve_common/pod_env.py), with this checkout's sources importable and each port it
serves bound by the parent (`hold`) and handed down."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pdserve_common import pod_env as E
from pdserve_common.credentials import member_credential, pod_env
from pdserve_common.grpc_front import PER_PEER_ENV
from pdserve_worker.cli.local_children import HOST
from pdserve_worker.cli.local_plan import LocalPlan
from pdserve_worker.serving import settings as S
from pdserve_worker.util.free_ports import free_port
from pdserve_worker.util.tls_certs import CertFiles, tls_env

SERVICE = "local/pdserve"


@dataclass(frozen=True)
class RunFacts:
    """What a run resolved before its children start: the plan plus the model, dtype and
    max_len chosen, the broker's address, the service token and the run's certificates."""

    plan: LocalPlan
    dtype: str
    max_len: int
    model_source: str
    model_name: str
    broker_address: str
    token: str
    certs: CertFiles | None


def certificate_hosts(plan: LocalPlan) -> tuple[str, ...]:
    """The hosts the run's certificate names: where children listen and are dialled (127.0.0.1,
    localhost), and the address the workers advertise if `--env PDSERVE_POD_IP=...` sets another
    (peers dial that one: a proxy in front of the workers, as the soak's fault proxy on 127.0.0.2)."""
    hosts = [HOST, "localhost"]
    advertised = plan.extra_env.get(E.POD_IP, "").strip()
    if advertised and advertised not in hosts:
        hosts.append(advertised)
    return tuple(hosts)


def source_env() -> dict[str, str]:
    """The environment children inherit, with this checkout's sources importable."""
    env = dict(os.environ)
    import pdserve_worker

    roots = [str(Path(pdserve_worker.__file__).resolve().parents[1])]
    try:
        import pdserve_operator

        roots.append(str(Path(pdserve_operator.__file__).resolve().parents[1]))
    except ImportError:
        pass
    try:
        import pdserve.v1 as protos

        roots.append(str(Path(protos.__file__).resolve().parents[2]))
    except ImportError:
        pass
    existing = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(roots + existing))
    return env


def grpc_per_peer(plan: LocalPlan) -> int:
    """Each gRPC port's share for one source address in this run (PDSERVE_GRPC_MAX_CONNECTIONS_PER_PEER):
    every process of the run connects from 127.0.0.1, which a pod's default share (a sixty-fourth,
    grpc_front.py) is not sized for, so four channels per process, at least 16."""
    return max(16, 4 * (plan.routers + plan.model_processes))


def _share_env(env: dict[str, str], plan: LocalPlan) -> None:
    if PER_PEER_ENV not in env:  # the user's own setting wins
        env[PER_PEER_ENV] = str(grpc_per_peer(plan))


def broker_env(run: RunFacts) -> dict[str, str]:
    """`pdserve broker`'s environment: the service token, and mutual TLS when the run has certificates."""
    env = source_env()
    env["PDSERVE_BROKER_TOKENS"] = json.dumps({SERVICE: run.token})
    if run.certs is not None:  # `pdserve broker` reads PDSERVE_TLS_CERT/_KEY/_CA: mutual TLS
        env.update(tls_env(run.certs, broker_tls=False))
    _share_env(env, run.plan)
    env.update(run.plan.extra_env)
    return env


def worker_env(run: RunFacts, role: str, worker_id: str, http_port: int, hold: Callable[[], int]) -> dict[str, str]:
    """A worker's environment (`role`: prefill, decode, router or colocated), as its pod's."""
    plan = run.plan
    env = source_env()
    env.update(
        {
            E.ROLE: role,
            E.SERVICE: SERVICE,
            E.POD_NAME: worker_id,
            E.POD_IP: HOST,
            S.BIND_HOST: HOST,
            E.HTTP_PORT_ENV: str(http_port),
            E.GRPC_PORT_ENV: str(hold()),
            E.ADMIN_PORT_ENV: str(hold()),
            E.PROBE_PORT_ENV: str(hold()),  # /healthz and /readyz alone, as in a pod
            # The host engine serves its port from the socket handed down; two-sided (gloo) binds its own.
            S.TRANSFER_PORT_ENV: str(hold() if plan.transfer == "cpu" else free_port()),
            E.ENGINE: plan.engine,  # every worker's, as a pod's (the router loads no model)
            E.MODEL_SOURCE: run.model_source,
            E.MODEL_DTYPE: run.dtype,
            S.WEIGHTS: plan.weights,
            E.MAX_LENGTH: str(run.max_len),
            E.SLOTS: str(plan.slots),
            E.KV_BLOCK_TOKENS: str(plan.kv_block_tokens),
            E.KV_TOKENS: str(plan.kv_tokens),
            E.PREFIX_CACHE_TOKENS: "auto" if plan.prefix_cache_tokens is None else str(plan.prefix_cache_tokens),
            S.MEMORY_SHARE: repr(plan.memory_share()),
            E.LAYERS_PER_CHUNK: str(plan.layers_per_chunk),
            S.PREFILL_CHUNK_TOKENS: str(plan.prefill_chunk_tokens),
            E.READINESS_MODE: plan.readiness,
            E.DISAGGREGATION: plan.disaggregation,  # (the router's; router/disaggregation.py)
            E.TRANSFER_BACKEND: plan.transfer,
            E.DRAIN_TIMEOUT_SECONDS: "10",
            S.THREADS: str(plan.threads_per_process()),
            S.GRACE_S: "5",
        }
    )
    if run.model_name:
        env[E.MODEL_NAME] = run.model_name
    if plan.prefix_disk_dir is not None and role in ("prefill", "colocated"):
        # Its own folder: a restarted prefill finds its blocks, two prefills never share an index.
        env[E.PREFIX_DISK_DIR] = str(Path(plan.prefix_disk_dir).resolve() / worker_id)
        env[E.PREFIX_DISK_BYTES] = str(int(plan.prefix_disk_gib * 2**30))
    if role != "colocated":
        env[E.BROKER_ADDRESS] = run.broker_address
        # Its role's part of the service's credentials, as a pod gets it: never the service
        # token (pdserve_common/credentials.py).
        env.update(pod_env(run.token, role))
        # And its own member credential, bound to its id (issue #58 A4), as the operator's are.
        env[E.MEMBER_CREDENTIAL] = member_credential(run.token, role, worker_id)
    if run.certs is not None:
        env.update(tls_env(run.certs, broker_tls=role != "colocated"))
    if plan.api_keys is not None and role in ("router", "colocated"):
        env[E.API_KEYS_FILE] = str(Path(plan.api_keys).resolve())
    _share_env(env, plan)
    env.update(plan.extra_env)
    return env


def prefix_cache_note(plan: LocalPlan, kv_bytes_per_token: int) -> str:
    """What each prefill (or the colocated process) will keep of prompt prefixes."""
    if plan.prefix_cache_tokens == 0:
        return "prefix cache off (--prefix-cache-tokens 0)"
    if plan.prefix_cache_tokens is not None:
        return f"prefix cache: {plan.prefix_cache_tokens} tokens per prefill (--prefix-cache-tokens)"
    from pdserve_worker.kv.memory_budget import PREFIX_CACHE_FRACTION, auto_prefix_tokens, memory_limit

    limit, share = memory_limit(), plan.memory_share()
    block = S.WorkerSettings.model_fields["prefix_block_tokens"].default
    tokens = auto_prefix_tokens(limit.bytes, share, kv_bytes_per_token, block)
    return (
        f"prefix cache: up to {tokens} tokens per prefill ({PREFIX_CACHE_FRACTION:.0%} of its 1/"
        f"{plan.model_processes} share of {limit.bytes / 2**30:.1f} GiB, {limit.source}; "
        "--prefix-cache-tokens sets it, 0 turns it off)"
    )
