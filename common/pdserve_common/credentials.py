"""What a service's Secret holds and which of it each pod gets (issue #29: least privilege).

The operator keeps the service token (the broker's table holds it: every role), and derives
from it, into the same Secret, what the pods need: each role's token (auth.role_token), the KV
plane's keys (service_keys.py) and the digests each worker role admits calls from
(channels.WORKER_POLICY: routers call prefills and decodes, a decode group's leader its
members). A pod is given only its own part (`pod_keys`): a router its token; a prefill its token,
the link key and whom it admits; a decode the same plus the capability key. No pod holds the
service token, so no pod can act as another role or derive another's keys. The operator renders
them as secretKeyRefs (children.py); `pdserve local` sets the values directly.
"""

from __future__ import annotations

from pdserve_common import auth
from pdserve_common import pod_env as E
from pdserve_common.service_keys import ServiceKeys

TOKEN_KEY = "token"  # the service token: the operator's (the broker's table), no pod's
KV_LINK_KEY = "kv-link-key"
KV_CAPABILITY_KEY = "kv-capability-key"
# Who may call each worker role's gRPC server (channels.WORKER_POLICY names the methods), besides
# whoever holds the service token (the operator, an administrator with the Secret).
CALLERS = {"prefill": ("router",), "decode": ("router", "decode")}


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
    return data


def pod_keys(role: str) -> dict[str, str]:
    """Environment variable -> the Secret key it comes from, for a pod of `role`."""
    keys = {E.BROKER_TOKEN: role_token_key(role)}
    if role in CALLERS:
        keys[E.KV_LINK_KEY] = KV_LINK_KEY
        keys[E.ACCEPT_TOKEN_DIGESTS] = accept_key(role)
    if role == "decode":
        keys[E.KV_CAPABILITY_KEY] = KV_CAPABILITY_KEY
    return keys


def pod_env(token: str, role: str) -> dict[str, str]:
    """The same as values (a process started outside Kubernetes: `pdserve local`)."""
    data = secret_data(token)
    return {name: data[key] for name, key in pod_keys(role).items()}
