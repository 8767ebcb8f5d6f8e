import pytest
from pydantic import ValidationError

from pdserve_worker.model.sampling.params import SamplingParams


def test_defaults_and_greedy():
    assert not SamplingParams().greedy
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(top_k=1).greedy


@pytest.mark.parametrize(
    "field,value", [("max_tokens", 0), ("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("top_k", -2)]
)
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValidationError, match=field):
        SamplingParams(**{field: value})


def test_unknown_fields_are_rejected():
    with pytest.raises(ValidationError, match="bogus"):
        SamplingParams(bogus=1)


def test_the_workers_refuse_what_the_api_refuses() -> None:
    """A request that reaches a worker without the router's checks (gRPC) meets the same bounds."""
    from pdserve_worker.model.sampling.params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS

    for bad in (
        {"top_k": 2**32},
        {"max_tokens": 2**32},
        {"seed": 2**63},
        {"stop": ("",)},
        {"stop": ("s" * (MAX_STOP_STRING_CHARS + 1),)},
        {"stop": ("s",) * (MAX_STOP_STRINGS + 1)},
        {"stop_token_ids": (-1,)},
    ):
        with pytest.raises(ValidationError):
            SamplingParams(**bad)
