"""handlers.register: what kopf is asked to watch, per the operator's config.

LeaderWorkerSets are watched only when asked (PDSERVE_OPERATOR_WATCH_LEADER_WORKER_SETS, set by
the chart's leaderWorkerSet.enabled, which also grants list/watch on them): kopf lists and
watches every resource a handler names, so an unconditional watch would hit 403s in every
cluster whose operator was not granted LWS."""

from __future__ import annotations

import kopf
import pytest

from pdserve_operator import handlers
from pdserve_operator import spec as s


def watched(registry: kopf.OperatorRegistry) -> set[tuple[str, str, str | None]]:
    return {(h.selector.group, h.selector.version, h.selector.any_name) for h in registry._watching.get_all_handlers()}


@pytest.mark.parametrize("lws", [False, True])
def test_children_are_watched_and_leader_worker_sets_only_when_asked(lws: bool) -> None:
    registry = handlers.register(kopf.OperatorRegistry(), watch_leader_worker_sets=lws)
    assert set(handlers.CHILD_RESOURCES) <= watched(registry)
    assert (handlers.LWS_RESOURCE in watched(registry)) is lws
    # The service's own handlers are there either way: resume (kopf's reason None), create,
    # update and delete, and the resync timer.
    changing = {(h.selector.any_name, h.id, h.reason) for h in registry._changing.get_all_handlers()}
    assert changing == {
        (s.PLURAL, "reconcile_service", None),
        (s.PLURAL, "reconcile_service", "create"),
        (s.PLURAL, "reconcile_service", "update"),
        (s.PLURAL, "forget_service", "delete"),
    }
    assert [(h.selector.any_name, h.id) for h in registry._spawning.get_all_handlers()] == [(s.PLURAL, "resync")]


def test_two_registries_do_not_share_handlers() -> None:
    """Each operator run gets its own registry: one run's LWS watch never leaks into another's."""
    with_lws = handlers.register(kopf.OperatorRegistry(), watch_leader_worker_sets=True)
    without = handlers.register(kopf.OperatorRegistry(), watch_leader_worker_sets=False)
    assert handlers.LWS_RESOURCE in watched(with_lws) and handlers.LWS_RESOURCE not in watched(without)
