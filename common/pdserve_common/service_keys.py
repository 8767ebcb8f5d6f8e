"""The keys of a service's KV plane, derived from its token: shared by the operator (which holds
the token and hands the keys to the pods that need them) and the workers.

Each purpose gets its own key derived from the service token with HKDF (RFC 5869, HMAC-SHA256),
so a leaked derived key reveals neither the token nor the other keys:
- `PURPOSE_LINK`: the host engine's link key (transfer/backends/host/link_auth.py: the
  challenge-response every KV link starts with); prefill and decode hold it;
- `PURPOSE_CAPABILITY`: the key of reservation capabilities (kv/slots.py), minted and checked
  by decodes (and every member of a layer-sharded group); a prefill does not hold it.

Hand-written over `hmac`/`hashlib` rather than a library: HKDF with one output block is two HMAC
calls; `cryptography` would be a runtime dependency of every worker for ten lines
(tests/unit/test_link_auth.py checks `hkdf` against `cryptography`'s implementation).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

PURPOSE_LINK = "pdserve kv-link v1"
PURPOSE_CAPABILITY = "pdserve kv-capability v1"
PURPOSE_PREFIX_DISK = "pdserve prefix-disk v1"  # from the link key: the prefix disk tier's digests
SALT = b"pdserve-service-token"
KEY_BYTES = 32


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
    """The key for `purpose` (one of the PURPOSE_* names) from the service's token."""
    raw = service_secret.encode() if isinstance(service_secret, str) else bytes(service_secret)
    return hkdf(raw, purpose.encode())


@dataclass(frozen=True)
class ServiceKeys:
    """The KV plane's keys of a service: derived from the service token where a process holds it
    (the operator, in-process stacks), handed to a pod that holds only its role's token
    (pod_env.py; a prefill gets no capability key: None)."""

    link: bytes
    capability: bytes | None

    @classmethod
    def from_token(cls, service_token: str) -> ServiceKeys:
        return cls(derive_key(service_token, PURPOSE_LINK), derive_key(service_token, PURPOSE_CAPABILITY))

    @classmethod
    def from_hex(cls, link: str, capability: str = "") -> ServiceKeys:
        try:
            keys = cls(bytes.fromhex(link), bytes.fromhex(capability) if capability else None)
        except ValueError:
            raise ValueError("the KV plane's keys must be hex") from None
        if len(keys.link) != KEY_BYTES or (keys.capability is not None and len(keys.capability) != KEY_BYTES):
            raise ValueError(f"the KV plane's keys are {KEY_BYTES} bytes each")
        return keys

    def hex(self) -> tuple[str, str]:
        return self.link.hex(), self.capability.hex() if self.capability is not None else ""
