"""`pdserve local`: a whole PD deployment as child processes on 127.0.0.1.

A broker, decode and prefill workers and routers, the processes a Kubernetes deployment runs,
configured by the environment the operator renders into pods (cli/local_env.py) with a service
token generated for this run; or, with `colocated`, one process that prefills and decodes.

The model is converted once before any child starts, so the children only map the converted
folder. Start-up is over when the router's /health reports every worker registered and ready;
a child that dies meanwhile fails the start with its last log lines. Children run in sessions
of their own (cli/local_children.py), so a Ctrl-C reaches only this process, which stops them
in order (router, prefill, decode, broker) by PID. With `tls`, a CA is made for the run
(`util/tls_certs.py`) with one certificate for 127.0.0.1 and the address workers advertise: every
gRPC server speaks mutual TLS only and the router serves HTTPS (clients verify it with `ca.crt`,
named in `deployment.json`). With `plan.broker`, the workers attach to that broker instead of ours.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import ssl
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import httpx

from pdserve_common import inherited_sockets
from pdserve_common import pod_env as E
from pdserve_common.credentials import gateway_token
from pdserve_worker.cli.local_children import HOST, Child, accepts, child_entry, ready_members
from pdserve_worker.cli.local_env import (
    SERVICE,
    RunFacts,
    broker_env,
    certificate_hosts,
    prefix_cache_note,
    worker_env,
)
from pdserve_worker.cli.local_plan import LocalPlan
from pdserve_worker.model.loading.default_model import model_argument
from pdserve_worker.serving import settings as S
from pdserve_worker.util.tls_certs import CertFiles, write_run_certificates

STUCK_TAIL_LINES = 80  # a killed child's log end: its threads' stacks (util/stack_dump.py)
# A sharded decode group's leader drains before its followers stop (they serve its steps).
STOP_ORDER = ("router", "colocated", "prefill", "decode", "decode-member", "broker")


class LocalStartError(RuntimeError):
    """The deployment did not come up; the message names the child and carries its log tail."""


def auto_dtype() -> str:
    """bfloat16 where the CPU multiplies it natively (AVX512-BF16 or AMX), else float32.

    Without native support torch emulates bf16 matmuls, far slower than fp32 (benchmarks/README.md,
    "Model measurements behind the module docstrings"), so there fp32 is both exact and fast.
    (torch's private probes: pinned torch.)
    """
    try:
        import torch

        native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    except (ImportError, AttributeError):
        native = False
    return "bfloat16" if native else "float32"


class LocalDeployment:
    """Start with `start()`, stop with `stop()` (or use it as a context manager)."""

    def __init__(self, plan: LocalPlan, *, progress: TextIO | None = sys.stderr, python: str = sys.executable) -> None:
        self.plan = plan
        self.python = python
        self.progress = progress
        self.token = secrets.token_urlsafe(32)
        self.log_dir = Path(plan.log_dir or tempfile.mkdtemp(prefix="pdserve-local-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []
        self.broker_address = ""
        # Every port a child serves is bound here first and handed down (pdserve_common/
        # inherited_sockets.py): held for the deployment's life, so no other process takes it.
        self._held: dict[int, socket.socket] = {}
        self.port = plan.port  # the router's: bound in start() (0: any free port)
        self.url = ""
        self.certs: CertFiles | None = None
        self.dtype = auto_dtype() if plan.dtype == "auto" else plan.dtype
        self.model_folder: Path | None = None
        self.model_source = ""  # what the workers load: the GGUF itself (its quantized blocks), or the folder
        self.model_name = ""  # the served name; empty: the workers take the folder's
        self.max_len = 0  # plan.max_len, resolved against the model in start()

    # ---- starting ----------------------------------------------------------------------------

    def say(self, message: str) -> None:
        if self.progress is not None:
            print(f"pdserve local: {message}", file=self.progress, flush=True)

    def start(self, timeout_s: float = 300.0, stop_requested: Callable[[], bool] = lambda: False) -> str:
        """Start every child and wait until the router serves; returns the router's URL."""
        started = time.monotonic()
        self.port = self._hold_given(self.plan.port, "--port")
        self.url = f"{'https' if self.plan.tls else 'http'}://{HOST}:{self.port}"
        self.model_folder = self._prepare_model()
        self.max_len = self._resolve_max_len(self.model_folder)
        self._prepare_kernels()
        if self.plan.tls:
            self.certs = write_run_certificates(self.log_dir / "tls", certificate_hosts(self.plan))
            self.say(f"TLS on: clients verify the router with {self.certs.ca}")
        if self.plan.colocated:
            self._spawn("colocated", "colocated", self._worker_env("colocated", "colocated-0", self.port))
        else:
            self._start_broker()
            for i in range(self.plan.decode):
                self._spawn_decode_group(i)
            for i in range(self.plan.prefill):
                env = self._worker_env("prefill", f"prefill-{i}", self._hold())
                env[E.TENSOR_PARALLEL] = str(self.plan.prefill_tp)  # (rank 0 starts the other ranks)
                self._spawn(f"prefill-{i}", "prefill", env)
            env = self._worker_env("router", "router-0", self.port)
            if self.plan.epp_port:
                env[E.EPP_PORT_ENV] = str(self._hold_given(self.plan.epp_port, "--epp-port"))
            self._spawn("router-0", "router", env)
            for i in range(1, self.plan.routers):  # more routers of the same service (one broker)
                self._spawn(f"router-{i}", "router", self._worker_env("router", f"router-{i}", self._hold()))
            # Only now: the others import and load meanwhile (registering retries until it listens).
            self._wait_broker()
        self._write_manifest()
        self.say(f"started {len(self.children)} processes (logs in {self.log_dir}); waiting until they serve")
        self._wait_ready(started + timeout_s, stop_requested)
        self.say(f"ready in {time.monotonic() - started:.1f}s")
        return self.url

    def _prepare_model(self) -> Path:
        path = model_argument(self.plan.model)  # builtin:smollm2, the spec's name: the bundled model
        if path is not None and (Path(path) / "config.json").is_file():
            self.model_source = str(Path(path).resolve())
            return Path(path).resolve()
        self.say("preparing the model (a GGUF is converted once and cached)")
        from pdserve_worker.model.loading.convert import quantized_gguf
        from pdserve_worker.model.loading.loader import gguf_source, model_folder

        folder, name = model_folder(path, self.dtype)
        self.model_source = str(folder)
        if self.plan.weights != "dequantized":  # the workers read the quantized blocks: convert them once here
            gguf_path = gguf_source(path)
            quantized_gguf(gguf_path)
            self.model_source = S.BUILTIN_DEFAULT if path is None else str(gguf_path.resolve())
        self.model_name = name
        self.say(f"model {name} at {folder}")
        return folder

    def _prepare_kernels(self) -> None:
        """The native kernels built here, once, saying so, before the children start (each would
        wait silently on the one building them): model/layers/native.py's `prepare`."""
        from pdserve_worker.model.layers import native

        if self.plan.extra_env.get(native.ENV, os.environ.get(native.ENV, "kernel")) == "torch":
            return
        cache = self.plan.extra_env.get("PDSERVE_CACHE_DIR")
        if cache is not None and cache != os.environ.get("PDSERVE_CACHE_DIR"):
            return  # the children build in a cache of their own: building here would not help them
        native.prepare(self.say)

    def _resolve_max_len(self, folder: Path) -> int:
        """Check --max-len against the model here, once, instead of every worker dying on it."""
        from pdserve_worker.model.config import DEFAULT_MAX_LEN, ModelConfig

        config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
        try:
            max_len = config.serving_max_len(self.plan.max_len)
        except ValueError as exc:
            raise LocalStartError(f"{exc}; choose a smaller --max-len") from None
        if self.plan.max_len is None and max_len < DEFAULT_MAX_LEN:
            self.say(f"max_len {max_len}: the model's context (--max-len sets it)")
        self.say(prefix_cache_note(self.plan, config.kv_bytes_per_token(self.dtype)))
        return max_len

    def _hold(self, port: int = 0) -> int:
        """Bind `port` on HOST (0: a free one) for a child to serve; kept until stop()."""
        sock = inherited_sockets.bind_for_child(HOST, port)
        bound = int(sock.getsockname()[1])
        self._held[bound] = sock
        return bound

    def _hold_given(self, port: int, flag: str) -> int:
        try:
            return self._hold(port)
        except OSError as exc:
            raise LocalStartError(f"port {port} on {HOST} is already in use: choose another with {flag}") from exc

    def _start_broker(self) -> None:
        if self.plan.broker:  # no child: attach to that one (an operator's) with its owner's token
            self.token, self.broker_address = outside_token(self.plan.token_file), self.plan.broker
            return
        port = self._hold()
        self.broker_address = f"{HOST}:{port}"
        self._spawn("broker", "broker", broker_env(self._facts()), ["broker", "--host", HOST, "--port", str(port)])

    def _wait_broker(self) -> None:
        """Until the broker accepts: ours, or one given from outside (no child of ours then)."""
        host, port = self.broker_address.rsplit(":", 1)
        broker = next((c for c in self.children if c.role == "broker"), None)
        deadline = time.monotonic() + 60
        while not accepts(host, int(port)):
            self._check_alive()
            if time.monotonic() > deadline:
                tail = broker.tail() if broker is not None else ""
                raise LocalStartError(f"broker did not listen on {self.broker_address} within 60s\n{tail}")
            time.sleep(0.05)
        self.say(f"broker listening on {self.broker_address}")

    def _facts(self) -> RunFacts:
        return RunFacts(
            self.plan,
            self.dtype,
            self.max_len,
            self.model_source,
            self.model_name,
            self.broker_address,
            self.token,
            self.certs,
        )

    def _worker_env(self, role: str, worker_id: str, http_port: int) -> dict[str, str]:
        return worker_env(self._facts(), role, worker_id, http_port, self._hold)

    def _spawn_decode_group(self, index: int) -> None:
        """One decode instance: a process, or a leader and its followers that know each other's
        gRPC endpoints (what a pod derives from the StatefulSet's DNS names)."""
        shards = self.plan.layer_shards
        if shards == 1:
            env = self._worker_env("decode", f"decode-{index}", self._hold())
            env[E.TENSOR_PARALLEL] = str(self.plan.decode_tp)  # (rank 0 starts the other ranks)
            self._spawn(f"decode-{index}", "decode", env)
            return
        envs = [self._worker_env("decode", f"decode-{index}-{m}", self._hold()) for m in range(shards)]
        peers = ",".join(f"{HOST}:{env[E.GRPC_PORT_ENV]}" for env in envs)
        for member, env in enumerate(envs):
            env.update({E.LAYER_SHARDS: str(shards), S.SHARD_INDEX: str(member), S.GROUP_PEERS: peers})
            role = "decode" if member == 0 else "decode-member"
            self._spawn(f"decode-{index}-{member}", role, env)

    def _spawn(self, name: str, role: str, env: dict[str, str], args: list[str] | None = None) -> Child:
        argv = [self.python, "-m", "pdserve_worker.cli.main", *(args or ["worker"])]
        # The sockets of the ports this child serves: those its env or arguments name.
        named = {v for k, v in env.items() if k.endswith("_PORT")} | set(args or [])
        sockets = [s for port, s in self._held.items() if str(port) in named]
        env = {**env, inherited_sockets.LISTEN_FDS_ENV: inherited_sockets.env_value(sockets)}
        child = Child(name, role, argv, env, self.log_dir / f"{name}.log", fds=tuple(s.fileno() for s in sockets))
        child.start()
        self.children.append(child)
        return child

    def _wait_ready(self, deadline: float, stop_requested: Callable[[], bool]) -> None:
        want = {"colocated": 1} if self.plan.colocated else {"prefill": self.plan.prefill, "decode": self.plan.decode}
        last = None
        with httpx.Client(timeout=2.0, verify=self.verify) as http:
            while True:
                self._check_alive()
                if stop_requested():
                    raise KeyboardInterrupt
                members = ready_members(http, self.url)
                if members is not None and members != last:
                    self.say("ready members: " + ", ".join(f"{r} {members.get(r, 0)}/{n}" for r, n in want.items()))
                    last = members
                if members is not None and all(members.get(r, 0) >= n for r, n in want.items()):
                    return
                if time.monotonic() > deadline:
                    raise LocalStartError(f"not ready in time (ready: {members}); logs in {self.log_dir}")
                time.sleep(0.2)

    def _write_manifest(self) -> None:
        """`deployment.json` (who runs where) and `service-token` (0600) in the log folder, so
        that tools and tests can reach the broker and workers, or attach a worker of their own;
        with --epp-port also `gateway-token` (0600), what a gateway presents to the picker."""
        token_file = self.log_dir / "service-token"
        token_file.touch(mode=0o600)
        token_file.write_text(self.token)
        gateway_file = self.log_dir / "gateway-token"
        if self.plan.epp_port:
            gateway_file.touch(mode=0o600)
            gateway_file.write_text(gateway_token(self.token))
        manifest = {
            "url": self.url,
            "routers": [
                f"{'https' if self.certs is not None else 'http'}://{HOST}:{c.env[E.HTTP_PORT_ENV]}"
                for c in self.children
                if c.role in ("router", "colocated")  # the processes that serve the API
            ],
            "service": SERVICE,
            "broker": self.broker_address,
            "dtype": self.dtype,
            "weights": self.plan.weights,
            "token_file": str(token_file),
            "gateway_token_file": str(gateway_file) if self.plan.epp_port else None,
            "ca_file": None if self.certs is None else str(self.certs.ca),
            "children": [child_entry(c) for c in self.children],
        }
        (self.log_dir / "deployment.json").write_text(json.dumps(manifest, indent=2))

    def _check_alive(self) -> None:
        for child in self.children:
            code = child.exited()
            if code is not None:
                raise LocalStartError(
                    f"{child.name} (pid {child.pid}) exited with code {code}; its last log lines "
                    f"({child.log_path}):\n{child.tail()}"
                )

    @property
    def verify(self) -> ssl.SSLContext | bool:
        """What an HTTP client verifies the router with: the run's CA, or the system's."""
        return ssl.create_default_context(cafile=str(self.certs.ca)) if self.certs is not None else True

    # ---- running and stopping ------------------------------------------------------------------

    def dead_child(self) -> Child | None:
        return next((c for c in self.children if c.exited() is not None), None)

    def report_dead(self, reported: set[int]) -> list[Child]:
        """Say once per exited child (PIDs in `reported` were said already) that it stays down:
        `--on-exit ignore` carries on without it, but not silently."""
        dead = [c for c in self.children if c.exited() is not None and c.pid not in reported]
        for child in dead:
            reported.add(child.pid)
            self.say(
                f"{child.name} (pid {child.pid}) exited with code {child.exited()}; carrying on without it "
                f"(--on-exit ignore)"
            )
        return dead

    def restart_dead(self) -> list[Child]:
        """Start again every child that exited, with its own ports (the same listening sockets:
        connections that arrived meanwhile wait in their backlog) and environment, as a pod's
        restart policy would; `deployment.json` then has the new PIDs. Returns the restarted."""
        dead = [c for c in self.children if c.exited() is not None]
        for child in dead:
            self.say(f"{child.name} (pid {child.pid}) exited with code {child.exited()}; restarting it")
            child.start()
        if dead:
            self._write_manifest()
        return dead

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop every child, front to back (router first, broker last), each by its PID."""
        for role in STOP_ORDER:
            group = [c for c in self.children if c.role == role]
            for child in group:  # signal the whole tier at once, then wait for it
                if child.proc is not None and child.proc.poll() is None:
                    child.proc.send_signal(signal.SIGTERM)
            for child in group:
                if child.stop(timeout_s):
                    self.say(
                        f"{child.name} (pid {child.pid}) did not stop within {timeout_s:g}s: killed; "
                        f"where it waited (its log's end, {child.log_path}):\n{child.tail(STUCK_TAIL_LINES)}"
                    )
        for sock in self._held.values():  # the ports go back only now: every child is gone
            sock.close()
        self._held.clear()
        if self.children:
            self.say("stopped")

    def __enter__(self) -> LocalDeployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def outside_token(token_file: Path | None) -> str:
    """The service token of an outside broker's service, issued by its owner: a file, as a pod
    mounts the operator's Secret."""
    if token_file is None:
        raise LocalStartError("--broker needs --token-file: the service token the broker's owner issued")
    token = Path(token_file).read_text().strip()
    if not token:
        raise LocalStartError(f"--token-file {token_file} is empty: no service token")
    return token


class StopFlag:
    """SIGINT/SIGTERM set a flag instead of raising, so stopping follows one path."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signal: int | None = None

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        self.signal = signum
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout_s: float) -> bool:
        return self._event.wait(timeout_s)
