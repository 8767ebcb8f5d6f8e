"""Which member a registration may claim (issue #58 A4): credentials bound to one pod.

A role token says a caller is *a* prefill, not *which*: with one prefill pod's token an attacker
registered a second, fake prefill and was sent other tenants' prompts. So a registration made
with a role token also carries a member credential (metadata `x-pdserve-member-credential`)
that is checked against the member id it claims, and is refused by name when it does not match:
- `pdm1.<hmac>` (pdserve_common/credentials.member_credential): an HMAC of (role, member id)
  under the service token, recomputed here; `pdserve local` issues them to its processes;
- anything else is a pod's projected ServiceAccount token, checked with `review` (a TokenReview
  on the cluster, broker/token_review.py): valid for the broker's audience, of a pod in the
  service's namespace whose name is the member id.
The service token itself (the operator, an administrator) needs none.
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from pdserve_common import credentials as C

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PodIdentity:
    """Who a pod's identity token says it is (a TokenReview's answer)."""

    namespace: str
    pod_name: str


# token -> the pod it belongs to, or None when it is not valid (expired, another audience, no pod).
Review = Callable[[str], PodIdentity | None]


class MemberCredentials:
    """The services' tokens (by service key) and an optional reviewer of pods' tokens; thread-safe."""

    def __init__(self, review: Review | None = None) -> None:
        self._lock = threading.Lock()
        self._tokens: dict[str, str] = {}
        self._review = review

    def set_review(self, review: Review | None) -> None:
        """Check pods' identity tokens with `review` from now on (the operator's TokenReview)."""
        with self._lock:
            self._review = review

    def set(self, service_key: str, token: str) -> None:
        with self._lock:
            self._tokens[service_key] = token

    def remove(self, service_key: str) -> None:
        with self._lock:
            self._tokens.pop(service_key, None)

    def refusal(self, service_key: str, role: str, worker_id: str, presented: str) -> str | None:
        """None when `presented` proves the caller is member `worker_id` (of `role`); else why not,
        naming the member claimed."""
        claim = f"{role} member {worker_id!r} of {service_key!r}"
        if not presented:
            return (
                f"no member credential ({C.MEMBER_CREDENTIAL_HEADER}) for {claim}: a role token alone names no member"
            )
        if C.is_member_credential(presented):
            with self._lock:
                token = self._tokens.get(service_key)
            if token is not None and hmac.compare_digest(presented, C.member_credential(token, role, worker_id)):
                return None
            return f"the member credential presented is not the credential of {claim}"
        with self._lock:
            review = self._review
        if review is None:
            return f"the credential presented for {claim} is no member credential, and no pod identity is checked here"
        pod = review(presented)
        namespace = service_key.partition("/")[0]
        if pod is None:
            return f"the pod identity token presented for {claim} is not valid (TokenReview)"
        if pod.namespace != namespace or pod.pod_name != worker_id:
            return f"the pod identity token presented for {claim} is pod {pod.namespace}/{pod.pod_name}'s"
        return None
