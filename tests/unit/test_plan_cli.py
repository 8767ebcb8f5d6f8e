"""`pdserve plan`: counts and predictions from flags or a workload file; clear refusals;
`--profile` measures a profile that planning then reads back."""

from __future__ import annotations

import json

import pytest
import yaml

from pdserve_operator.planner import load_profile
from pdserve_worker.cli.main import main
from pdserve_worker.cli.plan import parse_lengths

SEEDS = ["--hardware", "ascend-910b", "--model", "llama-7b", "--prompt-tokens", "4096", "--output-tokens", "256"]


def test_plan_prints_counts_and_predictions(capsys):
    assert main(["plan", *SEEDS, "--rate", "1.5", "--ttft-ms", "3000", "--tpot-ms", "40"]) == 0
    out = capsys.readouterr().out
    assert "start with:" in out and "TTFT" in out and "TPOT" in out and "why:" in out


def test_plan_json_is_the_planners_decision(capsys):
    assert main(["plan", *SEEDS, "--rate", "1.5", "--ttft-ms", "3000", "--tpot-ms", "40", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["meets_slo"] and data["prefill"] >= 1 and data["decode"] >= 1
    assert data["predicted"]["ttft_p99_s"] <= 3.0 and data["predicted"]["tpot_p99_s"] <= 0.040
    # More load, more replicas.
    assert main(["plan", *SEEDS, "--rate", "6", "--ttft-ms", "3000", "--tpot-ms", "40", "--json"]) == 0
    more = json.loads(capsys.readouterr().out)
    assert more["prefill"] + more["decode"] > data["prefill"] + data["decode"]


def test_unreachable_slo_exits_1_and_says_so(capsys):
    assert main(["plan", *SEEDS, "--rate", "1", "--ttft-ms", "10", "--max-prefill", "2", "--max-decode", "2"]) == 1
    assert "SLO NOT met" in capsys.readouterr().out


def test_a_workload_file_with_flags_overriding(tmp_path, capsys):
    path = tmp_path / "w.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "arrival_rate": 0.5,
                "prompt_tokens": {"uniform": [128, 1024]},
                "output_tokens": {"fixed": 64},
                "slo": {"ttft_ms": 2000, "quantile": 0.9},
            }
        )
    )
    assert main(["plan", "--hardware", "ascend-910b", "--workload", str(path), "--rate", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert "2 req/s" in data["reason"] and "ttft_p90_s" in data["predicted"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--rate", "1", "--prompt-tokens", "abc", "--output-tokens", "8"], "lengths 'abc'"),
        (["--rate", "1", "--prompt-tokens", "10-5", "--output-tokens", "8"], "lo <= hi"),
        (["--prompt-tokens", "10", "--output-tokens", "8"], "needs arrival_rate"),
        (
            ["--rate", "1", "--prompt-tokens", "10", "--output-tokens", "8", "--hardware", "nope"],
            "neither a bundled profile",
        ),
        (
            ["--rate", "1", "--prompt-tokens", "10", "--output-tokens", "8", "--min-ratio", "3", "--max-ratio", "1"],
            "exceeds max_ratio",
        ),
    ],
)
def test_bad_input_is_refused_with_the_reason(args, message, capsys):
    assert main(["plan", *args]) == 2
    assert message in capsys.readouterr().err


def test_length_forms():
    assert parse_lengths("512").points() == [(512, 1.0)]
    assert parse_lengths("100-200").mean() == pytest.approx(150, abs=4)
    mix = parse_lengths("32-256:0.65,1024-2048:0.35")
    assert mix.mean() == pytest.approx(0.65 * 144 + 0.35 * 1536, rel=0.02)


def test_profile_measures_this_machine_and_planning_reads_it(tmp_path, capsys):
    out = tmp_path / "here.json"
    assert main(["plan", "--profile", "--out", str(out), "--threads", "1"]) == 0
    profile = load_profile(out)
    assert profile.device == "cpu" and profile.measured["threads"] == 1
    assert profile.matmul_flops > 1e8 and profile.memory_bandwidth > 1e7 and profile.link_bandwidth > 1e6
    assert profile.layer_overhead_s > 0 and not profile.overlap_compute_memory and not profile.overlap_transfer
    capsys.readouterr()
    assert (
        main(
            [
                "plan",
                "--hardware",
                str(out),
                "--rate",
                "0.1",
                "--prompt-tokens",
                "128",
                "--output-tokens",
                "16",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["hardware"] == profile.name


def test_prefill_tp_is_planned_and_counted_in_devices(capsys):
    """#32: --prefill-tp makes each prefill instance N devices: the plan says so and counts
    them; a long prompt's predicted TTFT falls; a size the heads cannot take is refused."""
    base = ["plan", "--hardware", "ascend-910b", "--model", "llama-7b", "--rate", "1", "--prompt-tokens", "8192"]
    base += ["--output-tokens", "64", "--ttft-ms", "100000", "--tpot-ms", "1000", "--json"]
    assert main(base) == 0
    one = json.loads(capsys.readouterr().out)
    assert main([*base, "--prefill-tp", "4"]) == 0
    four = json.loads(capsys.readouterr().out)
    assert four["prefill_tensor_parallel"] == 4 and four["devices"] == 4 * four["prefill"] + four["decode"]
    assert main([*base, "--decode-tp", "2"]) == 0
    both = json.loads(capsys.readouterr().out)
    assert both["devices"] == both["prefill"] + 2 * both["decode"]
    assert both["predicted"]["tpot_mean_s"] < one["predicted"]["tpot_mean_s"]
    assert four["predicted"]["ttft_p50_s"] < one["predicted"]["ttft_p50_s"]
    assert main([*base, "--prefill-tp", "3"]) == 2
    assert "sizes that do: [1, 2, 4, 8, 16, 32]" in capsys.readouterr().err
