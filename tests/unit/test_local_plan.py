"""`pdserve local`'s plan (cli/local_deployment.py): the tensor-parallel and layer-sharded
shapes it accepts and refuses, how many model processes it starts, and an outside broker
(`--broker`, `--token-file`) the workers attach to instead of one of the run's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve_worker.cli.local_deployment import LocalDeployment, LocalStartError, outside_token
from pdserve_worker.cli.local_plan import LocalPlan


def test_tensor_parallel_instances_count_one_process_per_rank():
    assert LocalPlan(prefill=2, decode=1, prefill_tp=3, decode_tp=3).model_processes == 2 * 3 + 3
    assert LocalPlan(prefill=1, decode=2, layer_shards=2).model_processes == 1 + 4


@pytest.mark.parametrize(
    "fields,needle",
    [
        ({"decode_tp": 2, "layer_shards": 2}, r"tensor-parallel \(--decode-tp\) or layer-sharded"),
        ({"decode_tp": 2, "kv_block_tokens": 0}, "--decode-tp needs a paged KV pool"),
        ({"decode_tp": 0}, "decode_tp must be >= 1"),
    ],
)
def test_shapes_that_cannot_be_served_are_refused_by_flag(fields, needle):
    with pytest.raises(ValueError, match=needle):
        LocalPlan(**fields)


@pytest.mark.parametrize(
    "fields,needle",
    [
        ({"broker": "127.0.0.1:50070"}, "--broker and --token-file go together"),
        ({"token_file": Path("token")}, "--broker and --token-file go together"),
        ({"broker": "127.0.0.1:50070", "token_file": Path("t"), "tls": True}, "not with --tls"),
        ({"broker": "127.0.0.1:50070", "token_file": Path("t"), "colocated": True}, "not with --tls nor --colocated"),
    ],
)
def test_an_outside_broker_needs_its_token_and_plaintext_pd(fields, needle):
    with pytest.raises(ValueError, match=needle):
        LocalPlan(**fields)


def test_with_an_outside_broker_the_workers_attach_to_it_with_the_token_of_the_file(tmp_path):
    token = tmp_path / "token"
    token.write_text("the-operators-token\n")
    deployment = LocalDeployment(LocalPlan(broker="127.0.0.1:50070", token_file=token, log_dir=tmp_path), progress=None)
    deployment._start_broker()
    assert (deployment.broker_address, deployment.token) == ("127.0.0.1:50070", "the-operators-token")
    assert deployment.children == []  # no broker of its own
    token.write_text("\n")
    with pytest.raises(LocalStartError, match=f"--token-file {token} is empty"):
        deployment._start_broker()
    with pytest.raises(LocalStartError, match="--broker needs --token-file"):
        outside_token(None)
