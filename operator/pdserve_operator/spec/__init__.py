"""PDInferenceService spec and status: the single source of truth for the custom resource.

The CRD's OpenAPI schema is generated from these models (`crd.py`), and the operator validates
every resource with them before reconciling. One module per sub-spec, as the resource nests
them: `base` (the resource's identity, `Model` and `Rule`), `pods` (what every role may
override), `model` (spec.model, spec.device), `roles` (spec.prefill, spec.decode), `transfer`,
`router`, `tls`, `autoscaling`, `observability`, `service` (the whole spec, its cross-role rules,
`parse_spec`) and `status`. A new field goes into its sub-spec's module; everything is also
importable from this package (`from pdserve_operator import spec as s; s.DecodeSpec`).
"""

from pydantic import ValidationError  # what parse_spec raises

from pdserve_operator.spec.autoscaling import (
    PLANNER_MODELS,
    PLANNER_PROFILES,
    AutoscalingSLO,
    AutoscalingSpec,
    HPAMetric,
    MetricTarget,
    RatioBand,
    RoleAutoscaling,
    planner_drives,
)
from pdserve_operator.spec.base import (
    API_VERSION,
    DNS_LABEL,
    DNS_SUBDOMAIN,
    GROUP,
    KIND,
    MAX_NAME_LENGTH,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    Model,
    Quantity,
    Rule,
)
from pdserve_operator.spec.model import BUILTIN_MODELS, BuiltinModel, DeviceSpec, ModelSpec
from pdserve_operator.spec.observability import ObservabilitySpec, TracingSpec
from pdserve_operator.spec.pods import EnvVar, PodOverrides, ResourceRequirements, Toleration
from pdserve_operator.spec.roles import DecodeSpec, PrefillSpec
from pdserve_operator.spec.router import RouterAdmissionSpec, RouterAuthSpec, RouterServiceSpec, RouterSpec
from pdserve_operator.spec.service import (
    PDInferenceServiceSpec,
    autoscaled,
    describe,
    effective_min,
    parse_spec,
    planner_model_name,
    planner_profile_name,
)
from pdserve_operator.spec.status import (
    AutoscalingStatus,
    Condition,
    ConditionType,
    DecodeStatus,
    DrainStatus,
    KVStatus,
    PDInferenceServiceStatus,
    Phase,
    RoleScalingStatus,
    RoleStatus,
    SlotStatus,
)
from pdserve_operator.spec.tls import TLSSpec
from pdserve_operator.spec.transfer import TransferSpec

__all__ = [
    "ValidationError",
    "ValidationError",
    "GROUP",
    "VERSION",
    "KIND",
    "PLURAL",
    "SINGULAR",
    "SHORT_NAMES",
    "API_VERSION",
    "MAX_NAME_LENGTH",
    "Rule",
    "Model",
    "Quantity",
    "DNS_LABEL",
    "DNS_SUBDOMAIN",
    "ResourceRequirements",
    "Toleration",
    "EnvVar",
    "PodOverrides",
    "BuiltinModel",
    "BUILTIN_MODELS",
    "ModelSpec",
    "DeviceSpec",
    "PrefillSpec",
    "DecodeSpec",
    "TransferSpec",
    "RouterServiceSpec",
    "RouterAuthSpec",
    "RouterAdmissionSpec",
    "RouterSpec",
    "TLSSpec",
    "MetricTarget",
    "HPAMetric",
    "RoleAutoscaling",
    "AutoscalingSLO",
    "RatioBand",
    "PLANNER_MODELS",
    "PLANNER_PROFILES",
    "AutoscalingSpec",
    "planner_drives",
    "TracingSpec",
    "ObservabilitySpec",
    "PDInferenceServiceSpec",
    "planner_model_name",
    "planner_profile_name",
    "autoscaled",
    "effective_min",
    "parse_spec",
    "describe",
    "Phase",
    "ConditionType",
    "Condition",
    "RoleStatus",
    "DecodeStatus",
    "SlotStatus",
    "RoleScalingStatus",
    "AutoscalingStatus",
    "DrainStatus",
    "KVStatus",
    "PDInferenceServiceStatus",
]
