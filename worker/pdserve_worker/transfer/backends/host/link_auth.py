"""Who may use a host engine's KV link: a per-service key, proven by challenge-response.

The KV plane admits only the service's own processes. Every pod of a service already holds
one secret, the broker token (the operator's per-service Secret; `pdserve local` makes one
per run), so no new secret is distributed: each purpose gets its own key derived from that
token with HKDF (RFC 5869, HMAC-SHA256), and a leaked derived key reveals neither the token
nor the other keys.

- `PURPOSE_LINK`: the host engine's link key. At connect both sides send a fresh 32-byte
  nonce; the client proves it holds the key with HMAC(key, "client" | both nonces | its
  claims), the server answers with HMAC(key, "server" | both nonces). The key never crosses
  the wire, a recorded handshake is useless on another connection (the other side's nonce
  differs), a proof cannot be reflected (the role is in the MAC), and the client checks the
  server's proof before it sends a byte of KV (a prompt can be read back from its KV, so an
  impostor server must not get it either).
- `PURPOSE_CAPABILITY`: the key of reservation capabilities (kv/slots.py): every member of a
  layer-sharded decode group can check a ready notify's capability without being told of
  each reservation.

Hand-written over `hmac`/`hashlib`/`secrets` rather than a library: HKDF with one output
block is two HMAC calls, and the handshake is four; `cryptography` would be a runtime
dependency of every worker for ten lines (tests/unit/test_link_auth.py checks `hkdf` against
`cryptography`'s implementation).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from pdserve_worker.transfer.backends.host.shm import host_identity

PURPOSE_LINK = "pdserve kv-link v1"
PURPOSE_CAPABILITY = "pdserve kv-capability v1"
SALT = b"pdserve-service-token"
KEY_BYTES = 32
NONCE_BYTES = 32
MIN_KEY_BYTES = 16


class AuthError(ConnectionError):
    """The peer did not prove it holds the service's key (or asked us to skip the proof)."""


def hkdf(secret: bytes, info: bytes, length: int = KEY_BYTES, salt: bytes = SALT) -> bytes:
    """RFC 5869 HKDF-SHA256: extract, then expand to `length` bytes (at most 255 blocks)."""
    if not secret:
        raise ValueError("cannot derive a key from an empty secret")
    if not 0 < length <= 255 * hashlib.sha256().digest_size:
        raise ValueError(f"HKDF output length must be in 1..{255 * 32}, got {length}")
    prk = hmac.new(salt, secret, hashlib.sha256).digest()
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        out += block
        counter += 1
    return out[:length]


def derive_key(service_secret: str | bytes, purpose: str) -> bytes:
    """The key for `purpose` (one of the PURPOSE_* names) from the service's broker token."""
    raw = service_secret.encode() if isinstance(service_secret, str) else bytes(service_secret)
    return hkdf(raw, purpose.encode())


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
