"""Tensor-parallel prefill and decode through real processes (issue #32): `pdserve local
--prefill-tp N --decode-tp M` starts instances of N (M) rank processes (gloo all_reduce inside
each), each prefill rank pushing its own KV heads one-sided into the decode rank(s) holding them.

- The greedy text equals transformers' fp32 generate (the upstream, never our own tp=1 output)
  for the llama3 tiny model at every P_tp ∈ {1, 2, 4} × D_tp ∈ {1, 2} (tp 4 over 2 KV heads
  replicates each) and P_tp 2 into a 2-member layer-sharded decode group; for qwen2 (q/k/v
  biases, pushed over TCP) and qwen3 (q/k norms) at two combinations each that together give
  each family a split prefill and a split decode (qwen2: 1×2 and 4×2, qwen3: 2×2 and 4×1 —
  the combinations' own paths are llama3's; what a family adds is in its layers); and for the
  bundled model at 1×3 and 3×3 (9 query heads over 3 KV heads: sizes 1, 3, 9).
- Each rank pushed its share of the KV bytes (the prefill's per-rank counter), and their sum is
  what the response reports: nothing went through rank 0 for another rank.
- A rank killed in the middle of a prefill: the request completes through the other prefill
  instance and the decode's blocks all come back. A decode rank killed: its instance ends
  itself, and requests go on through the other decode.
"""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest

from pdserve_worker.model.tokenizer import Tokenizer
from support.deployments import local_deployment
from support.local_run import LocalRun
from support.model_families import build_family, hf_greedy, hf_model

pytestmark = pytest.mark.slow

TEXTS = ["Paris is the capital of", "Unicode: café 東京 and 12345.", "The quick brown fox jumps over the lazy dog."]
LLAMA = {"num_attention_heads": 4, "num_key_value_heads": 2}
QWEN2 = {"num_attention_heads": 8, "num_key_value_heads": 4, "hidden_size": 64}
FAMILIES = {"llama3": LLAMA, "qwen2": QWEN2, "qwen3": LLAMA}
# (family, config override, prefill tensor-parallel size, decode's[, layer shards]): llama3 at
# every P_tp in {1, 2, 4} x D_tp in {1, 2} but 1 x 1 (tests/integration/test_pd_families.py);
# the other families at the combinations that split each side of theirs (module doc).
COMBINATIONS = {
    "llama3": [(1, 2), (2, 1), (2, 2), (4, 1), (4, 2)],
    "qwen2": [(1, 2), (4, 2)],
    "qwen3": [(2, 2), (4, 1)],
}
CASES = {
    f"{family}-p{p}d{d}": (family, FAMILIES[family], p, d) for family, pairs in COMBINATIONS.items() for p, d in pairs
}
CASES["llama3-p2-shards2"] = ("llama3", LLAMA, 2, 1, 2)  # into a 2-member layer-sharded decode group's slots
TOKENS = 10
# qwen2's cases push over TCP, as between pods (on one host the engines otherwise map each
# other's pools): every put into every decode rank's pool then passes that rank's lease check,
# which rank 0's table grants on each rank over the group (ranks/decode.py RankLeases).
TCP_PUSH = {"qwen2": {"PDSERVE_ENGINE_OPTIONS": '{"pdserve.Transport": "tcp"}'}}


def _metric(text: str, name: str, labels: str) -> float:
    found = re.search(rf"^{name}\{{{labels}\}} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


@pytest.fixture(scope="module", params=list(CASES))
def deployment(request, tmp_path_factory):
    family, override, tp, decode_tp, *sharded = CASES[request.param]
    folder = build_family(family, tmp_path_factory.mktemp(f"tp-model-{request.param}"), **override)
    hf = hf_model(folder)
    tok = Tokenizer.from_dir(folder)
    # (the server leaves special tokens out of the text, as vLLM does)
    expected = [
        (tok.encode(t), tok.decode(hf_greedy(hf, tok.encode(t), TOKENS), skip_special_tokens=True)) for t in TEXTS
    ]
    run = local_deployment(
        tmp_path_factory.mktemp(f"tp-{request.param}"),
        folder,
        decode=1,
        prefill_tp=tp,
        decode_tp=decode_tp,
        layer_shards=sharded[0] if sharded else 1,
        prefix_cache_tokens=0,
        env=TCP_PUSH.get(family, {}),
    )
    try:
        yield run, expected, tp, override["num_key_value_heads"]
    finally:
        run.stop_cleanly()


def test_greedy_text_equals_transformers_and_each_rank_pushes_its_share(deployment):
    run, expected, tp, kv_heads = deployment
    total = 0
    with httpx.Client(base_url=run.url, timeout=120) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        for ids, text in expected:
            # (repetition_penalty 1: qwen2's generation_config.json would apply 1.05, which HF's greedy does not)
            body = {"model": model, "prompt": ids, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
            body["repetition_penalty"] = 1.0
            reply = http.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == text
            total += reply.json()["pdserve"]["kv_bytes"]
        metrics = httpx.get(f"http://{run.child('prefill-0')['http']}/metrics").text
    per_rank = [_metric(metrics, "pdserve_prefill_rank_kv_bytes_total", f'rank="{r}"') for r in range(tp)]
    pushing = [b for b in per_rank if b]  # (with replicated KV heads, a replica's rank pushes nothing)
    assert sum(per_rank) == total > 0
    assert len(pushing) == min(tp, kv_heads) and len(set(pushing)) == 1  # equal shares: each its heads only
    assert pushing[0] == total / len(pushing)


def _rank_pids(run: LocalRun, name: str) -> list[int]:
    log = open(run.child(name)["log"]).read()
    found = re.findall(r"event=tp_ranks_started size=\d+ pids=\[([\d, ]+)\]", log)
    return [int(p) for p in found[-1].split(",")]


def _kv_tokens_used(run: LocalRun) -> float:
    metrics = httpx.get(f"http://{run.child('decode-0')['http']}/metrics").text
    return float(re.search(r"^pdserve_decode_kv_tokens_used (\S+)$", metrics, re.MULTILINE).group(1))


def test_a_rank_killed_mid_prefill_fails_over_to_another_prefill(tmp_path_factory, local_deployments):
    folder = build_family("qwen3", tmp_path_factory.mktemp("tp-fault-model"))
    run = local_deployments(
        tmp_path_factory.mktemp("tp-fault"),
        folder,
        prefill=2,
        decode=1,
        prefill_tp=2,
        prefix_cache_tokens=0,
        on_exit="restart",
    )
    frozen = _rank_pids(run, "prefill-0")[0]
    try:
        # Rank 1 frozen: prefill-0's next pass starts on rank 0 and waits in its first
        # all_reduce, mid-prefill; killing rank 1 then breaks that collective.
        os.kill(frozen, signal.SIGSTOP)
        with httpx.Client(base_url=run.url, timeout=120) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
            body = {"model": model, "prompt": "Paris is the capital of", "max_tokens": 8, "temperature": 0}
            import concurrent.futures

            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                futures = [pool.submit(http.post, "/v1/completions", json=body) for _ in range(4)]
                time.sleep(3.0)  # the requests are in: one at least waits on prefill-0
                os.kill(frozen, signal.SIGKILL)
                replies = [f.result() for f in futures]
        assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies]
        assert len({r.json()["choices"][0]["text"] for r in replies}) == 1  # the same greedy text
        prefill_log = open(run.child("prefill-0")["log"]).read()
        assert "event=tp_group_broken" in prefill_log  # prefill-0 did serve one and lost its rank
        deadline = time.monotonic() + 30
        while _kv_tokens_used(run) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _kv_tokens_used(run) == 0  # every block came back
    finally:
        try:
            os.kill(frozen, signal.SIGKILL)
        except ProcessLookupError:
            pass
        run.stop_cleanly(also=[frozen])


# (3, 3) only: 1 x N's and N x 1's paths are llama3's 1 x 2, 2 x 1 and 4 x 1 (the suite's time).
@pytest.mark.parametrize("prefill_tp,decode_tp", [(3, 3)])
def test_the_default_model_at_tp_3_answers_as_transformers_does(
    default_model_dir, tmp_path, prefill_tp, decode_tp, local_deployments
):
    """The bundled SmolLM2-135M (9 query heads over 3 KV heads: sizes 1, 3, 9), dequantized to
    fp32, prefilled and/or decoded by 3 ranks of one KV head each: the greedy chat answers are
    transformers' fp32 greedy tokens, and each prefill rank pushed its share of the KV."""
    hf = hf_model(default_model_dir)
    tok = Tokenizer.from_dir(default_model_dir)
    chats = [tok.encode_chat([{"role": "user", "content": q}]) for q in ("What is the capital of France?", "Hi!")]
    expected = [tok.decode(hf_greedy(hf, ids, TOKENS), skip_special_tokens=True) for ids in chats]
    run = local_deployments(
        tmp_path, default_model_dir, decode=1, prefill_tp=prefill_tp, decode_tp=decode_tp, prefix_cache_tokens=0
    )
    try:
        with httpx.Client(base_url=run.url, timeout=300) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
            for ids, text in zip(chats, expected, strict=True):
                body = {"model": model, "prompt": ids, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
                reply = http.post("/v1/completions", json={**body, "repetition_penalty": 1.0})
                assert reply.status_code == 200, reply.text
                assert reply.json()["choices"][0]["text"] == text
            metrics = httpx.get(f"http://{run.child('prefill-0')['http']}/metrics").text
        ranks = range(prefill_tp)
        per_rank = [_metric(metrics, "pdserve_prefill_rank_kv_bytes_total", f'rank="{r}"') for r in ranks]
        assert per_rank[0] > 0 and len(set(per_rank)) == 1
    finally:
        run.stop_cleanly()


def test_a_dead_decode_rank_takes_its_instance_down_and_the_other_decode_serves(tmp_path_factory, local_deployments):
    """A decode rank past 0 killed: rank 0's next collective fails, it logs tp_group_broken and
    ends its process (the instance restarts as one); requests go on through the other decode."""
    folder = build_family("llama3", tmp_path_factory.mktemp("tp-decode-fault-model"), **LLAMA)
    run = local_deployments(
        tmp_path_factory.mktemp("tp-decode-fault"),
        folder,
        decode=2,
        decode_tp=2,
        prefix_cache_tokens=0,
        on_exit="ignore",  # decode-0 ends its process (a pod would restart it); the deployment carries on
    )
    victim = _rank_pids(run, "decode-0")[0]
    try:
        os.kill(victim, signal.SIGKILL)
        with httpx.Client(base_url=run.url, timeout=120) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
            body = {"model": model, "prompt": "Paris is the capital of", "max_tokens": 6, "temperature": 0}
            deadline = time.monotonic() + 60
            while "event=tp_group_broken" not in open(run.child("decode-0")["log"]).read():
                assert time.monotonic() < deadline, "decode-0 never noticed its dead rank"
                http.post("/v1/completions", json=body)  # (a step, or the idle tick, finds the rank gone)
                time.sleep(0.5)
            replies = [http.post("/v1/completions", json=body) for _ in range(4)]
        assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies]
        assert len({r.json()["choices"][0]["text"] for r in replies}) == 1
        ended = re.compile(r"decode-0 \(pid \d+\) exited with code -?\d+; carrying on without it")
        deadline = time.monotonic() + 30
        while not ended.search(run.stderr_path.read_text()):  # decode-0's own process ended
            assert time.monotonic() < deadline, "decode-0's process did not end after its group broke"
            time.sleep(0.2)
    finally:
        run.stop_cleanly(also=[victim])
