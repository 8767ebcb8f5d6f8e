#!/usr/bin/env python3
"""A decode vLLM and a prefill vLLM joined by pdserve's connector (docs/engines.md), and what
pdserve's router will do between them: reserve on the decode, read the grant from the decode's
grant sink, prefill into it. tests/vllm/test_vllm_pd.py drives these helpers; run as a script it
measures TTFT with the push against the prefill alone at one prompt length (the acceptance
ratio of issue 54), on the machine as it is (shared machines: say so with the numbers).

    .venv/bin/python benchmarks/vllm_pd.py --tokens 2000 --runs 3

Needs .venv-vllm (`bash scripts/setup.sh --engine vllm`). Both servers: SmolLM2-135M bf16
(the bundled GGUF as an HF folder, vs_vllm.hf_folder), 1 GiB of KV each, prefix caching off,
eager mode, the decode on CPU 0 and the prefill on CPU 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
CONNECTOR = "pdserve_worker.engines.vllm.connector"


def vllm_missing() -> str | None:
    """None when .venv-vllm imports vLLM and the connector; else why not."""
    if not VLLM_PYTHON.exists():
        return f"{VLLM_PYTHON} is missing (bash scripts/setup.sh --engine vllm makes it)"
    probe = subprocess.run(
        [str(VLLM_PYTHON), "-c", f"import vllm, {CONNECTOR}"], capture_output=True, text=True, timeout=300
    )
    return None if probe.returncode == 0 else f".venv-vllm cannot import vllm and the connector: {probe.stderr[-400:]}"


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # our own child's group (vLLM spawns its engine)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


@dataclass(frozen=True)
class Launch:
    """One vLLM server with the connector: its role, the connector's keys, its CPU, the link key."""

    folder: Path
    log: Path
    port: int
    role: str  # kv_consumer (decode) | kv_producer (prefill)
    extra: dict[str, object]
    cpu: str
    key: str
    dtype: str = "bfloat16"


def start_vllm(launch: Launch) -> Server:
    config = {
        "kv_connector": "PdserveConnector",
        "kv_connector_module_path": CONNECTOR,
        "kv_role": launch.role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": launch.extra,
    }
    args = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(launch.folder)]
    args += ["--served-model-name", "m", "--dtype", launch.dtype, "--host", "127.0.0.1", "--port", str(launch.port)]
    args += ["--max-model-len", "4096", "--no-enable-prefix-caching", "--enforce-eager"]
    args += ["--kv-transfer-config", json.dumps(config)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": launch.cpu}
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    env["PDSERVE_KV_LINK_KEY"] = launch.key  # not in the config: vLLM logs that
    with launch.log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Server(f"http://127.0.0.1:{launch.port}", proc, launch.log)


def wait_up(server: Server, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"vLLM exited {server.proc.returncode}: {server.text()[-3000:]}")
        try:
            if httpx.get(f"{server.url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"vLLM at {server.url} not up in {timeout_s}s: {server.text()[-3000:]}")


class GrantSink:
    """The decode's grant sink (pdserve's decode worker's part): grants by the reservation's tag."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.grants: dict[str, dict[str, object]] = {}
        self.cond = threading.Condition()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        try:
            conn, _ = self.server.accept()
        except OSError:
            return
        with conn, conn.makefile("rb") as lines:
            for line in lines:
                grant = json.loads(line)["grant"]
                with self.cond:
                    self.grants[grant["tag"]] = grant
                    self.cond.notify_all()

    def wait(self, tag: str, timeout_s: float = 120) -> dict[str, object]:
        with self.cond:
            if not self.cond.wait_for(lambda: tag in self.grants, timeout_s):
                raise TimeoutError(f"no grant tagged {tag!r} in {timeout_s}s")
            return self.grants[tag]

    def close(self) -> None:
        self.server.close()


def complete(url: str, prompt: str, max_tokens: int, params: dict[str, object] | None = None) -> str:
    body: dict[str, object] = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if params is not None:
        body["kv_transfer_params"] = params
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    reply.raise_for_status()
    return str(reply.json()["choices"][0]["text"])


def metric(url: str, name: str, labels: str = "") -> float:
    """The sum of a Prometheus sample over its series (those whose labels contain `labels`)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    pattern = rf"^{re.escape(name)}\{{[^}}]*{re.escape(labels)}[^}}]*\}} ([0-9.e+-]+)$"
    values = [float(v) for v in re.findall(pattern, text, re.M)]
    if not values:
        raise KeyError(f"{name}{{{labels}}} not in {url}/metrics")
    return sum(values)


class PDPair:
    """A decode and a prefill vLLM with the connector, and the sink between them."""

    def __init__(self, folder: Path, logs: Path, ports: tuple[int, int, int], dtype: str = "bfloat16") -> None:
        self.sink, key = GrantSink(), secrets.token_hex(32)
        decode_extra = {"pdserve_listen": f"127.0.0.1:{ports[2]}", "pdserve_grant_sink": self.sink.address}
        decode = Launch(folder, logs / "decode.log", ports[0], "kv_consumer", decode_extra, "0", key, dtype)
        self.decode = start_vllm(decode)
        self.prefill = start_vllm(Launch(folder, logs / "prefill.log", ports[1], "kv_producer", {}, "1", key, dtype))

    def wait_up(self) -> None:
        wait_up(self.decode)
        wait_up(self.prefill)

    def disaggregated(self, prompt: str, tag: str, max_tokens: int) -> str:
        """Reserve on the decode, prefill into the grant, return the decode's text."""
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(complete, self.decode.url, prompt, max_tokens, {"pdserve_reserve": tag})
            grant = self.sink.wait(tag)
            complete(self.prefill.url, prompt, 1, {"pdserve_grant": grant})
            return answer.result(timeout=300)

    def ttft_with_push(self, prompt: str, tag: str) -> tuple[float, float]:
        """Seconds from the reserving request to the prefill's first token (pushed and notified),
        and of those, the reservation's (until the grant reached the sink)."""
        with ThreadPoolExecutor(1) as pool:
            start = time.perf_counter()
            answer = pool.submit(complete, self.decode.url, prompt, 2, {"pdserve_reserve": tag})
            grant = self.sink.wait(tag)
            reserved = time.perf_counter() - start
            complete(self.prefill.url, prompt, 1, {"pdserve_grant": grant})
            seconds = time.perf_counter() - start
            answer.result(timeout=300)
        return seconds, reserved

    def alone_while_reserved(self, prompt: str, held: str, tag: str) -> float:
        """Seconds of a grantless prefill of `prompt` while a decode reservation (of `held`)
        waits for its KV: what the waiting decode alone costs the prefill. Then releases it."""
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(complete, self.decode.url, held, 2, {"pdserve_reserve": tag})
            grant = self.sink.wait(tag)
            start = time.perf_counter()
            complete(self.prefill.url, prompt, 1)
            seconds = time.perf_counter() - start
            complete(self.prefill.url, held, 1, {"pdserve_grant": grant})
            answer.result(timeout=300)
        return seconds

    def stop(self) -> None:
        self.prefill.stop()
        self.decode.stop()
        self.sink.close()


def long_prompt(tokens: int, salt: int) -> str:
    """About `tokens` tokens of SmolLM2's tokenizer (one word is about one token)."""
    words = ["alpha", "river", "stone", "light", "paper", "green", "cloud", "metal"]
    return f"{salt} " + " ".join(words[(i * 7 + salt) % len(words)] for i in range(tokens - 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--logs", type=Path, default=Path(tempfile.mkdtemp(prefix="vllm-pd-")))
    args = parser.parse_args()
    reason = vllm_missing()
    if reason:
        sys.exit(f"vllm_pd: {reason}")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT / "tests"))
    from netutil import free_port
    from vs_vllm import hf_folder

    cache = Path(tempfile.gettempdir()) / "pdserve-vs-vllm"
    cache.mkdir(exist_ok=True)
    pair = PDPair(hf_folder("bfloat16", cache), args.logs, (free_port(), free_port(), free_port()))
    try:
        pair.wait_up()
        complete(pair.prefill.url, long_prompt(args.tokens, 99), 1)  # warm both paths once
        pair.ttft_with_push(long_prompt(args.tokens, 98), "warm")
        alone, pushed, reserved, held = [], [], [], []
        for run in range(args.runs):
            start = time.perf_counter()
            complete(pair.prefill.url, long_prompt(args.tokens, 2 * run), 1)
            alone.append(time.perf_counter() - start)
            total, reserve = pair.ttft_with_push(long_prompt(args.tokens, 2 * run + 1), f"run{run}")
            pushed.append(total)
            reserved.append(reserve)
            held.append(
                pair.alone_while_reserved(
                    long_prompt(args.tokens, 50 + run), long_prompt(args.tokens, 70 + run), f"hold{run}"
                )
            )
        a, p, r = statistics.median(alone), statistics.median(pushed), statistics.median(reserved)
        runs = {"prefill_alone_s": alone, "with_push_s": pushed, "of_which_reserve_s": reserved}
        runs["alone_while_a_reservation_waits_s"] = held
        print(json.dumps({"tokens": args.tokens, "runs": args.runs, **runs}))
        settles = re.findall(r"tag=run\d+ .*settle_ms=([\d.]+)", pair.prefill.text())
        print(f"TTFT at {args.tokens} tokens: prefill alone {a * 1000:.0f} ms, with the push {p * 1000:.0f} ms")
        print(f"  (reservation {r * 1000:.0f} ms), ratio {p / a:.3f}; settle after the forward (ms): {settles}")
    finally:
        pair.stop()


if __name__ == "__main__":
    main()
