"""A prefill pass packs its prompts into one row; a prompt that asks for its logprobs (echo)
gets exactly its own rows of the pass's final states, whatever its neighbours took from the
prefix cache (they start later), and a resumed prompt (num_generated > 0) gets none."""

from __future__ import annotations

import torch

from pdserve_worker.model.sampling.params import SamplingParams
from pdserve_worker.prefill.jobs import Job as _Job
from pdserve_worker.prefill.pass_run import keep_prompt_states as _keep_prompt_states


def test_each_echo_prompt_gets_its_own_rows_of_the_packed_states():
    echo = SamplingParams(logprobs=1, prompt_logprobs=1)
    jobs = [
        _Job(prompt=[1, 2, 3, 4, 5], params=SamplingParams()),  # 3 of 5 tokens from the cache
        _Job(prompt=[6, 7, 8], params=echo),
        _Job(prompt=[9, 10], params=SamplingParams()),
        _Job(prompt=[11, 12, 13, 14], params=echo, num_generated=1),  # a resume: the client has them
        _Job(prompt=[15, 16], params=echo),
    ]
    starts = [3, 0, 0, 0, 0]
    rows = [2, 3, 2, 4, 2]  # computed positions per prompt
    final = torch.arange(sum(rows), dtype=torch.float32)[:, None].repeat(1, 4)  # row r holds r
    _keep_prompt_states(list(enumerate(jobs)), starts, [final])
    assert [j.echo for j in jobs] == [False, True, False, False, True]
    assert jobs[1].prompt_states[:, 0].tolist() == [2.0, 3.0, 4.0]
    assert jobs[4].prompt_states[:, 0].tolist() == [11.0, 12.0]
    assert jobs[0].prompt_states is None and jobs[2].prompt_states is None and jobs[3].prompt_states is None
