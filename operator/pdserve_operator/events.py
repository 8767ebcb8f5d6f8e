"""The Kubernetes Events the operator posts about a PDInferenceService: their reasons and body.

Reasons are part of the operator's interface: people filter on them (`kubectl get events
--field-selector reason=DriftReverted`) and alerts match them, so each is a named constant
here and nowhere else a string literal.

Events are posted in the legacy core/v1 form (no `eventTime`), the form client-go's
`record.EventRecorder` and kopf post: the API server's `legacyValidateEvent`
(kubernetes/pkg/apis/core/validation/events.go) then asks only that the Event's namespace be
its object's namespace. The chart grants `create` on core `events` for exactly this.
"""

from __future__ import annotations

import datetime
from typing import Any, Final, Literal

from pdserve_operator import spec as s

EventType = Literal["Normal", "Warning"]
NORMAL: Final = "Normal"
WARNING: Final = "Warning"

# The phase moved (Normal), named after the new phase.
PHASE_PENDING: Final = "PhasePending"
PHASE_PROGRESSING: Final = "PhaseProgressing"
PHASE_READY: Final = "PhaseReady"
# The phase moved to Degraded or Invalid (Warning).
DEGRADED: Final = "Degraded"
INVALID_SPEC: Final = "InvalidSpec"
# A child said something else than what the operator rendered while the spec stood still:
# someone edited it, and the operator put its fields back (Warning).
DRIFT_REVERTED: Final = "DriftReverted"

PHASE_REASONS: Final[dict[s.Phase, tuple[EventType, str]]] = {
    "Pending": (NORMAL, PHASE_PENDING),
    "Progressing": (NORMAL, PHASE_PROGRESSING),
    "Ready": (NORMAL, PHASE_READY),
    "Degraded": (WARNING, DEGRADED),
    "Invalid": (WARNING, INVALID_SPEC),
}

COMPONENT: Final = "pdserve-operator"
# The limit the API server puts on an events.k8s.io Event's note; kopf cuts core/v1 messages
# at the same length.
MAX_MESSAGE: Final = 1024
_EPOCH: Final = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


def body(
    involved: dict[str, Any], type_: EventType, reason: str, message: str, now: datetime.datetime
) -> dict[str, Any]:
    """A core/v1 Event about `involved` (an object as the API server returned it).

    Named like client-go's recorder names them (`<object>.<unix nanoseconds in hex>`), so two
    events of one object never collide and `kubectl get events` sorts them by time.
    """
    meta = involved["metadata"]
    stamp = now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    nanos = (now - _EPOCH) // datetime.timedelta(microseconds=1) * 1000
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{nanos:x}", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": involved["apiVersion"],
            "kind": involved["kind"],
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid", ""),
            "resourceVersion": meta.get("resourceVersion", ""),
        },
        "type": type_,
        "reason": reason,
        "message": message[:MAX_MESSAGE],
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }
