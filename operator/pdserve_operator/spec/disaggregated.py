"""spec.workload and spec.disaggregatedSet: which objects run prefill and decode.

`Deployments` (the default): a prefill Deployment and a decode StatefulSet (or LeaderWorkerSet
with decode.groupScheduling leaderWorkerSet). `LeaderWorkerSet`: the same with the decode groups
as a LeaderWorkerSet. `DisaggregatedSet` (sigs.k8s.io/lws, disaggregatedset.x-k8s.io/v1): prefill
and decode as the roles of one DisaggregatedSet, each role an LWS template, in `slices` complete
copies that roll out one at a time, placed by `placement` (docs/gang-scheduling.md). An
autoscaled role (driver hpa, one slice) is `External`: its HPA scales the role's upstream
DisaggregatedSetRoleScaler.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from pdserve_operator.spec.base import Model, Rule

Workload = Literal["Deployments", "LeaderWorkerSet", "DisaggregatedSet"]


class DisaggregatedSetSpec(Model):
    """The DisaggregatedSet of spec.workload DisaggregatedSet."""

    slices: int = Field(
        1,
        ge=1,
        le=100,
        description="Complete copies of prefill and decode, each rolled out on its own; prefill.replicas and "
        "decode.replicas are totals over the slices (each a multiple of slices).",
    )
    placement: Literal["None", "ExclusiveSlice", "ExclusiveTopology"] = Field(
        "None",
        description="Keep a slice's prefill and decode pods in one domain of topologyKey (so the KV push stays on "
        "that domain's links): ExclusiveSlice spreads this service's slices over domains, ExclusiveTopology also "
        "keeps other DisaggregatedSets out of a slice's domain.",
    )
    topology_key: str | None = Field(
        None,
        min_length=1,
        max_length=316,
        description="The node label whose value names a domain (e.g. a rack or NVLink-domain label).",
    )

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="self.placement == 'None' || has(self.topologyKey)",
            message="placement needs topologyKey: the node label that names a domain",
            holds=lambda d: d.placement == "None" or d.topology_key is not None,
            field="topologyKey",
        ),
    )


def _ds(s: object) -> bool:
    return getattr(s, "workload", None) == "DisaggregatedSet"


def _role_scaler_fits(s: Any) -> bool:
    enabled = [getattr(s.autoscaling, role) for role in ("prefill", "decode") if getattr(s.autoscaling, role).enabled]
    return all(r.driver == "hpa" for r in enabled) and (not enabled or s.disaggregated_set.slices == 1)


# Rules of the whole spec (PDInferenceServiceSpec.rules) that the DisaggregatedSet option brings.
WORKLOAD_RULES: tuple[Rule, ...] = (
    Rule(
        cel="self.workload != 'DisaggregatedSet' || self.decode.groupScheduling == 'statefulSet'",
        message="decode.groupScheduling leaderWorkerSet goes with workload Deployments or LeaderWorkerSet: "
        "a DisaggregatedSet's decode role is a LeaderWorkerSet already",
        holds=lambda s: not _ds(s) or s.decode.group_scheduling == "statefulSet",
        field="decode.groupScheduling",
    ),
    Rule(
        cel="self.workload != 'DisaggregatedSet' || !has(self.autoscaling) || "
        "((!self.autoscaling.prefill.enabled || self.autoscaling.prefill.driver == 'hpa') && "
        "(!self.autoscaling.decode.enabled || self.autoscaling.decode.driver == 'hpa') && "
        "(self.disaggregatedSet.slices == 1 || (!self.autoscaling.prefill.enabled && !self.autoscaling.decode.enabled)))",
        message="workload DisaggregatedSet: a role autoscales only with driver hpa (its HPA scales the role's "
        "DisaggregatedSetRoleScaler) and only with slices 1 (upstream cannot combine slices with per-role scaling, "
        "lws #948); otherwise scale a role with kubectl scale pdsa/NAME-ROLE",
        holds=lambda s: not _ds(s) or s.autoscaling is None or _role_scaler_fits(s),
        field="autoscaling",
    ),
    Rule(
        cel="self.workload != 'DisaggregatedSet' || (self.prefill.replicas % self.disaggregatedSet.slices == 0 "
        "&& self.decode.replicas % self.disaggregatedSet.slices == 0)",
        message="workload DisaggregatedSet: prefill.replicas and decode.replicas are totals over the slices, "
        "each a multiple of disaggregatedSet.slices",
        holds=lambda s: (
            not _ds(s)
            or (
                s.prefill.replicas % s.disaggregated_set.slices == 0
                and s.decode.replicas % s.disaggregated_set.slices == 0
            )
        ),
        field="disaggregatedSet.slices",
    ),
    Rule(
        cel="self.workload != 'DisaggregatedSet' || (self.prefill.replicas == 0) == (self.decode.replicas == 0)",
        message="workload DisaggregatedSet: prefill and decode scale to zero together (the DisaggregatedSet's "
        "own rule: all roles' replicas zero, or none)",
        holds=lambda s: not _ds(s) or (s.prefill.replicas == 0) == (s.decode.replicas == 0),
        field="prefill.replicas",
    ),
)
