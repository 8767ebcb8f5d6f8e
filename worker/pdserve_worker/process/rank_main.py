"""A tensor-parallel instance's rank past 0, as a process: `python -m pdserve_worker.process.rank_main`.

Rank 0 starts it (ranks/processes.py) with the pod's environment plus its rank and the group's
rendezvous; it joins the group, loads its share of the model, warms up and follows rank 0's
passes (ranks/prefill.py) or steps (ranks/decode.py) until rank 0 stops it or the group breaks.
"""

from __future__ import annotations

import logging
import sys

from pdserve_common.logs import kv
from pdserve_worker.ranks.processes import bind_device, group_spec
from pdserve_worker.serving.settings import WorkerSettings

log = logging.getLogger(__name__)


def run_follower() -> int:
    """A rank past 0, from start to stop: join, load its share, warm up, follow rank 0's passes."""
    from pdserve_common import logs
    from pdserve_worker.decode.migration import MigrationPusher
    from pdserve_worker.process.startup import load_model_engine, start_engine
    from pdserve_worker.ranks.decode import DecodeFollower
    from pdserve_worker.ranks.group import GroupError, TPGroup
    from pdserve_worker.ranks.prefill import FollowerRank
    from pdserve_worker.serving.gc_heap import freeze_startup_heap
    from pdserve_worker.serving.torch_threads import serve_with
    from pdserve_worker.util import stack_dump

    stack_dump.install()
    settings = WorkerSettings()
    logs.setup(f"{settings.role}:{settings.member_id}:rank{settings.tp_rank}")
    serve_with(settings.torch_threads)
    bind_device(settings)
    group = TPGroup(group_spec(settings))
    rank: FollowerRank | DecodeFollower | None = None
    backend = None
    try:
        tp = (settings.tensor_parallel, settings.tp_rank)
        engine = load_model_engine(settings, tp=tp, reduce=group.all_reduce)
        engine.warm_up()  # (rank 0 warms up too: the collectives match)
        backend = start_engine(settings)
        if settings.role == "decode":
            rank = DecodeFollower(settings, engine, backend, group, MigrationPusher)
        else:
            rank = FollowerRank(settings, engine, backend, group)
        freeze_startup_heap()  # (serving/gc_heap.py)
        rank.serve()
        return 0
    except (GroupError, RuntimeError, ValueError) as exc:  # (rank 0 fails the same way and says why)
        log.error(kv(event="tp_rank_failed", rank=settings.tp_rank, error=str(exc)))
        return 1
    finally:
        if rank is not None:
            rank.close()
        if backend is not None:
            backend.engine.finalize()
        if rank is not None:
            rank.free()
        group.close()


if __name__ == "__main__":
    sys.exit(run_follower())
