"""A workload: how often requests come, how long their prompts and answers are, and the SLOs.

Length distributions are kept as a few weighted points (a fixed length, a uniform range, a
sample, or a mixture of those), because the prefill time of a prompt is not linear in its
length (causal attention is quadratic): its mean and second moment, which the queueing model
needs, are computed over the points exactly instead of from a mean and a variance.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Points a uniform range is represented by (midpoints of equal-probability bins).
UNIFORM_POINTS = 16


class WeightedLength(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    weight: float = Field(gt=0)
    dist: LengthDistribution


class LengthDistribution(BaseModel):
    """Exactly one of: `fixed`, `uniform` [lo, hi] (inclusive), `samples`, `mixture`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fixed: int | None = Field(default=None, ge=1)
    uniform: tuple[int, int] | None = None
    samples: tuple[int, ...] | None = None
    mixture: tuple[WeightedLength, ...] | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> LengthDistribution:
        given = [k for k in ("fixed", "uniform", "samples", "mixture") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"a length distribution needs exactly one of fixed/uniform/samples/mixture, got {given or 'none'}"
            )
        if self.uniform is not None and not (1 <= self.uniform[0] <= self.uniform[1]):
            raise ValueError(f"uniform range must be 1 <= lo <= hi, got {list(self.uniform)}")
        if self.samples is not None and (not self.samples or min(self.samples) < 1):
            raise ValueError("samples must be a non-empty list of lengths >= 1")
        if self.mixture is not None and not self.mixture:
            raise ValueError("mixture must not be empty")
        return self

    def points(self) -> list[tuple[int, float]]:
        """(length, probability) pairs, probabilities summing to 1."""
        if self.fixed is not None:
            return [(self.fixed, 1.0)]
        if self.uniform is not None:
            lo, hi = self.uniform
            count = min(UNIFORM_POINTS, hi - lo + 1)
            width = (hi - lo + 1) / count
            return [(int(lo + width * (i + 0.5)), 1.0 / count) for i in range(count)]
        if self.samples is not None:
            counts: dict[int, int] = {}
            for n in self.samples:
                counts[n] = counts.get(n, 0) + 1
            return sorted((n, c / len(self.samples)) for n, c in counts.items())
        assert self.mixture is not None
        total = sum(part.weight for part in self.mixture)
        merged: dict[int, float] = {}
        for part in self.mixture:
            for n, p in part.dist.points():
                merged[n] = merged.get(n, 0.0) + p * part.weight / total
        return sorted(merged.items())

    def mean(self) -> float:
        return sum(n * p for n, p in self.points())

    def quantile(self, q: float) -> int:
        """The smallest length whose cumulative probability reaches q."""
        acc = 0.0
        points = self.points()
        for n, p in points:
            acc += p
            if acc >= q - 1e-12:
                return n
        return points[-1][0]

    def scaled_to_mean(self, mean: float) -> LengthDistribution:
        """The same shape stretched so that its mean is `mean` (lengths stay >= 1)."""
        if mean <= 0:
            raise ValueError(f"a mean length must be positive, got {mean}")
        factor = mean / self.mean()
        return LengthDistribution(
            mixture=tuple(
                WeightedLength(weight=p, dist=LengthDistribution(fixed=max(1, round(n * factor))))
                for n, p in self.points()
            )
        )

    @classmethod
    def of(cls, lengths: Sequence[int]) -> LengthDistribution:
        return cls(samples=tuple(int(n) for n in lengths))


WeightedLength.model_rebuild()


class SLO(BaseModel):
    """Targets on the `quantile` of TTFT and of TPOT (each on its own); None: no target."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft_ms: float | None = Field(default=None, gt=0)
    tpot_ms: float | None = Field(default=None, gt=0)
    quantile: float = Field(default=0.99, gt=0, lt=1)


class Workload(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    arrival_rate: float = Field(ge=0, description="requests per second (Poisson)")
    prompt_tokens: LengthDistribution
    output_tokens: LengthDistribution
    slo: SLO = SLO()

    def with_rate(self, rate: float) -> Workload:
        return self.model_copy(update={"arrival_rate": max(0.0, float(rate))})
