"""`pdserve local`'s plan (cli/local_deployment.py): the tensor-parallel and layer-sharded
shapes it accepts and refuses, and how many model processes it starts."""

from __future__ import annotations

import pytest

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
