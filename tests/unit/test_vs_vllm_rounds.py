"""benchmarks/vs_vllm.py --rounds: the order the servers run in each round, and the figures it
quotes (each metric's median over the rounds; pdserve ÷ vLLM paired round by round)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import vs_vllm  # noqa: E402


def _row(ttft: float, tpot: float, tok: float) -> dict[str, Any]:
    return {"ttft_p50_s": ttft, "tpot_p50_ms": tpot, "tpot_p99_ms": tpot * 2, "tok_per_s": tok, "failed": 0}


def _rounds() -> list[dict[str, dict[str, Any]]]:
    # three rounds: vLLM's c16 drifts 100 -> 130 -> 110 tok/s, ours 120 -> 140 -> 150
    out = []
    for v, p in ((100.0, 120.0), (130.0, 140.0), (110.0, 150.0)):
        out.append(
            {
                "vllm": {
                    "c16": _row(6.0, 120.0, v),
                    "mixed": {"tpot_p50_ms": 60.0, "tpot_p99_ms": 200.0, "ttft_p50_s": 1.0, "goodput_rps": 0.0},
                    "sweep-length": {"128": _row(0.3, 40.0, v / 10)},
                },
                "colocated": {
                    "c16": _row(2.0, 110.0, p),
                    "mixed": {"tpot_p50_ms": 30.0, "tpot_p99_ms": 50.0, "ttft_p50_s": 2.0, "goodput_rps": 1.0},
                    "sweep-length": {"128": _row(0.25, 30.0, p / 10)},
                },
            }
        )
    return out


def test_median_table_takes_each_metric_median_over_rounds_and_sweep_points() -> None:
    table = vs_vllm.median_table(_rounds())
    assert table["vllm"]["c16"]["tok_per_s"] == 110.0
    assert table["colocated"]["c16"]["tok_per_s"] == 140.0
    assert table["colocated"]["sweep-length"]["128"]["tok_per_s"] == pytest.approx(14.0)
    assert table["vllm"]["mixed"]["goodput_rps"] == 0.0


def test_median_table_adds_up_failures_rather_than_hiding_one_round() -> None:
    rounds = _rounds()
    rounds[1]["colocated"]["c16"]["failed"] = 2
    table = vs_vllm.median_table(rounds)
    assert table["colocated"]["c16"]["failed"] == 2
    assert table["vllm"]["c16"]["failed"] == 0


def test_round_ratios_pair_runs_of_the_same_round() -> None:
    ratios = vs_vllm.round_ratios(_rounds())
    assert set(ratios) == {"colocated"}  # vLLM is the baseline, not a row
    assert ratios["colocated"]["c16"]["tok_per_s"] == pytest.approx([1.2, 140 / 130, 150 / 110])
    assert ratios["colocated"]["sweep-length 128"]["tpot_p50_ms"] == pytest.approx([0.75] * 3)
    mixed = ratios["colocated"]["mixed"]
    assert set(mixed) == {"tpot_p99_ms", "goodput_rps"}  # the PD scenario's own two figures
    assert mixed["tpot_p99_ms"] == pytest.approx([0.25] * 3)
    assert mixed["goodput_rps"] == [None] * 3  # vLLM's 0: no ratio (and no NaN in the JSON)


def test_spread_quotes_the_rounds_that_have_a_ratio() -> None:
    assert vs_vllm.spread([1.2, 0.9, 1.1]) == "1.10 [0.90 – 1.20]"
    assert vs_vllm.spread([3.3, None, 4.3]) == "3.80 [3.30 – 4.30] (1 of 3 rounds: vLLM 0, no ratio)"
    assert vs_vllm.spread([None, None]) == "— (2 of 2 rounds: vLLM 0, no ratio)"


def test_round_ratios_need_vllm() -> None:
    rounds = [{"colocated": r["colocated"]} for r in _rounds()]
    assert vs_vllm.round_ratios(rounds) == {}


def test_measure_rounds_alternates_the_order_and_draws_new_prompts_each_round(monkeypatch) -> None:
    calls: list[tuple[str, str, int]] = []
    warmed: list[str] = []

    def fake_measure(server: Any, name: str, args: Any, tokenizer: Any, round_: int = 0) -> dict[str, Any]:
        calls.append((server.name, name, round_))
        return _row(1.0, 1.0, float(len(calls)))

    monkeypatch.setattr(vs_vllm, "measure_scenario", fake_measure)
    monkeypatch.setattr(vs_vllm, "warm_up", lambda server, tokenizer: warmed.append(server.name))
    servers = {name: argparse.Namespace(name=name) for name in ("vllm", "colocated", "pd")}
    args = argparse.Namespace(rounds=3, scenarios="c8,c16")
    rounds = vs_vllm.measure_rounds(servers, args, tokenizer=None)  # type: ignore[arg-type]
    assert warmed == ["vllm", "colocated", "pd"]
    order = [s for s, _, _ in calls]
    assert order[:9] == ["vllm", "colocated", "pd", "pd", "colocated", "vllm", "vllm", "colocated", "pd"]
    assert [(sc, r) for _, sc, r in calls[:9]] == [("c8", r) for r in (0, 0, 0, 1, 1, 1, 2, 2, 2)]
    assert len(rounds) == 3 and set(rounds[2]["pd"]) == {"c8", "c16"}
    assert rounds[1]["pd"]["c8"]["tok_per_s"] == 4.0  # the fourth run: round 2's first, pd


def test_rounds_below_one_are_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        vs_vllm.main(["--rounds", "0"])
    assert "--rounds must be at least 1, got 0" in capsys.readouterr().err


def test_a_repeated_scenario_draws_prompts_of_its_own_per_round() -> None:
    class Words:
        def encode(self, text: str) -> list[str]:
            return text.split()

        def decode(self, ids: list[str], skip_special_tokens: bool = True) -> str:
            return " ".join(ids)

    s = vs_vllm.SCENARIOS["c8"]
    first = vs_vllm.scenario_requests(s, Words(), vs_vllm.seed_of("c8"))
    again = vs_vllm.scenario_requests(s, Words(), vs_vllm.seed_of("c8"))
    second = vs_vllm.scenario_requests(s, Words(), vs_vllm.seed_of("c8") + 1)
    assert [r.prompt for r in first] == [r.prompt for r in again]
    assert not {r.prompt for r in first} & {r.prompt for r in second}


def test_pdserve_dtype_goes_to_every_pdserve_server_and_not_to_vllm(monkeypatch, tmp_path) -> None:
    # --dtype bfloat16 --pdserve-dtype float32: vLLM on the bf16 folder in bf16 (its own default
    # there), every pdserve configuration computing in fp32 (ours on a CPU without native bf16).
    started: list[tuple[str, str]] = []

    def fake_pdserve(name: str, model: str, dtype: str, port: int, logs: Path, extra: list[str]) -> Any:
        started.append((name, dtype))
        return argparse.Namespace(settings={})

    def fake_vllm(folder: Path, dtype: str, port: int, logs: Path, python: Path, *rest: Any) -> Any:
        started.append(("vllm", dtype))
        return argparse.Namespace(settings={})

    monkeypatch.setattr(vs_vllm, "start_pdserve", fake_pdserve)
    monkeypatch.setattr(vs_vllm, "start_vllm", fake_vllm)
    python = tmp_path / "python"
    python.write_text("")
    args = argparse.Namespace(vllm_python=python, pdserve_dtype="float32")
    for name in ("vllm", "colocated", "colocated-int4", "pd"):
        vs_vllm.start_server(name, args, tmp_path, "bfloat16", 18600, tmp_path)
    assert started == [("vllm", "bfloat16"), ("colocated", "float32"), ("colocated-int4", "float32"), ("pd", "float32")]
