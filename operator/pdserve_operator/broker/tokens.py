"""The broker's service tokens at operator start, from the services' Secrets (issue #29).

The broker lives in the operator's memory and learns a service's token from that service's
reconcile. A restarted operator is paused by kopf peering until its dead predecessor's record
expires (benchmarks/operator_failover.py: 13 s at the default lifetime), and until then every
worker that re-registers is refused. The tokens are not the operator's memory, though: each is
in the service's `NAME-broker-token` Secret. So the only replica loads them before kopf starts,
and the broker serves re-registrations from its first second; the reconciles that follow set
the same tokens (and replace one whose Secret turns out not to be trusted).

Trusted here: a Secret of the operator's label, named like a service's token Secret, whose
controller is a PDInferenceService of that name (what `Reconciler._token` checks by uid later).
Only for a single replica: a paused standby's broker must keep refusing, or workers reaching it
through the operator Service would register with the replica that does not lead.
"""

from __future__ import annotations

import logging
from typing import Any

from pdserve_common.logs import kv
from pdserve_operator import spec as s
from pdserve_operator.broker.view import BrokerView
from pdserve_operator.kube import KINDS, KubeClient, KubeError
from pdserve_operator.reconcile.children.meta import LABEL_MANAGED_BY, MANAGED_BY, secret_name
from pdserve_operator.reconcile.children.secret import token_of

log = logging.getLogger(__name__)

_SUFFIX = secret_name("")  # "-broker-token"


def service_of(secret: dict[str, Any]) -> str | None:
    """The service whose token Secret this is, if its name and controller say so."""
    name = str(secret["metadata"]["name"])
    if not name.endswith(_SUFFIX) or len(name) == len(_SUFFIX):
        return None
    service = name[: -len(_SUFFIX)]
    for ref in secret["metadata"].get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == s.KIND and ref.get("name") == service:
            return service
    return None


def preload(kube: KubeClient, broker: BrokerView, namespaces: list[str]) -> int:
    """Give the broker every service token found; how many. Best effort: a failed list is
    logged, and the reconciles set the tokens as before."""
    selector = f"{LABEL_MANAGED_BY}={MANAGED_BY}"
    loaded = 0
    scopes: list[str | None] = list(namespaces) or [None]  # None: every namespace (a cluster-wide operator)
    for namespace in scopes:
        try:
            secrets = kube.list(KINDS["Secret"], namespace, selector)
        except KubeError as exc:
            log.warning(kv(event="broker_tokens_unreadable", namespace=namespace or "*", status=exc.status))
            continue
        for secret in secrets:
            service, token = service_of(secret), token_of(secret)
            if service is not None and token is not None:
                broker.set_service_token(f"{secret['metadata']['namespace']}/{service}", token)
                loaded += 1
    log.info(kv(event="broker_tokens_loaded", services=loaded))
    return loaded
