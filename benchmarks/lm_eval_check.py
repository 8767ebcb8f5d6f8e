"""lm-evaluation-harness against `pdserve local`, checked against lm-eval's own transformers model (#31).

Run:    bash benchmarks/setup_lm_eval.sh   (lm-eval 0.4.13 into .venv; never a test dependency)
        .venv/bin/python benchmarks/lm_eval_check.py [--keep DIR]

The bundled SmolLM2-135M, converted once to an fp32 HF folder (benchmarks/vs_vllm.py's
`hf_folder`), is evaluated twice by lm-eval on two local tasks written here (no hub): a
multiple-choice task (`loglikelihood` requests: echo + logprobs 1 + max_tokens 1, read from
`token_logprobs`/`top_logprobs` by lm-eval's `local-completions`) and a greedy `generate_until`
task. Once through `pdserve local` (1 prefill, 1 decode, fp32, dequantized weights: the exact
route) with `local-completions` (token-id prompts, lm-eval tokenizes), once with lm-eval's `hf`
model on the same folder. Prints progress, both scores, and per request the difference of the
loglikelihoods (target: max |difference| <= 1e-3) and whether the greedy flags and the
generations are equal.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve  # noqa: E402,F401  (puts worker/ and the rest on sys.path)
from seed_transfer import machine  # noqa: E402
from vs_vllm import hf_folder  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from support.local_run import LocalRun, served_model  # noqa: E402

QUESTIONS = [
    ("The capital of France is", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("The capital of Germany is", ["Rome", "Berlin", "Vienna", "Paris"], 1),
    ("The capital of Italy is", ["Milan", "Naples", "Rome", "Turin"], 2),
    ("The capital of Japan is", ["Osaka", "Kyoto", "Seoul", "Tokyo"], 3),
    ("Water freezes at a temperature of", ["0 degrees Celsius", "50 degrees Celsius", "90 degrees", "200 degrees"], 0),
    ("The largest planet in the solar system is", ["Mars", "Jupiter", "Venus", "Mercury"], 1),
    ("A week has", ["three days", "ten days", "seven days", "twelve days"], 2),
    ("The opposite of hot is", ["warm", "loud", "fast", "cold"], 3),
    ("Two plus two equals", ["four", "five", "six", "three"], 0),
    ("The sun rises in the", ["west", "east", "north", "south"], 1),
    ("Bees make", ["milk", "silk", "honey", "wool"], 2),
    ("The color of the clear sky is", ["green", "red", "yellow", "blue"], 3),
    ("A baby cat is called a", ["kitten", "puppy", "calf", "foal"], 0),
    ("Ice is frozen", ["sand", "water", "air", "oil"], 1),
    ("The first month of the year is", ["March", "June", "January", "October"], 2),
    ("Humans breathe in", ["helium", "neon", "argon", "oxygen"], 3),
]
GENERATE = [
    "Question: What is the capital of France?\nAnswer:",
    "Question: How many legs does a dog have?\nAnswer:",
    "Question: What color is grass?\nAnswer:",
    "Question: What do cows drink?\nAnswer:",
    "List three fruits:",
    "The quick brown fox",
]


def write_tasks(folder: Path) -> Path:
    """The two task YAMLs and their JSONL data in `folder` (lm-eval's include_path)."""
    mc = folder / "mc.jsonl"
    mc.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    gen = folder / "gen.jsonl"
    gen.write_text("".join(json.dumps({"question": q, "answer": ""}) + "\n" for q in GENERATE))
    common = "test_split: test\ndataset_path: json\n"
    (folder / "pdserve_mc.yaml").write_text(
        f"task: pdserve_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {mc}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: choices\n"
        "doc_to_target: answer\nmetric_list:\n  - metric: acc\n"
    )
    (folder / "pdserve_gen.yaml").write_text(
        f"task: pdserve_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {gen}\n"
        "output_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: answer\n"
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 16\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"
    )
    return folder


def evaluate(model: str, model_args: str, tasks: Path, batch_size: int = 1) -> dict[str, Any]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    started = time.monotonic()
    print(f"# lm-eval {model} ...", flush=True)
    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["pdserve_mc", "pdserve_gen"],
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
        batch_size=batch_size,
    )
    print(f"#   done in {time.monotonic() - started:.0f} s", flush=True)
    return out


def per_request(out: dict[str, Any]) -> tuple[list[tuple[float, bool]], list[str]]:
    """(loglikelihood, is_greedy) of every choice of every document, and every generation."""
    scores = [tuple(r[0]) for s in out["samples"]["pdserve_mc"] for r in s["resps"]]
    texts = [s["resps"][0][0] for s in out["samples"]["pdserve_gen"]]
    return scores, texts  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", type=Path, default=None, help="folder for the HF conversion and the logs")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help="lm-eval's batch for pdserve (a list of that many prompts per request)",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = args.keep or Path(tempfile.mkdtemp(prefix="pdserve-lm-eval-"))
    work.mkdir(parents=True, exist_ok=True)
    folder = hf_folder("float32", work)
    tasks = write_tasks(Path(tempfile.mkdtemp(dir=work)))
    print(f"# lm-eval check on {machine()}, SmolLM2-135M fp32 ({folder})", flush=True)
    run = LocalRun.start(
        work / "pdserve-logs",
        *("--model", str(folder), "--dtype", "float32", "--weights", "dequantized", "--max-len", "2048"),
        *("--prefill", "1", "--decode", "1", "--port", "0"),
    )
    try:
        served = f"model={served_model(run.url)},base_url={run.url}/v1/completions,tokenizer={folder}"
        ours = evaluate(
            "local-completions",
            served + ",tokenized_requests=True,num_concurrent=1,max_retries=1",
            tasks,
            args.batch_size,
        )
    finally:
        run.stop_cleanly()
    theirs = evaluate("hf", f"pretrained={folder},dtype=float32,device=cpu", tasks)
    report(ours, theirs)
    return 0


def report(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    (a, gen_a), (b, gen_b) = per_request(ours), per_request(theirs)
    worst = max(abs(x[0] - y[0]) for x, y in zip(a, b, strict=True))
    greedy_same = sum(x[1] == y[1] for x, y in zip(a, b, strict=True))
    for name, out in (("pdserve local-completions", ours), ("lm-eval hf", theirs)):
        acc = out["results"]["pdserve_mc"]["acc,none"]
        print(f"{name}: multiple-choice acc {acc:.4f} ({len(a) // 4} questions)")
    print(f"loglikelihood requests: {len(a)}; max |pdserve - hf| = {worst:.2e} (target <= 1e-3)")
    print(
        f"is_greedy equal on {greedy_same}/{len(a)}; generations equal on "
        f"{sum(x == y for x, y in zip(gen_a, gen_b, strict=True))}/{len(gen_a)}"
    )
    for x, y in zip(gen_a, gen_b, strict=True):
        print(f"  generate_until: pdserve {x!r}  hf {y!r}")


if __name__ == "__main__":
    raise SystemExit(main())
