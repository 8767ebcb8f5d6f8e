"""The routers: their Service, API keys and admission queue."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from pdserve_common import pod_env as E
from pdserve_operator.spec.base import DNS_LABEL, DNS_SUBDOMAIN, Model, Rule
from pdserve_operator.spec.pods import PodOverrides


class RouterServiceSpec(Model):
    """The Service in front of the routers."""

    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field("ClusterIP", description="Service type.")
    port: int = Field(8000, ge=1, le=65535, description="Service port of the OpenAI-compatible API.")
    node_port: int | None = Field(None, ge=30000, le=32767, description="Fixed node port (NodePort or LoadBalancer).")

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="!has(self.nodePort) || self.type != 'ClusterIP'",
            message="nodePort needs type NodePort or LoadBalancer",
            holds=lambda s: s.node_port is None or s.type != "ClusterIP",
            field="nodePort",
        ),
    )


class RouterAuthSpec(Model):
    """API keys on the OpenAI endpoint (docs/admission.md)."""

    secret_name: str = Field(
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN,
        description=(
            "Secret whose keys.yaml lists the tenants, their keys (or their SHA-256 digests) and optional "
            "limits: requestsPerMinute, tokensPerMinute, maxConcurrent, maxConcurrentGrammars, maxPriority, weight. "
            "Requests need "
            "'Authorization: Bearer KEY' (401 otherwise). Routers re-read it when it changes: rotating a "
            "key needs no restart."
        ),
    )


class RouterAdmissionSpec(Model):
    """The routers' admission queue: requests wait here for a KV reservation (docs/admission.md)."""

    queue_size: int = Field(
        1024,
        ge=1,
        le=1_000_000,
        description="Requests that may wait per router; past it, 429 with Retry-After from the measured drain rate.",
    )
    per_tenant: int = Field(256, ge=1, le=1_000_000, description="Of those, how many one tenant may hold.")
    deadline_seconds: int = Field(
        60,
        ge=1,
        le=86_400,
        description=(
            "Longest a request waits for admission; a request may shorten it with the x-pdserve-deadline-ms "
            "header. One the measured drain rate cannot admit in time is answered 429 at once."
        ),
    )


# The pods' own ports (pdserve_common/pod_env.py): an endpoint picker may not take one.
POD_PORTS = frozenset({E.HTTP_PORT, E.GRPC_PORT, E.TRANSFER_PORT, E.ADMIN_PORT})


class InferenceObjectiveSpec(Model):
    """One InferenceObjective of the pool: a class of requests with its priority (docs/gateway.md)."""

    name: str = Field(
        max_length=63,
        pattern=DNS_LABEL,
        description="The objective is named SERVICE-NAME; requests name it in the x-gateway-inference-objective header.",
    )
    priority: int = Field(
        0,
        ge=-(2**31),
        le=2**31 - 1,
        description="Higher is served first when the gateway's flow control must queue; negative allowed.",
    )


class InferencePoolSpec(Model):
    """An InferencePool (Gateway API Inference Extension, inference.networking.k8s.io/v1) of the routers."""

    enabled: bool = Field(
        False,
        description="Render an InferencePool named like the service, selecting its routers, and a Service NAME-epp "
        "for their endpoint pickers (needs endpointPickerPort and the InferencePool CRD; docs/gateway.md).",
    )
    failure_mode: Literal["FailOpen", "FailClose"] = Field(
        "FailOpen",
        description="What the gateway does when the picker does not answer: FailOpen sends the request to any "
        "router of the pool (each serves it fully; only prefix affinity is lost), FailClose answers 5xx.",
    )
    objectives: list[InferenceObjectiveSpec] = Field(
        default_factory=list,
        max_length=16,
        description="InferenceObjectives of the pool, each named SERVICE-NAME (group from the operator's chart "
        "value inferencePool.objectiveApiVersion: llm-d.ai/v1alpha2, or inference.networking.x-k8s.io/v1alpha2).",
    )

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="!has(self.objectives) || self.objectives.all(a, self.objectives.exists_one(b, b.name == a.name))",
            message="objectives: each name once",
            holds=lambda p: len({o.name for o in p.objectives}) == len(p.objectives),
            field="objectives",
        ),
        Rule(
            cel="!has(self.objectives) || size(self.objectives) == 0 || self.enabled",
            message="objectives need enabled: an InferenceObjective names the pool",
            holds=lambda p: not p.objectives or p.enabled,
            field="objectives",
        ),
    )


class RouterSpec(PodOverrides):
    """Routers: the OpenAI-compatible HTTP front."""

    replicas: int = Field(1, ge=0, le=1024, description="Number of router pods.")
    disaggregation: Literal["always", "never", "auto"] = Field(
        "auto",
        description="Per request, a prefill pushes the prompt's KV into the decode (always), the decode computes "
        "it itself, a chunk between its decode steps (never), or whichever the workers' reported costs say "
        "gives the first token sooner (auto; docs/roles.md). Resumed requests and those asking for prompt "
        "logprobs always go to a prefill.",
    )
    service: RouterServiceSpec = Field(default_factory=RouterServiceSpec, description="The router Service.")
    auth: RouterAuthSpec | None = Field(None, description="API keys (no authentication when unset).")
    admission: RouterAdmissionSpec = Field(
        default_factory=RouterAdmissionSpec,
        description="Admission queue; each tenant's limits are shared out among the router replicas.",
    )
    endpoint_picker_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Serve the Gateway API Inference Extension's endpoint picker (Envoy ext_proc) on this port of "
        "every router, for an InferencePool of the routers (docs/gateway.md); the service's NetworkPolicy opens it "
        "like the API port. Not one of the pods' own ports. Unset: none.",
    )
    inference_pool: InferencePoolSpec = Field(
        default_factory=InferencePoolSpec, description="Render the InferencePool of the routers (docs/gateway.md)."
    )

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel=f"!has(self.endpointPickerPort) || !(self.endpointPickerPort in {sorted(POD_PORTS)})",
            message=f"endpointPickerPort: the pods' own ports {sorted(POD_PORTS)} are taken (and the gRPC and "
            "transfer ports must stay closed to other namespaces)",
            holds=lambda r: r.endpoint_picker_port not in POD_PORTS,
            field="endpointPickerPort",
        ),
        Rule(
            cel="!self.inferencePool.enabled || has(self.endpointPickerPort)",
            message="inferencePool.enabled needs endpointPickerPort: the pool's picker is the routers' ext_proc port",
            holds=lambda r: not r.inference_pool.enabled or r.endpoint_picker_port is not None,
            field="inferencePool",
        ),
    )
