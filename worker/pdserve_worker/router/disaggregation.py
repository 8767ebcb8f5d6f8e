"""Conditional disaggregation: per request, a prefill's push (remote) or the reserved decode's
own prefill (local), by `disaggregation` (`spec.router.disaggregation`, `pdserve local`):
`always` pushes every request (the seeds' road); `never` computes on the decode every request it
can take (`can_be_local`); `auto` (the default) takes the road with the sooner first token,
estimated from the workers' reported costs (broker `Load`, read within `plausible`) and this
router's measured overhead of the remote road per prefill (`hop_s`: a remote first token's
latency less its prefill's compute):
    remote = hop_s + (queue + 1) x uncached_remote / prefill_rate
    local  = ceil(n / chunk) x step_s + n / local_rate    (n: what the decode's prefix cache lacks)
A local prefill takes at most `chunk` positions per decode step, so running streams wait one
chunk per step while it lasts: with requests running, `auto` computes locally only a prompt of
one chunk or less. Until the rates are reported `auto` pushes; an unreported local rate is taken
to be the prefill's (the same model). With no prefill left, `auto` and `never` compute locally.
Full account: docs/roles.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve_common.membership import Member

POLICIES = ("always", "never", "auto")
DEFAULT_POLICY = "auto"
HOP_WEIGHT = 0.2  # EWMA weight of the newest remote request's measured overhead
# The band of prompt tokens per second a reported rate is read within (below: not measured).
MIN_TOKENS_PER_S, MAX_TOKENS_PER_S = 1.0, 10_000_000.0


@dataclass(frozen=True)
class Road:
    """One request as the choice sees it."""

    tokens: int  # the prompt's tokens (a resumed request's streamed ones included)
    resumed: bool  # it has streamed tokens: its KV must come from a prefill (their draws are the prefill's)
    prompt_logprobs: bool  # the prefill's reply carries them
    shared_blocks: int = 0  # blocks of its grant another copy already holds (pushed around, not computed)
    copies: int = 0  # later copies of its prompt (n > 1) that will share its blocks: those must be whole at commit
    decode_cached: int = 0  # leading tokens the decode's prefix cache holds (neither pushed nor computed)


@dataclass(frozen=True)
class Choice:
    local: bool
    reason: str  # for the span and the log: "policy", "cheaper", "running", "unmeasured", "unable", "no_prefill"
    remote_s: float | None = None
    local_s: float | None = None


class Disaggregation:
    """The router's one chooser (per PDBackend): the policy, and the measured remote overhead."""

    def __init__(self, policy: str = DEFAULT_POLICY) -> None:
        if policy not in POLICIES:
            raise ValueError(f"disaggregation must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.hop_s: dict[str, float] = {}  # per prefill: the remote road's measured overhead (absent: not yet)

    def can_be_local(self, road: Road, decode: Member) -> bool:
        return (
            decode.info.local_prefill
            and not road.resumed
            and not road.prompt_logprobs
            and road.shared_blocks == 0
            and road.copies == 0
            and self.policy != "always"
        )

    def choose(
        self, road: Road, decode: Member, prefill: Member | None, cached_remote: int, queue: int, running: int
    ) -> Choice:
        """Local or remote for `road` on the reserved `decode` (`running`: the requests it has, by
        its report or this router's count, whichever is larger); `prefill` None: none is left."""
        if not self.can_be_local(road, decode):
            return Choice(False, "unable" if self.policy != "always" else "policy")
        if prefill is None:
            return Choice(True, "no_prefill")
        if self.policy == "never":
            return Choice(True, "policy")
        rate = plausible(prefill.load.prefill_tokens_per_s)
        step_s = decode.load.step_seconds
        if rate <= 0 or step_s <= 0:
            return Choice(False, "unmeasured")
        local_rate = plausible(decode.load.prefill_tokens_per_s) or rate
        chunk = max(decode.info.prefill_chunk_tokens, 1)
        n = max(road.tokens - road.decode_cached, 1)  # what the decode would compute
        if running > 0 and n > chunk:
            return Choice(False, "running")
        uncached = max(road.tokens - cached_remote, 1)
        remote = self.hop_s.get(prefill.worker_id, 0.0) + (queue + 1) * uncached / rate
        local = math.ceil(n / chunk) * step_s + n / local_rate
        return Choice(local < remote, "cheaper", remote, local)

    def observe_remote(self, first_token_s: float, uncached: int, queue: int, prefill: Member) -> None:
        """A remote request's first token came `first_token_s` after its calls went out: what
        its prefill's compute (and queue, as `choose` estimates it) does not explain is the
        remote road's overhead."""
        rate = plausible(prefill.load.prefill_tokens_per_s)
        if rate <= 0 or not math.isfinite(first_token_s):
            return
        hop = max(first_token_s - (queue + 1) * uncached / rate, 0.0)
        old = self.hop_s.get(prefill.worker_id)
        self.hop_s[prefill.worker_id] = hop if old is None else (1 - HOP_WEIGHT) * old + HOP_WEIGHT * hop

    def forget(self, worker_id: str) -> None:
        """A prefill left the membership: its measured overhead goes with it."""
        self.hop_s.pop(worker_id, None)


def plausible(rate: float) -> float:
    """A reported rate clamped to what a worker can do (tokens/s): a worker's misreport moves
    the choice for its own requests only as far as this band lets it."""
    return min(max(rate, 0.0), MAX_TOKENS_PER_S) if rate >= MIN_TOKENS_PER_S else 0.0
