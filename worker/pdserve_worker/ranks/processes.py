"""The processes of a tensor-parallel instance: rank 0 starts the others, each runs one rank.

One rank = one process = one device, as vLLM and torchrun lay it out: rank 0 is `pdserve
worker` itself (the pod's command), and before it loads anything it starts ranks 1..N-1 as
`python -m pdserve_worker.process.rank_main`, same environment plus their rank and the group's
rendezvous, then joins the group with them. All ranks live in the pod, so the rendezvous is a
FileStore in a folder of rank 0's (no port to choose, nothing reachable from outside the pod);
on an accelerator each rank takes device `rank` of the N the pod asked for.

The others die with rank 0 (Linux's parent-death signal), and rank 0 ends them by PID when it
stops; a rank that exits on its own breaks the group's next collective, which ends rank 0 too
(ranks/prefill.py), so the instance restarts as one.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from pdserve_common.logs import kv
from pdserve_worker.ranks.group import GroupSpec
from pdserve_worker.serving import settings as S
from pdserve_worker.serving.settings import WorkerSettings
from pdserve_worker.util.children import die_with_parent
from pdserve_worker.util.free_ports import free_port
from pdserve_worker.util.stack_dump import dump_stacks_then_kill

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0


def bind_device(settings: WorkerSettings) -> None:
    """On an accelerator, make device `rank` of the pod's this process's current one: every
    tensor it makes on "cuda" or "npu" (weights, its KV pool) lands there."""
    import torch

    if settings.device == "cuda":
        torch.cuda.set_device(settings.tp_rank)
    elif settings.device == "npu":
        import torch_npu  # noqa: F401  (torch.npu is torch_npu's)

        torch.npu.set_device(settings.tp_rank)  # type: ignore[attr-defined]


def group_spec(settings: WorkerSettings) -> GroupSpec:
    return GroupSpec(
        settings.tensor_parallel, settings.tp_rank, settings.tp_address, settings.device, settings.tp_timeout_seconds
    )


@dataclass
class Ranks:
    """Rank 0's view of the others: their processes and the rendezvous folder."""

    address: str
    folder: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def stop(self) -> None:
        """End the other ranks by PID (SIGTERM, then SIGKILL), then remove the rendezvous."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning(kv(event="tp_rank_stuck", pid=proc.pid, timeout_s=STOP_TIMEOUT_S))
                dump_stacks_then_kill(proc)  # (its stacks go to this log: it shares our stderr)
        shutil.rmtree(self.folder, ignore_errors=True)


def start_ranks(settings: WorkerSettings) -> tuple[Ranks, WorkerSettings]:
    """Start ranks 1..N-1 of this instance; returns them and rank 0's settings (with the rendezvous)."""
    folder = Path(tempfile.mkdtemp(prefix="pdserve-tp-"))
    address = f"file://{folder / 'store'}"
    ranks = Ranks(address, folder)
    for rank in range(1, settings.tensor_parallel):
        env = {**os.environ, S.TP_RANK: str(rank), S.TP_ADDRESS: address}
        if settings.role == "decode":  # each rank's engine listens for the prefill's pushes
            env[S.TRANSFER_PORT_ENV] = str(free_port(settings.bind_host))
        ranks.procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "pdserve_worker.process.rank_main"],
                env=env,
                stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent if sys.platform == "linux" else None,
            )
        )
    log.info(kv(event="tp_ranks_started", size=settings.tensor_parallel, pids=[p.pid for p in ranks.procs]))
    return ranks, settings.model_copy(update={"tp_address": address})
