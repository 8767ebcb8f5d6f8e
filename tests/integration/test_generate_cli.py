"""`pdserve generate` end to end, in a subprocess, as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    paths = [str(ROOT / d) for d in ("worker", "operator", "common", "proto")]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return subprocess.run(
        [sys.executable, "-m", "pdserve_worker.cli.main", "generate", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def stats_line(stderr: str) -> dict[str, str]:
    last = stderr.strip().splitlines()[-1]
    return dict(pair.split("=", 1) for pair in last.split())


@pytest.mark.slow
def test_chat_answers_the_capital_of_france(default_model_dir):
    # default_model_dir makes sure the conversion cache is filled, so this run loads in a blink.
    out = run_cli("--chat", "--prompt", "What is the capital of France?", "--temperature", "0", "--max-tokens", "32")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    stats = stats_line(out.stderr)
    assert float(stats["prefill_tokens_per_s"]) > 0 and float(stats["decode_ms_per_token"]) > 0
    assert stats["model"] == "SmolLM2-135M-Instruct" and stats["finish_reason"] == "stop"


def test_streams_the_same_text_as_the_generator(tiny_model_dir):
    from pdserve_worker.model.engine import generate
    from pdserve_worker.model.loading.loader import load_model
    from pdserve_worker.model.sampling.params import SamplingParams

    out = run_cli(
        "--model",
        str(tiny_model_dir),
        "--prompt",
        "Paris is",
        "--max-tokens",
        "6",
        "--temperature",
        "0.7",
        "--seed",
        "3",
        "--dtype",
        "float32",
        "--threads",
        "1",
    )
    assert out.returncode == 0, out.stderr
    loaded = load_model(str(tiny_model_dir), dtype="float32")
    params = SamplingParams(max_tokens=6, temperature=0.7, seed=3)
    [expected] = generate(loaded.model, loaded.tokenizer, [loaded.tokenizer.encode("Paris is")], params, max_len=64)
    assert out.stdout == expected.text + "\n"
    assert int(stats_line(out.stderr)["prompt_tokens"]) == len(loaded.tokenizer.encode("Paris is"))


def test_the_prompt_may_be_given_positionally(tiny_model_dir):
    """`pdserve generate "The capital of France is"` is what a newcomer types first."""
    flags = ("--model", str(tiny_model_dir), "--temperature", "0", "--max-tokens", "4", "--dtype", "float32")
    positional = run_cli("Paris is", *flags)
    flagged = run_cli("--prompt", "Paris is", *flags)
    assert positional.returncode == 0, positional.stderr
    assert positional.stdout == flagged.stdout and positional.stdout.strip()
    both = run_cli("Paris is", "--prompt", "Rome is", *flags)
    assert both.returncode == 2 and "not allowed with" in both.stderr
    neither = run_cli(*flags)
    assert neither.returncode == 2 and "required" in neither.stderr


def test_invalid_options_fail_with_the_field_named(tiny_model_dir):
    out = run_cli("--model", str(tiny_model_dir), "--prompt", "x", "--top-p", "2")
    assert out.returncode == 2 and "top_p" in out.stderr
    out = run_cli("--model", str(tiny_model_dir / "missing"), "--prompt", "x")
    assert out.returncode == 2 and "missing" in out.stderr and "Traceback" not in out.stderr


def test_generate_and_the_served_api_agree_with_default_options(tiny_model_dir, tmp_path, local_deployments):
    """One dtype default (`auto`) for every command: `pdserve generate` and the API that
    `pdserve local` serves resolve it alike and give the same greedy text (issue: generate used
    bfloat16 while the served workers used float32 on CPUs without native bf16, and the two
    texts parted after 15 tokens)."""
    import httpx

    from pdserve_worker.cli.local_deployment import auto_dtype

    prompt, tokens = "The capital of France is", 24
    out = run_cli(
        "--model",
        str(tiny_model_dir),
        "--prompt",
        prompt,
        "--max-tokens",
        str(tokens),
        "--temperature",
        "0",
        "--threads",
        "1",
    )
    assert out.returncode == 0, out.stderr
    stats = stats_line(out.stderr)
    assert stats["dtype"] == auto_dtype()
    run = local_deployments(tmp_path / "local", tiny_model_dir, dtype=None, decode=1, max_len=128, slots=2)
    try:
        assert run.manifest["dtype"] == stats["dtype"]
        model = httpx.get(f"{run.url}/v1/models", timeout=30).json()["data"][0]["id"]
        rsp = httpx.post(
            f"{run.url}/v1/completions",
            timeout=120,
            json={"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0},
        )
        assert rsp.status_code == 200, rsp.text
        served = rsp.json()["choices"][0]["text"]
    finally:
        run.stop_cleanly()
    assert served and out.stdout == served + "\n"
