"""Pods' identity tokens, checked by the cluster: a TokenReview (issue #58 A4, broker/identity.py).

Each worker pod mounts a projected ServiceAccount token for the broker's audience
(`AUDIENCE`; reconcile/children/pod.py) and presents it with its registrations. The API server
says whether it is valid for that audience and, for a pod-bound token, which pod holds it
(`authentication.kubernetes.io/pod-name` in the user's extra): that pod's name must be the
member id it registers. Answers are kept `CACHE_S` seconds (at most `CACHE_ENTRIES`), so a
broker restart that every pod re-registers with costs each pod one review; a failed review
(the API unreachable, or the operator not granted `tokenreviews`) refuses, never admits.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from pdserve_common import pod_env as E
from pdserve_common.logs import kv
from pdserve_operator.broker.identity import PodIdentity
from pdserve_operator.kube import KubeClient, KubeError

log = logging.getLogger(__name__)

AUDIENCE = E.BROKER_AUDIENCE
POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
CACHE_S = 60.0
CACHE_ENTRIES = 4096


def identity_of(review: dict[str, Any]) -> PodIdentity | None:
    """The pod a TokenReview's answer names, when it authenticated a pod-bound token of our audience."""
    status = review.get("status") or {}
    if not status.get("authenticated") or AUDIENCE not in (status.get("audiences") or []):
        return None
    user = status.get("user") or {}
    parts = str(user.get("username", "")).split(":")  # system:serviceaccount:NAMESPACE:NAME
    pods = (user.get("extra") or {}).get(POD_NAME_EXTRA) or []
    if len(parts) != 4 or parts[:2] != ["system", "serviceaccount"] or len(pods) != 1:
        return None
    return PodIdentity(namespace=parts[2], pod_name=str(pods[0]))


class TokenReviewer:
    """`review(token)` for MemberCredentials, through the operator's API client; thread-safe."""

    def __init__(self, kube: KubeClient, clock: Callable[[], float] = time.monotonic) -> None:
        self._kube = kube
        self._clock = clock
        self._lock = threading.Lock()
        self._cache: OrderedDict[bytes, tuple[float, PodIdentity | None]] = OrderedDict()

    def __call__(self, token: str) -> PodIdentity | None:
        key = hashlib.sha256(token.encode()).digest()  # (no token kept in memory as itself)
        now = self._clock()
        with self._lock:
            found = self._cache.get(key)
            if found is not None and found[0] > now:
                return found[1]
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "metadata": {},
            "spec": {"token": token, "audiences": [AUDIENCE]},
        }
        try:
            identity = identity_of(self._kube.create(body))
        except KubeError as exc:
            log.warning(kv(event="broker.token_review_failed", status=exc.status, reason=exc.reason))
            return None  # (not cached: the next registration asks again)
        with self._lock:
            self._cache[key] = (now + CACHE_S, identity)
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return identity
