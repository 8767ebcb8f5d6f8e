"""The planner: a performance model of PD serving and the replica decisions built on it.

Pure functions and frozen data only — no torch, no worker package, no I/O beyond reading a
profile or config file that the caller names — so the operator, `pdserve plan` and the
benchmarks all run the same model:

- `model_shape`: a decoder's geometry (from an HF config.json or a built-in) → bytes and FLOPs.
- `profile`: a hardware profile (FLOP/s, memory and link bandwidth, overheads), YAML/JSON.
- `workload`: arrival rate, prompt/output length distributions, SLO targets.
- `perf`: model × profile → prefill seconds for a prompt, decode step seconds for a batch.
- `queueing`: M/G/c prefill waits (Allen–Cunneen, exact P–K at c=1), decode batch fixed point.
- `predict`: (P, D) → predicted TTFT/TPOT, utilisation, KV occupancy.
- `decide`: the smallest (P, D) that meets the SLOs within bounds and a P:D band.
- `controller`: one step of the stateful autoscaler (stabilisation windows), pure.
- `simulate`: a discrete-event simulation of the same system, for traces and benchmarks.
"""

from pdserve_operator.planner.controller import (
    ControllerConfig,
    Observation,
    PlannerState,
    RoleDecision,
    StepResult,
    WorkerLoad,
    controller_step,
)
from pdserve_operator.planner.decide import Bounds, Plan, plan_replicas
from pdserve_operator.planner.model_shape import ModelShape
from pdserve_operator.planner.perf import ServingModel
from pdserve_operator.planner.predict import Prediction, predict
from pdserve_operator.planner.profile import HardwareProfile, bundled_profile, load_profile
from pdserve_operator.planner.workload import SLO, LengthDistribution, Workload

__all__ = [
    "SLO",
    "Bounds",
    "ControllerConfig",
    "HardwareProfile",
    "LengthDistribution",
    "ModelShape",
    "Observation",
    "Plan",
    "PlannerState",
    "Prediction",
    "RoleDecision",
    "ServingModel",
    "StepResult",
    "WorkerLoad",
    "Workload",
    "bundled_profile",
    "controller_step",
    "load_profile",
    "plan_replicas",
    "predict",
]
