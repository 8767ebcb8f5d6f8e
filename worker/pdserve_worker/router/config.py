"""What a router is configured with: its model, how it dials workers, its timeouts, prefix routing.

`RouterConfig` is PDBackend's one parameter object (settings.py fills it for the router role);
`Timeouts` bounds every call and wait of a request's road (pd_backend.py's docstring).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve_common.auth import TLSConfig
from pdserve_worker.router.prefix_routing import BalanceBound

# Where a router reads `Timeouts.return_wait_s` from (serving/settings.py): named in the error a
# request gets when it waited in vain.
RETURN_WAIT_SETTING = "PDSERVE_RETURN_WAIT_SECONDS"
PREFIX_HISTORY_BLOCKS = 16_384  # per prefill: 262,144 tokens of 16-token blocks (about 1 MB of hashes)


@dataclass(frozen=True)
class Timeouts:
    rpc_s: float = 5.0  # Reserve, Release
    lease_ms: int = 30_000  # a grant lapses if Generate has not claimed it by then
    readiness_ms: int = 300_000  # how long the decode waits for the KV (prefill queueing included)
    prefill_s: float = 600.0  # deadline of one Prefill call
    max_retries: int = 2  # a request survives this many failed decode or prefill workers
    resume_wait_s: float = 10.0  # how long a retry waits for a free slot before giving up
    # How long a request waits for a prefill (decode) to be registered when none is and none
    # left lately (a router that just started) before it is answered 503.
    member_wait_s: float = 10.0
    # How long a request waits when a worker of the role went away (killed, unreachable, or
    # left lately: restarting, the view refilling after a broker restart) and no other it may
    # use is left, for one to (re)join, the same one restarted included; then its error.
    return_wait_s: float = 60.0
    settle_s: float = 30.0  # how long an abandoned grant waits for the prefill to confirm its push ended


@dataclass(frozen=True)
class RouterConfig:
    """A router's settings. `token` and `tls`: how workers are dialled (settings.peer_tls);
    `prefix_history_blocks` 0 turns prefix-aware prefill choice off; `prefix_routing`: "events"
    (what the prefills report they hold, router/kv_index.py, the prediction only for a prefill
    that has not reported) or "predict" (the prediction alone)."""

    model_name: str
    max_model_len: int
    revision: str
    token: str
    timeouts: Timeouts = Timeouts()
    tls: TLSConfig | None = None
    prefix_history_blocks: int = PREFIX_HISTORY_BLOCKS
    prefix_block_tokens: int = 16
    balance: BalanceBound = BalanceBound()
    prefix_routing: str = "events"
    disaggregation: str = "auto"  # always | never | auto: router/disaggregation.py

    def __post_init__(self) -> None:
        if self.prefix_routing not in ("events", "predict"):
            raise ValueError(f"prefix_routing must be 'events' or 'predict', got {self.prefix_routing!r}")
