"""The tests' one factory of `pdserve local` command lines (tests/support/deployments.py) writes
what each deployment asked for, and every flag it writes is one `pdserve local` accepts."""

from __future__ import annotations

import re
import subprocess

import pytest

from support.deployments import local_args
from support.local_run import cli, cli_env


def test_defaults_are_the_commands_shape_in_float32_on_a_free_port():
    assert local_args("/m") == ["--model", "/m", "--dtype", "float32", "--prefill", "1", "--decode", "2", "--port", "0"]


def test_keywords_become_flags_true_a_bare_flag_none_and_false_nothing():
    args = local_args(None, dtype=None, decode=1, max_len=128, tls=True, colocated=False, on_exit=None)
    assert args == ["--prefill", "1", "--decode", "1", "--max-len", "128", "--tls", "--port", "0"]


def test_env_is_one_flag_per_variable_in_order():
    args = local_args("/m", env={"B": 2, "A": "x=y"})
    assert args[-4:] == ["--env", "B=2", "--env", "A=x=y"]


def test_a_colocated_deployment_has_no_counts_and_refuses_them():
    assert local_args("/m", colocated=True) == ["--model", "/m", "--dtype", "float32", "--colocated", "--port", "0"]
    with pytest.raises(ValueError, match="colocated .* prefill=1 decode=1"):
        local_args("/m", colocated=True, decode=1)


def test_every_flag_the_tests_use_is_one_pdserve_local_has():
    """A misspelt keyword would make a flag the command refuses only when that test starts it."""
    used = local_args(
        "/m",
        slots=2,
        max_len=64,
        layers_per_chunk=1,
        threads=1,
        on_exit="ignore",
        layer_shards=2,
        prefill_tp=2,
        decode_tp=2,
        prefix_cache_tokens=0,
        prefix_disk_dir="/d",
        trace_file="/t",
        api_keys="/k",
        transfer="two-sided",
        routers=2,
        epp_port=1,
        tls=True,
        env={"X": 1},
    )
    help_text = subprocess.run(cli("local", "--help"), env=cli_env(), capture_output=True, text=True, check=True).stdout
    known = set(re.findall(r"--[a-z][a-z0-9-]*", help_text))
    assert {a for a in used if a.startswith("--")} <= known, sorted({a for a in used if a.startswith("--")} - known)
