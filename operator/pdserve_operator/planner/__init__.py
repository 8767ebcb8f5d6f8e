"""The planner: a performance model of PD serving and the replica decisions built on it.

Pure functions and frozen data only (no torch, no worker package, no I/O beyond a profile or
config file the caller names), so the operator, `pdserve plan` and the benchmarks run the same
model: `model_shape` (a decoder's geometry → bytes and FLOPs), `profile` (a hardware profile),
`workload` (arrival rate, length distributions, SLO), `perf` (model × profile → prefill and
decode step seconds), `queueing` (M/G/c prefill waits, the decode batch distribution),
`predict` ((P, D) → predicted TTFT/TPOT, utilisation, KV occupancy), `decide` (the smallest
(P, D) that meets the SLOs within bounds and a P:D band), `controller` (one step of the
stateful autoscaler, pure) and `simulate` (a discrete-event simulation of the same system).
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
