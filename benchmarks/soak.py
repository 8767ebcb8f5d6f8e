"""Soak: requests through `pdserve local` while random faults hit its processes and links.

    PYTHONPATH=worker:operator:common:proto:tests python benchmarks/soak.py --requests 60 --seconds 120
    ... --links proxied --fault-every 2   # network faults too, at twice the default rate
    ... --operator real --fault-every 2   # the real operator (kopf, API emulator) killed too
    ... --tls --links proxied             # mutual TLS on every gRPC hop, through the fault proxy

Starts broker, 2 decode, 2 prefill and a router (a tiny random-weight model unless --model)
with `--on-exit restart`, records each prompt's undisturbed greedy answer, then streams
`--requests` requests (`--concurrency` at a time; a 429 is retried after its Retry-After, as
the OpenAI client does) while every `--fault-every` seconds one random fault is injected: a
decode or a prefill killed (SIGKILL, by PID), a prefill frozen for a few seconds
(SIGSTOP/SIGCONT), or the broker (the operator's part in a cluster) killed. Bounded by `--seconds`.

With `--operator real` there is no broker of `pdserve local`'s own: `pdserve operator` runs as a
process against the API emulator and its broker serves the workers (`pdserve local --broker`,
benchmarks/soak_operator.py); the broker fault is then a SIGKILL of the operator process, started
again at once as its container would be. With `--tls` every gRPC hop is mutual TLS and the
router HTTPS; the run's certificate also names the advertised 127.0.0.2, so it works proxied.

With `--links proxied` every worker advertises 127.0.0.2 (`--env PDSERVE_POD_IP`) while it
listens on 127.0.0.1, and a fault-injecting proxy (tests/support/fault_proxy.py) on 127.0.0.2
forwards each of its gRPC and KV-transfer ports: every router → prefill, router → decode,
prefill → decode (KV and notifications) and decode → decode (migration) connection crosses it.
The faults then also include, for all links into one worker: a delay (200 ms a chunk for 4 s;
what loss looks like under TCP), a stall (2-6 s of silence that then heals: a partition), and
a reset of every open connection (RST). With `--links netns` (root, iproute2) each worker's
links also cross a veth pair of its own into a network namespace of the soak's and back
(tests/support/netns_links.py), and one more fault cuts that pair for 2-6 s: a real partition,
the kernel dropping both legs' packets until the link is set up again.

Prints requests completed / failed / retried, every error code met (retried ones too), answers
that differ from the undisturbed run, tokens lost (must be 0) and decode slots leaked once
everything settled (must be 0); exits 1 if any is not 0. The baseline is the same
deployment's undisturbed answers, in the same run.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import random
import signal
import ssl
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from pdserve.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402
from support.fault_proxy import FaultProxy  # noqa: E402
from support.local_run import LocalRun, pid_alive  # noqa: E402  (the tests' way of running `pdserve local`)
from support.netns_links import NetnsLinks  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from soak_operator import RealOperator  # noqa: E402

ADVERTISED = "127.0.0.2"  # --links proxied: what workers advertise; the proxy listens there

PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of",
    "A language model predicts",
    "Berlin is",
    "Numbers like 12345 and",
    "Unicode text: café, naïve,",
]


@dataclass
class Answer:
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    retries: int = 0
    error: str | None = None
    retry_after_s: float = 1.0
    codes: list[str] = field(default_factory=list)  # every error met, the retried ones too


@dataclass
class Tally:
    completed: int = 0
    failed: int = 0
    retried: int = 0
    differing: int = 0
    tokens_lost: int = 0
    codes: collections.Counter[str] = field(default_factory=collections.Counter)
    errors: list[str] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    operator_back_s: list[float] = field(default_factory=list)  # kill → every worker at the new broker


@dataclass(frozen=True)
class Shape:
    """What the soaked deployment is: its KV, its links, TLS, and who brokers."""

    slots: int = 4
    max_len: int = 256
    links: str = "direct"  # direct, proxied or netns
    tls: bool = False
    operator: str = "local"  # local: `pdserve local`'s broker; real: the operator process


class Deployment:
    """`pdserve local` as the tests run it (tests/support/local_run.py), plus the faults' handles."""

    def __init__(self, model: str, log_dir: Path, shape: Shape) -> None:
        proxied = shape.links != "direct"
        links = ["--env", f"PDSERVE_POD_IP={ADVERTISED}"] if proxied else []
        self.operator = RealOperator(log_dir, prefill=2, decode=2) if shape.operator == "real" else None
        attach = [] if self.operator is None else ["--broker", self.operator.address]
        attach += [] if self.operator is None else ["--token-file", str(self.operator.token_file)]
        try:
            self.run = LocalRun.start(
                log_dir,
                "--model",
                model,
                "--dtype",
                "float32",
                "--prefill",
                "2",
                "--decode",
                "2",
                "--slots",
                str(shape.slots),
                "--max-len",
                str(shape.max_len),
                "--layers-per-chunk",
                "1",
                "--port",
                "0",
                "--threads",
                "1",
                "--on-exit",
                "restart",
                "--env",
                "PDSERVE_READINESS_TIMEOUT_MS=3000",
                "--env",
                "PDSERVE_TRANSFER_TIMEOUT_MS=2000",
                *links,
                *attach,
                *(["--tls"] if shape.tls else []),
            )
        except BaseException:  # the operator and the emulator go too: nothing else would stop them
            if self.operator is not None:
                self.operator.close()
            raise
        self.netns: NetnsLinks | None = None
        self.proxy = self._proxy_links(shape.links == "netns") if proxied else None
        self.url = self.run.url
        ca = self.run.manifest["ca_file"]
        self.verify: ssl.SSLContext | bool = True if ca is None else ssl.create_default_context(cafile=ca)
        self.grpc_credentials = None if ca is None else _grpc_credentials(Path(ca).parent)
        self.model = httpx.get(f"{self.url}/v1/models", timeout=5, verify=self.verify).json()["data"][0]["id"]
        self.seen_pids: set[int] = set()

    def _proxy_links(self, netns: bool) -> FaultProxy:
        """Each worker's gRPC and transfer port, listened on at the advertised address and
        forwarded to where the worker really listens (with `netns`, across its veth pair); a
        group per worker."""
        proxy = FaultProxy()
        self.netns = NetnsLinks(proxy) if netns else None
        for c in self.run.manifest["children"]:
            ports = [int(c[key].rsplit(":", 1)[1]) for key in ("grpc", "transfer") if c.get(key)]
            if c["role"] not in ("prefill", "decode"):
                continue
            if self.netns is not None:
                self.netns.add(c["name"], ports, ADVERTISED)
            for port in [] if self.netns is not None else ports:
                proxy.link(c["name"], (ADVERTISED, port), ("127.0.0.1", port))
        if self.netns is not None:
            self.netns.start()
        return proxy

    def child(self, name: str) -> dict:
        return self.run.child(name)

    def signal(self, name: str, sig: int) -> None:
        pid = self.child(name)["pid"]
        self.seen_pids.add(pid)
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def decode_status(self, name: str) -> worker_pb2.DecodeStatus | None:
        address = self.child(name)["grpc"]
        if self.grpc_credentials is None:
            channel = grpc.insecure_channel(address)
        else:
            channel = grpc.secure_channel(address, self.grpc_credentials)
        with channel:
            try:
                return worker_pb2_grpc.DecodeStub(channel).Status(
                    worker_pb2.StatusRequest(), metadata=(("authorization", f"Bearer {self.run.token}"),), timeout=2
                )
            except grpc.RpcError:
                return None

    def healthy(self) -> bool:
        """Every worker serves, and (real operator) the operator's broker has them all again."""
        want = {"prefill": 2, "decode": 2}
        try:
            members = httpx.get(f"{self.url}/health", timeout=2, verify=self.verify).json()["members"]
        except (httpx.HTTPError, KeyError, ValueError):
            return False
        return members == want and (self.operator is None or self.operator.serving(want))

    def kill_operator(self, stop: threading.Event, timeout_s: float = 60.0) -> float | None:
        """SIGKILL the operator, start it again; seconds until its broker has every worker back
        (None: not within `timeout_s`, or the soak stopped first)."""
        assert self.operator is not None
        killed = time.monotonic()
        self.seen_pids.add(self.operator.kill_and_restart())
        while time.monotonic() - killed < timeout_s and not stop.wait(0.1):
            if self.operator.serving({"prefill": 2, "decode": 2}):
                return time.monotonic() - killed
        return None

    def stop(self) -> list[int]:
        """Stop; returns the PIDs of children still alive afterwards (must be none)."""
        self.seen_pids.update(c["pid"] for c in self.run.manifest["children"])
        self.run.stop(90)
        if self.netns is not None:
            self.netns.close()
        if self.proxy is not None:
            self.proxy.close()
        if self.operator is not None:
            self.seen_pids.update(self.operator.pids)
            self.operator.close()
        return [pid for pid in self.seen_pids if pid_alive(pid)]


def _grpc_credentials(folder: Path) -> grpc.ChannelCredentials:
    """A client's side of the run's mutual TLS (`pdserve local --tls`: ca.crt, tls.crt, tls.key)."""
    return grpc.ssl_channel_credentials(
        root_certificates=(folder / "ca.crt").read_bytes(),
        private_key=(folder / "tls.key").read_bytes(),
        certificate_chain=(folder / "tls.crt").read_bytes(),
    )


SDK_RETRIES = 2  # the openai SDK's default max_retries for 408/409/5xx (and connection errors)


def complete(d: Deployment, prompt: str, max_tokens: int, tries: int = 8) -> Answer:
    """One request as the OpenAI client sends it: a 429 is retried after its Retry-After (up to
    `tries` times); a 5xx or a connection error that came before any token is retried at most
    SDK_RETRIES times after the SDK's backoff (0.5 s, doubling). A failure midway through a
    stream is not retried: the client already has part of the answer."""
    codes: list[str] = []
    server_errors = 0
    for attempt in range(tries):
        answer = _complete_once(d, prompt, max_tokens)
        codes += answer.codes
        error = answer.error or ""
        if error.startswith("HTTP 429") and attempt < tries - 1:
            time.sleep(answer.retry_after_s)
            continue
        retryable = error.startswith("HTTP 5") or (error and not answer.text and not error.startswith("HTTP 4"))
        if retryable and server_errors < SDK_RETRIES:
            time.sleep(0.5 * 2**server_errors)
            server_errors += 1
            continue
        break
    answer.codes = codes
    answer.retries += server_errors
    return answer


def error_code(status: int | None, body: object) -> str:
    """What a client would branch on: the HTTP status and the OpenAI error's code (or type)."""
    error = body.get("error") if isinstance(body, dict) else None
    code = (error.get("code") or error.get("type")) if isinstance(error, dict) else None
    return " ".join(str(x) for x in (f"HTTP {status}" if status else "in-stream", code) if x)


def _complete_once(d: Deployment, prompt: str, max_tokens: int) -> Answer:
    body = {
        "model": d.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    answer = Answer()
    try:
        with httpx.stream("POST", f"{d.url}/v1/completions", json=body, timeout=120, verify=d.verify) as reply:
            if reply.status_code != 200:
                answer.retry_after_s = float(reply.headers.get("retry-after", "1"))
                text = reply.read().decode()
                answer.error = f"HTTP {reply.status_code}: {text[:200]}"
                try:
                    answer.codes.append(error_code(reply.status_code, json.loads(text)))
                except ValueError:
                    answer.codes.append(f"HTTP {reply.status_code} (not JSON)")
                return answer
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    answer.error = str(chunk["error"])[:200]
                    answer.codes.append(error_code(None, chunk))
                for choice in chunk.get("choices", []):
                    answer.text += choice.get("text", "")
                    answer.finish_reason = choice.get("finish_reason") or answer.finish_reason
                if chunk.get("usage"):
                    answer.completion_tokens = chunk["usage"]["completion_tokens"]
                answer.retries = chunk.get("pdserve", {}).get("retries", answer.retries)
    except httpx.HTTPError as exc:
        answer.error = repr(exc)
        answer.codes.append(f"client {type(exc).__name__}")
    return answer


PROCESS_FAULTS = ["kill decode", "kill prefill", "freeze prefill", "kill broker"]
LINK_FAULTS = ["delay links", "stall links", "reset links"]


def inject_faults(d: Deployment, every_s: float, stop: threading.Event, rng: random.Random, tally: Tally) -> None:
    faults = PROCESS_FAULTS + (LINK_FAULTS if d.proxy is not None else []) + (["partition"] if d.netns else [])
    if d.operator is not None:  # no broker of `pdserve local`'s own: the operator's, in its process
        faults = [f if f != "kill broker" else "kill operator" for f in faults]
    while not stop.wait(every_s):
        if not d.healthy():  # let the last fault heal first: one fault at a time
            continue
        fault = rng.choice(faults)
        if fault in LINK_FAULTS or fault == "partition":
            name = rng.choice(["decode", "prefill"]) + f"-{rng.randrange(2)}"
            tally.faults.append(f"{fault} into {name}")
            link_fault(d, fault, name, rng, stop)
            continue
        if fault == "kill operator":
            tally.faults.append(fault)
            back = d.kill_operator(stop)
            if back is not None:
                tally.operator_back_s.append(back)
            continue
        name = {"kill decode": f"decode-{rng.randrange(2)}", "kill broker": "broker"}.get(
            fault, f"prefill-{rng.randrange(2)}"
        )
        tally.faults.append(f"{fault} ({name})")
        if fault == "freeze prefill":
            d.signal(name, signal.SIGSTOP)
            stop.wait(4.0)
            d.signal(name, signal.SIGCONT)
        else:
            d.signal(name, signal.SIGKILL)


def link_fault(d: Deployment, fault: str, name: str, rng: random.Random, stop: threading.Event) -> None:
    """One network fault on every link into worker `name`; returns once it healed."""
    assert d.proxy is not None
    if fault == "delay links":
        d.proxy.delay(name, ms=200, seconds=4)
        stop.wait(4.0)
    elif fault == "stall links":
        seconds = rng.uniform(2.0, 6.0)  # both sides of the 3 s readiness and 2 s transfer timeouts
        d.proxy.stall(name, seconds)
        stop.wait(seconds)
    elif fault == "partition":
        assert d.netns is not None
        seconds = rng.uniform(2.0, 6.0)
        d.netns.partition(name, cut=True)
        try:
            stop.wait(seconds)
        finally:
            d.netns.partition(name, cut=False)
    else:
        d.proxy.reset(name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--fault-every", type=float, default=4.0, help="seconds between faults")
    ap.add_argument("--seconds", type=float, default=180.0, help="time bound of the faulty phase")
    ap.add_argument("--model", default=None, help="HF folder (default: a tiny random-weight model)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--links",
        choices=["direct", "proxied", "netns"],
        default="direct",
        help="proxied: network faults too; netns: and a veth partition (module doc)",
    )
    ap.add_argument(
        "--operator",
        choices=["local", "real"],
        default="local",
        help="who brokers: pdserve local's broker, or the kopf operator process on the API emulator",
    )
    ap.add_argument("--tls", action="store_true", help="pdserve local --tls: mutual TLS on every gRPC hop")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="pdserve-soak-"))
    model = args.model
    if model is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/support, without PYTHONPATH
        from support.tiny_model import write_tiny_model

        model = str(write_tiny_model(work / "tiny-model"))
    (work / "logs").mkdir()
    d = Deployment(model, work / "logs", Shape(links=args.links, tls=args.tls, operator=args.operator))
    print(f"soak: logs in {work / 'logs'}", flush=True)
    tally = Tally()
    leaked = -1
    try:
        reference = {p: complete(d, p, args.max_tokens) for p in PROMPTS}
        bad = [p for p, a in reference.items() if a.error or a.completion_tokens != args.max_tokens]
        if bad:
            raise SystemExit(f"undisturbed run failed for {bad}: {[reference[p].error for p in bad]}")
        stop = threading.Event()
        faults = threading.Thread(target=inject_faults, args=(d, args.fault_every, stop, rng, tally), daemon=True)
        started = time.monotonic()
        faults.start()
        prompts = [rng.choice(PROMPTS) for _ in range(args.requests)]
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            futures = {}
            for p in prompts:
                if time.monotonic() - started > args.seconds:
                    break
                futures[pool.submit(complete, d, p, args.max_tokens)] = p
                while sum(not f.done() for f in futures) >= args.concurrency:
                    time.sleep(0.02)
                if len(futures) % 50 == 0:  # progress: a soak runs minutes
                    print(
                        f"[{time.monotonic() - started:5.0f} s] {len(futures)} requests sent, "
                        f"{len(tally.faults)} faults so far",
                        flush=True,
                    )
            for future, prompt in futures.items():
                a = future.result()
                tally.codes.update(a.codes)
                if a.error is not None:
                    tally.failed += 1
                    tally.errors.append(a.error)
                    continue
                tally.completed += 1
                tally.retried += a.retries > 0
                tally.tokens_lost += max(0, args.max_tokens - a.completion_tokens)
                tally.differing += a.text != reference[prompt].text
        stop.set()
        faults.join()
        faulty_s = time.monotonic() - started
        # Settle: restarted children back, quarantined slots back (readiness 3 s + transfer 2 s + 5 s).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            statuses = [d.decode_status(f"decode-{i}") for i in range(2)]
            if d.healthy() and all(s is not None for s in statuses):
                leaked = sum(s.slots_total - s.slots_free for s in statuses)  # type: ignore[union-attr]
                if leaked == 0:
                    break
            time.sleep(0.5)
    finally:
        alive = d.stop()
    print(f"faulty phase: {faulty_s:.0f} s, {len(tally.faults)} faults: {', '.join(tally.faults)}")
    if d.operator is not None:
        back = sorted(tally.operator_back_s)
        print(
            f"operator kills: {tally.faults.count('kill operator')}, every worker at the restarted broker after "
            f"(s): {' '.join(f'{b:.1f}' for b in back) or '-'} (a kill missing here: not back within 60 s)"
        )
    print(
        f"requests completed {tally.completed} / failed {tally.failed} / retried {tally.retried} "
        f"(of {tally.completed + tally.failed})"
    )
    print(
        "error codes met (retried or final): "
        + (", ".join(f"{c} x{n}" for c, n in tally.codes.most_common()) or "none")
    )
    if d.proxy is not None:
        print(f"proxied links: {d.proxy.counters()}")
    print(f"answers differing from the undisturbed run: {tally.differing}")
    print(f"tokens lost: {tally.tokens_lost}")
    print(f"slots leaked: {leaked}")
    print(f"processes left running: {len(alive)}")
    for e in tally.errors[:5]:
        print(f"  failure: {e}")
    return 0 if tally.tokens_lost == 0 and tally.differing == 0 and leaked == 0 and not alive else 1


if __name__ == "__main__":
    sys.exit(main())
