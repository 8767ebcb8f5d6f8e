"""Who may use a host engine's KV link: a per-service key, proven by challenge-response.

The KV plane admits only the service's own processes. Each purpose gets its own key derived
from the service token (pdserve_common/service_keys.py); pods are given the keys they need,
never the token.
- `PURPOSE_LINK`: the link key. At connect both sides send a fresh 32-byte nonce; the client
  proves the key with HMAC(key, "client" | both nonces | its claims), the server answers with
  HMAC(key, "server" | both nonces). The key never crosses the wire, a recorded handshake is
  useless on another connection, a proof cannot be reflected, and the client checks the
  server's proof before it sends a byte of KV (KV gives its prompt away).
- `PURPOSE_CAPABILITY`: the key of reservation capabilities (kv/slots.py), so every member of
  a layer-sharded decode group can check a ready notify's capability.
Hand-written over `hmac`/`hashlib`/`secrets`: the handshake is four HMAC calls.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

# The key derivation lives beside the operator's use of it; re-exported here for the engine.
from pdserve_common.service_keys import KEY_BYTES as KEY_BYTES
from pdserve_common.service_keys import PURPOSE_CAPABILITY as PURPOSE_CAPABILITY
from pdserve_common.service_keys import PURPOSE_LINK as PURPOSE_LINK
from pdserve_common.service_keys import SALT as SALT
from pdserve_common.service_keys import derive_key as derive_key
from pdserve_common.service_keys import hkdf as hkdf
from pdserve_worker.transfer.backends.host.shm import host_identity

NONCE_BYTES = 32
MIN_KEY_BYTES = 16


class AuthError(ConnectionError):
    """The peer did not prove it holds the service's key (or asked us to skip the proof)."""


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def host_tag() -> str:
    """This host, as a peer may learn it: a digest of hostname and boot id, never the raw values."""
    return hashlib.sha256(host_identity().encode()).hexdigest()[:32]


def _mac(key: bytes, role: bytes, client_nonce: bytes, server_nonce: bytes, claims: str) -> str:
    message = b"|".join([role, client_nonce, server_nonce, claims.encode()])
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def client_proof(key: bytes, client_nonce: bytes, server_nonce: bytes, client: str, host: str) -> str:
    """What the client sends in AUTH: binds both nonces and what it claims (name, host tag)."""
    return _mac(key, b"client", client_nonce, server_nonce, f"{client}|{host}")


def server_proof(key: bytes, client_nonce: bytes, server_nonce: bytes) -> str:
    return _mac(key, b"server", client_nonce, server_nonce, "")


def proofs_equal(expected: str, got: object) -> bool:
    """Constant-time comparison of a proof with what the peer sent (any type)."""
    return isinstance(got, str) and hmac.compare_digest(expected.encode(), got.encode("utf-8", "replace"))


def parse_nonce(value: object) -> bytes:
    """A peer's nonce from its hex form; AuthError unless it is exactly NONCE_BYTES."""
    if not isinstance(value, str) or len(value) != 2 * NONCE_BYTES:
        raise AuthError(f"the peer's nonce must be {2 * NONCE_BYTES} hex digits")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise AuthError("the peer's nonce is not hex") from None


def parse_key(value: str) -> bytes:
    """The engine option's hex key; ValueError when it is too short to be a key."""
    try:
        key = bytes.fromhex(value)
    except ValueError:
        raise ValueError("the link key must be hex") from None
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"the link key must have at least {MIN_KEY_BYTES} bytes, got {len(key)}")
    return key
