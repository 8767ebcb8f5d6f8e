"""A discrete-event simulation of a PD deployment, driven by the same service-time model.

The analytic prediction (`predict`) is for steady Poisson load; a given trace or a day of
changing load with replicas coming and going needs the system itself. The simulation follows
pdserve's request road: a slot on the decode with the most free slots, the prompt to the
prefill with the shortest queue, one prompt at a time per prefill, continuous-batching decode
steps of `ServingModel.decode_step_seconds(B, context)`. Decode steps are simulated in runs
between changes of the batch (closed form), so a simulated day is seconds of CPU. Replicas can
be added (ready after `startup_s`) and removed (a draining replica takes no new work and leaves
when idle); replica-seconds count from creation to exit. The model in detail: docs/planner.md.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

from pdserve_operator.planner.perf import ServingModel


@dataclass
class SimRequest:
    arrival: float
    prompt: int
    output: int
    first_token: float | None = None
    done: float | None = None
    overhead: float = 0.0  # request overhead added to TTFT (routing, RPCs)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival + self.overhead

    @property
    def tpot(self) -> float | None:
        if self.done is None or self.first_token is None or self.output < 2:
            return None
        return (self.done - self.first_token) / (self.output - 1)


@dataclass
class _Server:
    role: str
    index: int
    created: float
    ready_at: float
    draining: bool = False
    removed: float | None = None

    def is_ready(self, now: float) -> bool:
        return self.removed is None and not self.draining and now >= self.ready_at


@dataclass
class _Prefill(_Server):
    queue: deque[tuple[SimRequest, _Decode]] = field(default_factory=deque)
    busy_until: float | None = None

    @property
    def load(self) -> int:
        return len(self.queue) + (self.busy_until is not None)


@dataclass
class _Seq:
    request: SimRequest
    remaining: int  # decode steps still to run
    context: int  # positions the next step attends to


@dataclass
class _Decode(_Server):
    capacity: int | None = None
    reserved: int = 0  # slots held: reserved for a prefill in flight, pending or active
    active: list[_Seq] = field(default_factory=list)
    pending: list[SimRequest] = field(default_factory=list)
    context: int = 0  # Σ context of active
    run_start: float = 0.0
    run_steps: int = 0
    run_a: float = 0.0
    run_b: float = 0.0
    run_version: int = 0
    running: bool = False

    def free(self) -> float:
        return math.inf if self.capacity is None else self.capacity - self.reserved

    def end_of(self, k: int) -> float:
        return self.run_start + k * self.run_a + self.run_b * k * (k - 1) / 2


class Simulation:
    def __init__(self, model: ServingModel, prefill: int, decode: int, *, startup_s: float = 0.0) -> None:
        self.model = model
        self.startup_s = startup_s
        self.now = 0.0
        self._events: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self.prefills: list[_Prefill] = []
        self.decodes: list[_Decode] = []
        self.waiting: deque[SimRequest] = deque()  # no free decode slot yet
        self.requests: list[SimRequest] = []
        self.completed: list[SimRequest] = []  # in the order they finished (what a router observes)
        for _ in range(prefill):
            self._add("prefill", ready_at=0.0)
        for _ in range(decode):
            self._add("decode", ready_at=0.0)

    # ---- replicas ------------------------------------------------------------------------------

    def _add(self, role: str, ready_at: float) -> None:
        server: _Server
        if role == "prefill":
            server = _Prefill("prefill", len(self.prefills), self.now, ready_at)
            self.prefills.append(server)
        else:
            server = _Decode("decode", len(self.decodes), self.now, ready_at, capacity=self.model.decode_capacity)
            self.decodes.append(server)
        if ready_at > self.now:
            self._push(ready_at, "ready", server)

    def live(self, role: str) -> list[_Server]:
        """Replicas that count toward the desired number: starting or ready, not draining."""
        servers = self.prefills if role == "prefill" else self.decodes
        return [s for s in servers if s.removed is None and not s.draining]

    def scale_to(self, role: str, count: int) -> None:
        live = self.live(role)
        for _ in range(count - len(live)):
            self._add(role, ready_at=self.now + self.startup_s)
        if count < len(live):
            # Starting ones first (nothing to drain), then the least loaded.
            def key(s: _Server) -> tuple[bool, int, int]:
                load = s.load if isinstance(s, _Prefill) else cast(_Decode, s).reserved
                return (s.ready_at <= self.now, load, -s.index)

            for server in sorted(live, key=key)[: len(live) - count]:
                server.draining = True
                self._maybe_remove(server)

    def _maybe_remove(self, server: _Server) -> None:
        if not server.draining or server.removed is not None:
            return
        idle = server.load == 0 if isinstance(server, _Prefill) else cast(_Decode, server).reserved == 0
        if idle:
            server.removed = self.now

    def replica_seconds(self, role: str | None = None, until: float | None = None) -> float:
        end = self.now if until is None else until
        servers = [s for s in self.prefills + self.decodes if role is None or s.role == role]
        return sum((end if s.removed is None else min(s.removed, end)) - s.created for s in servers)

    # ---- events --------------------------------------------------------------------------------

    def _push(self, at: float, kind: str, payload: object) -> None:
        heapq.heappush(self._events, (at, next(self._seq), kind, payload))

    def submit(self, requests: Iterable[SimRequest]) -> None:
        for r in requests:
            r.overhead = self.model.profile.request_overhead_s
            self.requests.append(r)
            self._push(r.arrival, "arrive", r)

    def run(self, until: float = math.inf) -> None:
        while self._events and self._events[0][0] <= until:
            at, _, kind, payload = heapq.heappop(self._events)
            self.now = at
            getattr(self, f"_on_{kind}")(payload)
        if math.isfinite(until):
            self.now = max(self.now, until)

    def _on_ready(self, server: _Server) -> None:
        self._admit_waiting()
        if isinstance(server, _Prefill):
            self._start_prefill(server)

    def _on_arrive(self, request: SimRequest) -> None:
        self.waiting.append(request)
        self._admit_waiting()

    def _admit_waiting(self) -> None:
        while self.waiting:
            decodes = [d for d in self.decodes if d.is_ready(self.now) and d.free() > 0]
            prefills = [p for p in self.prefills if p.is_ready(self.now)]
            if not decodes or not prefills:
                return
            request = self.waiting.popleft()
            decode = min(decodes, key=lambda d: (-d.free(), d.reserved, d.index))
            decode.reserved += 1
            prefill = min(prefills, key=lambda p: (p.load, p.index))
            prefill.queue.append((request, decode))
            self._start_prefill(prefill)

    def _start_prefill(self, prefill: _Prefill) -> None:
        if prefill.busy_until is not None or not prefill.queue or prefill.removed is not None:
            return
        request, decode = prefill.queue[0]
        prefill.busy_until = self.now + self.model.prefill_service_seconds(request.prompt)
        self._push(prefill.busy_until, "prefilled", prefill)

    def _on_prefilled(self, prefill: _Prefill) -> None:
        request, decode = prefill.queue.popleft()
        prefill.busy_until = None
        self._join(decode, request)
        self._start_prefill(prefill)
        self._maybe_remove(prefill)

    # ---- decode runs -----------------------------------------------------------------------------

    def _join(self, decode: _Decode, request: SimRequest) -> None:
        if not decode.running:
            self._dispatch(decode, request)
            self._start_run(decode)
            return
        decode.pending.append(request)
        k = self._boundary_after(decode, self.now)
        if k < decode.run_steps:  # cut the run at the next step boundary
            decode.run_steps = k
            decode.run_version += 1
            self._push(decode.end_of(k), "run_end", (decode, decode.run_version))

    def _boundary_after(self, decode: _Decode, t: float) -> int:
        """The smallest k >= 1 whose step ends at or after t (at most the run's length)."""
        lo, hi = 1, decode.run_steps
        while lo < hi:
            mid = (lo + hi) // 2
            if decode.end_of(mid) >= t:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _dispatch(self, decode: _Decode, request: SimRequest) -> None:
        """The first token goes out now; the request joins the batch (or is done at once)."""
        request.first_token = self.now
        steps = request.output - 1
        if steps <= 0:
            request.done = self.now
            self.completed.append(request)
            decode.reserved -= 1
            self._after_free(decode)
            return
        decode.active.append(_Seq(request, steps, request.prompt + 1))
        decode.context += request.prompt + 1

    def _start_run(self, decode: _Decode) -> None:
        if not decode.active:
            decode.running = False
            return
        batch = len(decode.active)
        decode.running = True
        decode.run_start = self.now
        decode.run_steps = min(s.remaining for s in decode.active)
        a = self.model.decode_step_seconds(batch, decode.context)
        decode.run_a = a
        decode.run_b = self.model.decode_step_seconds(batch, decode.context + batch) - a
        decode.run_version += 1
        self._push(decode.end_of(decode.run_steps), "run_end", (decode, decode.run_version))

    def _on_run_end(self, payload: tuple[_Decode, int]) -> None:
        decode, version = payload
        if version != decode.run_version:
            return  # a run that was cut short
        n = decode.run_steps
        keep = []
        for seq in decode.active:
            seq.remaining -= n
            seq.context += n
            if seq.remaining <= 0:
                seq.request.done = self.now
                self.completed.append(seq.request)
                decode.reserved -= 1
                decode.context -= seq.context - n
            else:
                keep.append(seq)
        decode.context += n * len(keep)
        decode.active = keep
        pending, decode.pending = decode.pending, []
        for request in pending:
            self._dispatch(decode, request)
        self._start_run(decode)
        self._after_free(decode)

    def _after_free(self, decode: _Decode) -> None:
        self._maybe_remove(decode)
        if self.waiting:
            self._admit_waiting()

    # ---- what a router and the broker would report ------------------------------------------------

    def loads(self) -> list[tuple[str, str, int, int]]:
        """(worker id, role, active requests, slots used) of every ready replica."""
        rows = []
        for p in self.prefills:
            if p.removed is None and self.now >= p.ready_at:
                rows.append((f"prefill-{p.index}", "prefill", p.load, 0))
        for d in self.decodes:
            if d.removed is None and self.now >= d.ready_at:
                rows.append((f"decode-{d.index}", "decode", len(d.active), d.reserved))
        return rows


def simulate_trace(model: ServingModel, requests: Iterable[SimRequest], prefill: int, decode: int) -> list[SimRequest]:
    """Replay a trace on a fixed (P, D) until every request is done."""
    sim = Simulation(model, prefill, decode)
    reqs = list(requests)
    sim.submit(reqs)
    sim.run()
    return reqs
