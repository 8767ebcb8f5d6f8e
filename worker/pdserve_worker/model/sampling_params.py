"""What a request asks of the sampler: the one boundary type shared by router, prefill and decode.

A pydantic model because it crosses process boundaries (HTTP body → gRPC → decode) and must
reject nonsense (negative temperature, top_p of 2) with the field name in the error.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = Field(16, ge=1, description="Tokens to generate at most.")
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="0 means greedy.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 disables.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass to keep; 1 disables.")
    seed: int | None = Field(None, description="Seed of the request's own generator; None draws one.")
    stop: tuple[str, ...] = Field((), description="Strings that end generation (not included in the output).")
    stop_token_ids: tuple[int, ...] = Field((), description="Token ids that end generation besides EOS.")
    ignore_eos: bool = Field(False, description="Keep generating past EOS (benchmarks).")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
