"""The real default model (SmolLM2-135M-Instruct, fp32) through prefill → push → decode gives,
token for token, what `pdserve generate` gives in one process: DESIGN.md's first non-negotiable."""

from __future__ import annotations

import subprocess

import openai
import pytest

from support.local_run import cli, cli_env

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Name three colors of the rainbow."]
MAX_TOKENS = 40


def colocated(question: str) -> str:
    out = subprocess.run(
        cli(
            "generate",
            "--chat",
            "--prompt",
            question,
            "--temperature",
            "0",
            "--max-tokens",
            str(MAX_TOKENS),
            "--dtype",
            "float32",
            "--threads",
            "1",
        ),
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.removesuffix("\n")


def test_greedy_answers_equal_colocated_generate(default_model_dir, tmp_path, local_deployments):
    run = local_deployments(tmp_path, None, decode=1, slots=2, max_len=512)
    try:
        client = openai.OpenAI(base_url=f"{run.url}/v1", api_key="unused", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        assert model == "SmolLM2-135M-Instruct"
        answers = []
        for question in QUESTIONS:
            reply = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": question}], max_tokens=MAX_TOKENS, temperature=0
            )
            assert reply.model_extra["pdserve"]["disaggregated"] is True
            assert reply.model_extra["pdserve"]["kv_bytes"] > 0
            answers.append(reply.choices[0].message.content)
    finally:
        assert run.stop() == 0
    assert "Paris" in answers[0]
    assert answers == [colocated(q) for q in QUESTIONS]
