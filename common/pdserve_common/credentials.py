"""What a service's Secret holds and which of it each pod gets (issue #29: least privilege).

The operator keeps the service token (the broker's table holds it: every role), and derives
from it, into the same Secret, what the pods need: each role's token (auth.role_token), the KV
plane's keys (service_keys.py) and the digests each worker role admits calls from
(channels.WORKER_POLICY: routers call prefills and decodes, a decode group's leader its
members). A pod is given only its own part (`pod_keys`): a router its token; a prefill its token,
the link key and whom it admits; a decode the same plus the capability key. No pod holds the
service token, so no pod can act as another role or derive another's keys. The operator renders
them as secretKeyRefs (the operator's reconcile/children/env.py); `pdserve local` sets the values directly.
"""

from __future__ import annotations

import hashlib
import hmac

from pdserve_common import auth
from pdserve_common import pod_env as E
from pdserve_common.service_keys import ServiceKeys

TOKEN_KEY = "token"  # the service token: the operator's (the broker's table), no pod's
KV_LINK_KEY = "kv-link-key"
KV_CAPABILITY_KEY = "kv-capability-key"
# Who may call each worker role's gRPC server (channels.WORKER_POLICY names the methods), besides
# whoever holds the service token (the operator, an administrator with the Secret).
CALLERS = {"prefill": ("router",), "decode": ("router", "decode")}


GATEWAY_TOKEN_KEY = "token-gateway"  # what a gateway presents to the routers' endpoint pickers
ACCEPT_GATEWAY_KEY = "accept-gateway"  # whom a router's endpoint picker admits (digests)


def gateway_token(token: str) -> str:
    """The token a gateway presents to the service's endpoint pickers (issue #58 A3), derived
    from the service token: `pdg1.<hex HMAC>`. It grants the picker's port and nothing else
    (no worker and no broker knows it)."""
    return f"pdg1.{hmac.new(token.encode(), b'pdserve gateway token v1', hashlib.sha256).hexdigest()}"


def role_token_key(role: str) -> str:
    return f"token-{role}"


def accept_key(role: str) -> str:
    return f"accept-{role}"


def secret_data(token: str) -> dict[str, str]:
    """The Secret's keys and values, all derived from the service token."""
    roles = {role: auth.role_token(token, role) for role in auth.ROLES}
    link, capability = ServiceKeys.from_token(token).hex()
    data = {TOKEN_KEY: token, KV_LINK_KEY: link, KV_CAPABILITY_KEY: capability}
    data.update({role_token_key(role): value for role, value in roles.items()})
    service = f"{auth.SERVICE_ROLE}:{auth.token_digest(token)}"
    for role, callers in CALLERS.items():
        data[accept_key(role)] = ",".join([*(f"{c}:{auth.token_digest(roles[c])}" for c in callers), service])
    gateway = gateway_token(token)
    data[GATEWAY_TOKEN_KEY] = gateway
    data[ACCEPT_GATEWAY_KEY] = f"{auth.GATEWAY_ROLE}:{auth.token_digest(gateway)},{service}"
    return data


def pod_keys(role: str) -> dict[str, str]:
    """Environment variable -> the Secret key it comes from, for a pod of `role`."""
    keys = {E.BROKER_TOKEN: role_token_key(role)}
    if role in CALLERS:
        keys[E.KV_LINK_KEY] = KV_LINK_KEY
        keys[E.ACCEPT_TOKEN_DIGESTS] = accept_key(role)
    if role == "decode":
        keys[E.KV_CAPABILITY_KEY] = KV_CAPABILITY_KEY
    if role == "router":  # its endpoint picker's callers (gateway/ext_proc.py)
        keys[E.EPP_ACCEPT_TOKEN_DIGESTS] = ACCEPT_GATEWAY_KEY
    return keys


# A member's credential (issue #58 A4): a role token says which role a caller is, not which pod, so
# a registration also carries this, bound to the member id it registers, in this gRPC metadata key.
MEMBER_CREDENTIAL_HEADER = "x-pdserve-member-credential"
_MEMBER_PREFIX = "pdm1"


def member_credential(token: str, role: str, worker_id: str) -> str:
    """The credential of the member `worker_id` of `role` in the service whose token is `token`:
    `pdm1.<hex HMAC-SHA256(token, purpose, role, worker id)>`. Whoever issues it holds the service
    token (the operator, `pdserve local`); the broker recomputes it. One-way: it reveals neither
    the service token nor another member's credential."""
    if role not in auth.ROLES:
        raise ValueError(f"role must be one of {', '.join(auth.ROLES)}, got {role!r}")
    if not worker_id:
        raise ValueError("a member credential needs a worker id, got ''")
    message = f"pdserve member credential v1\0{role}\0{worker_id}".encode()
    return f"{_MEMBER_PREFIX}.{hmac.new(token.encode(), message, hashlib.sha256).hexdigest()}"


def is_member_credential(value: str) -> bool:
    """Whether `value` has the shape of `member_credential` (else: a pod's identity token)."""
    return value.startswith(_MEMBER_PREFIX + ".")


def pod_env(token: str, role: str) -> dict[str, str]:
    """The same as values (a process started outside Kubernetes: `pdserve local`)."""
    data = secret_data(token)
    return {name: data[key] for name, key in pod_keys(role).items()}
