"""API keys of the OpenAI endpoint: which tenant a bearer key belongs to, and the tenant's limits.

The keys live in `keys.yaml`, mounted from the Secret that `spec.router.auth.secretName` names
(`pdserve local --api-keys FILE` points at one directly); its format is docs/admission.md's:
tenants, each with keys (or their hex SHA-256 digests) and optional limits. Rules that hold
whatever the file says:
- a key is known only by its SHA-256 digest in memory, so a leaked Secret of digests (or a heap
  dump) need not reveal a usable key;
- a presented key is looked up by digest, then confirmed with `hmac.compare_digest`: lookup
  time never depends on how many leading characters of a real key a client guessed;
- keys never reach a log line or an error message (a bad file is reported by location);
- the file is re-read when it changes (a Secret volume's `..data` symlink swap), checked at
  most once per `reload_interval_s`: rotating a key needs no restart; a file that fails to
  parse keeps the previous keys in force and is logged.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pdserve_common.logs import kv

log = logging.getLogger(__name__)

Priority = Literal["high", "normal", "low"]
PRIORITIES: tuple[Priority, ...] = ("high", "normal", "low")  # served in this order
MIN_KEY_CHARS = 16  # a shorter key is a mistake (guessable), refused when the file is read
MAX_KEY_CHARS = 512
MAX_KEYS = 100_000
DIGEST_PREFIX = "sha256:"
ANONYMOUS = "anonymous"  # the tenant of every request when authentication is off


class TenantLimits(BaseModel):
    """What one tenant may use; None is unlimited."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    requests_per_minute: int | None = Field(None, ge=1, alias="requestsPerMinute")
    tokens_per_minute: int | None = Field(None, ge=1, alias="tokensPerMinute")
    max_concurrent: int | None = Field(None, ge=1, alias="maxConcurrent")
    # Requests with structured outputs (a grammar) holding a reservation at once: each one's
    # mask costs every step of the decode batch it is in, the other tenants' rows included.
    max_concurrent_grammars: int | None = Field(2, ge=1, alias="maxConcurrentGrammars")
    max_priority: Priority = Field("high", alias="maxPriority")
    weight: float = Field(1.0, gt=0, le=1000)
    # May ask, with `x-pdserve-debug: workers`, for the names of the prefill and decode that
    # served a request (internal topology, off by default).
    debug: bool = False
    # Reuse cached prompt prefixes with every other tenant that sets it too (api/cache_scope.py);
    # off, a tenant's prompts share prefix-cache blocks with its own prompts only.
    share_prefix_cache: bool = Field(False, alias="sharePrefixCache")

    def per_replica(self, replicas: int) -> TenantLimits:
        """This router's share when `replicas` routers serve the tenant: each enforces 1/N of the
        rates and of the concurrency, rounded up (docs/admission.md, "Several routers"). The
        grammars' default bound is each router's own; a value the keys file sets is shared."""
        if replicas <= 1:
            return self

        def share(value: int | None) -> int | None:
            return None if value is None else max(1, math.ceil(value / replicas))

        return self.model_copy(
            update={
                "requests_per_minute": share(self.requests_per_minute),
                "tokens_per_minute": share(self.tokens_per_minute),
                "max_concurrent": share(self.max_concurrent),
                "max_concurrent_grammars": share(self.max_concurrent_grammars)
                if "max_concurrent_grammars" in self.model_fields_set
                else self.max_concurrent_grammars,
            }
        )


class _TenantEntry(TenantLimits):
    name: str = Field(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    keys: list[str] = Field(min_length=1, max_length=MAX_KEYS)

    @field_validator("keys")
    @classmethod
    def _key_shapes(cls, keys: list[str]) -> list[str]:
        for index, key in enumerate(keys):
            if key.startswith(DIGEST_PREFIX):
                digest = key[len(DIGEST_PREFIX) :]
                if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                    raise ValueError(f"keys[{index}]: a digest is 'sha256:' and 64 lowercase hex characters")
            elif (
                not MIN_KEY_CHARS <= len(key) <= MAX_KEY_CHARS
                or not key.isascii()
                or not key.isprintable()
                or any(c.isspace() for c in key)
            ):
                raise ValueError(
                    f"keys[{index}]: a key is {MIN_KEY_CHARS}-{MAX_KEY_CHARS} printable ASCII "
                    f"characters without spaces (got {len(key)} characters)"
                )
        return keys


class _KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenants: list[_TenantEntry] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> _KeysFile:
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"tenant {dup!r} is listed twice")
        if sum(len(t.keys) for t in self.tenants) > MAX_KEYS:
            raise ValueError(f"more than {MAX_KEYS} keys")
        return self


@dataclass(frozen=True)
class Tenant:
    name: str
    limits: TenantLimits


def digest_of(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _stored_digest(key: str) -> bytes:
    if key.startswith(DIGEST_PREFIX):
        return bytes.fromhex(key[len(DIGEST_PREFIX) :])
    return digest_of(key)


class KeyFileError(ValueError):
    """The keys file cannot be used; the message names the file and the place, never a key."""


class KeyStore:
    """An immutable map from key digests to tenants."""

    def __init__(self, tenants: list[Tenant], digests: dict[bytes, Tenant]) -> None:
        self.tenants = {t.name: t for t in tenants}
        self._by_digest = {d: (d, t) for d, t in digests.items()}

    @classmethod
    def parse(cls, text: str, source: str = "keys file") -> KeyStore:
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise KeyFileError(f"{source}: not valid YAML{where}") from None
        try:
            parsed = _KeysFile.model_validate(raw)
        except ValidationError as exc:
            # Location and message only: pydantic's `input` would quote the offending key.
            first = exc.errors(include_input=False, include_url=False)[0]
            where = ".".join(str(p) for p in first["loc"])
            raise KeyFileError(f"{source}: {where}: {first['msg']}") from None
        tenants: list[Tenant] = []
        digests: dict[bytes, Tenant] = {}
        for entry in parsed.tenants:
            tenant = Tenant(
                entry.name, TenantLimits.model_validate(entry.model_dump(by_alias=True, exclude={"name", "keys"}))
            )
            tenants.append(tenant)
            for key in entry.keys:
                digest = _stored_digest(key)
                other = digests.get(digest)
                if other is not None and other.name != tenant.name:
                    raise KeyFileError(f"{source}: one key is listed for tenants {other.name!r} and {tenant.name!r}")
                digests[digest] = tenant
        return cls(tenants, digests)

    def __len__(self) -> int:
        return len(self._by_digest)

    def __repr__(self) -> str:  # never the keys
        return f"KeyStore(tenants={sorted(self.tenants)}, keys={len(self)})"

    def lookup(self, key: str) -> Tenant | None:
        """The tenant of `key`, or None for an unknown key."""
        digest = digest_of(key)
        found = self._by_digest.get(digest)
        if found is None:
            return None
        # The dict compared digests (of which a client controls no prefix); the stored digest
        # is compared once more in constant time, so no comparison of ours exits early.
        stored, tenant = found
        return tenant if hmac.compare_digest(stored, digest) else None


def bearer_key(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer KEY` header (RFC 6750: the scheme is case-insensitive)."""
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    key = key.strip()
    return key or None


class KeyFile:
    """The keys file at `path`, re-read when it changes (checked at most every `reload_interval_s`)."""

    def __init__(
        self, path: str | Path, reload_interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.path = Path(path)
        self.reload_interval_s = reload_interval_s
        self._clock = clock
        self._signature = self._stat()
        if self._signature is None:
            raise KeyFileError(f"API keys file {self.path} does not exist")
        self._store = KeyStore.parse(self.path.read_text(encoding="utf-8"), str(self.path))
        self._checked = clock()
        self.reloads = 0
        self.failed_reloads = 0
        log.info(kv(event="api_keys_loaded", path=self.path, tenants=len(self._store.tenants), keys=len(self._store)))

    def _stat(self) -> tuple[int, int, int, int] | None:
        try:
            st = os.stat(self.path)  # follows the symlinks: a Secret update swaps what they point at
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)

    def current(self) -> KeyStore:
        now = self._clock()
        if now - self._checked >= self.reload_interval_s:
            self._checked = now
            self._maybe_reload()
        return self._store

    def _maybe_reload(self) -> None:
        signature = self._stat()
        if signature is None or signature == self._signature:
            return  # a missing file (mid-swap, or unmounted) keeps the keys in force
        self._signature = signature
        try:
            store = KeyStore.parse(self.path.read_text(encoding="utf-8"), str(self.path))
        except (OSError, UnicodeDecodeError, KeyFileError) as exc:
            self.failed_reloads += 1
            log.error(
                kv(
                    event="api_keys_reload_failed",
                    path=self.path,
                    error=str(exc) if isinstance(exc, KeyFileError) else type(exc).__name__,
                    kept_keys=len(self._store),
                )
            )
            return
        self._store = store
        self.reloads += 1
        log.info(kv(event="api_keys_reloaded", path=self.path, tenants=len(store.tenants), keys=len(store)))

    def lookup(self, key: str) -> Tenant | None:
        return self.current().lookup(key)
