"""The PD router's prefill choice: the prefill it predicts holds the prompt's longest prefix,
within the balance bound; a prefill that leaves the membership is forgotten."""

from __future__ import annotations

import random
from types import SimpleNamespace

from pdserve_common.membership import EventType, Load, Member, MemberEvent, MemberInfo, Role
from pdserve_worker.api.metrics import RouterMetrics
from pdserve_worker.router.config import RouterConfig
from pdserve_worker.router.pd_backend import PDBackend

REV = "r1"
SCOPE = '["anonymous",""]'


def prefill(worker_id: str, queued: int = 0) -> Member:
    return Member(
        MemberInfo(worker_id=worker_id, role=Role.PREFILL, grpc_endpoint=f"{worker_id}:1", revision=REV),
        load=Load(active_requests=queued),
    )


def backend(members: list[Member], **kw) -> PDBackend:
    pd = PDBackend(
        RouterConfig(
            model_name="m",
            max_model_len=4096,
            revision=REV,
            token="t",
            **kw,
        ),
        tokenizer=None,
        broker=None,
        metrics=RouterMetrics(),
    )
    pd.members._view = SimpleNamespace(members={m.worker_id: m for m in members}, connected=True)
    return pd


def test_interleaved_system_prompts_stay_on_their_prefill_and_the_load_stays_even() -> None:
    pd = backend([prefill("p0"), prefill("p1")])
    rng = random.Random(1)
    systems = [[1000 * s + i for i in range(1500)] for s in range(4)]
    home: dict[int, set[str]] = {}
    served = {"p0": 0, "p1": 0}
    hits = repeats = 0
    for _ in range(60):
        s = rng.randrange(4)
        tokens = systems[s] + [rng.randrange(30_000) for _ in range(rng.randrange(10, 200))]
        chosen = pd.members.pick_prefill({}, tokens, SCOPE).worker_id
        if s in home:
            repeats += 1
            hits += chosen in home[s]
        home.setdefault(s, set()).add(chosen)
        served[chosen] += 1
    assert hits / repeats >= 0.9
    assert max(served.values()) <= 2 * min(served.values())
    exposition = pd._metrics.exposition().decode()
    assert 'pdserve_router_prefix_routed_total{reason="prefix"}' in exposition


def test_a_busy_holder_loses_the_request_and_a_departed_one_is_forgotten() -> None:
    members = [prefill("p0"), prefill("p1")]
    pd = backend(members)
    prompt = list(range(400))
    first = pd.members.pick_prefill({}, prompt, SCOPE).worker_id
    assert pd.members.pick_prefill({}, prompt + [7], SCOPE).worker_id == first
    # The holder's queue grows past the bound: the other one takes it.
    pd.members._view.members[first] = prefill(first, queued=9)
    other = pd.members.pick_prefill({}, prompt + [8], SCOPE).worker_id
    assert other != first
    pd.members._view.members[first] = prefill(first)
    pd.members.on_member(MemberEvent(EventType.REMOVED, pd.members._view.members[other]))
    assert pd.members.prefixes.size(other) == 0 and pd.members.prefixes.size(first) > 0


def test_prefix_routing_off_is_the_shortest_queue() -> None:
    pd = backend([prefill("p0", queued=3), prefill("p1", queued=1)], prefix_history_blocks=0)
    assert pd.members.pick_prefill({}, list(range(100)), SCOPE).worker_id == "p1"


def test_the_prediction_is_per_scope() -> None:
    """Another tenant's prompt of the same tokens is predicted to be cached nowhere (the
    prefill would not find it): its choice is not a prefix hit, while the first tenant's is."""
    pd = backend([prefill("p0"), prefill("p1")])
    prompt = list(range(400))

    def prefix_routed() -> float:
        text = pd._metrics.exposition().decode()
        prefix = 'pdserve_router_prefix_routed_total{reason="prefix"}'
        line = next((x for x in text.splitlines() if x.startswith(prefix)), "")
        return float(line.split()[-1]) if line else 0.0

    pd.members.pick_prefill({}, prompt, '["a",""]')
    start = prefix_routed()
    pd.members.pick_prefill({}, prompt, '["b",""]')
    assert prefix_routed() == start  # b's is not a hit
    pd.members.pick_prefill({}, prompt, '["a",""]')
    assert prefix_routed() == start + 1  # a's repeat is
