"""The host engine's own options: the `pdserve.*` keys of the string map `initialize` takes.

All off or HIXL's behaviour by default (the defaults are `HostEngineOptions`' fields); a
pdserve worker sets the link key, leased writes and no remote reads (service_link.py).
`HostEngineOptions.parse` checks them (ValueError names the key); HIXL's own options
(BufferPool, RDMA, LocalCommRes, ...) are accepted and ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve_worker.transfer import hixl_api as api
from pdserve_worker.transfer.backends.host import link_auth
from pdserve_worker.transfer.backends.host.link import LinkOptions
from pdserve_worker.transfer.backends.host.server import ServerPolicy
from pdserve_worker.transfer.copy_counts import CopyCounts

OPTION_TRANSPORT = "pdserve.Transport"  # "auto" (shared memory where possible) | "tcp"
OPTION_MAX_OUTSTANDING = "pdserve.MaxOutstandingTransfers"  # un-queried async requests (HIXL's CS flag queue)
OPTION_NOTIFY_QUEUE = "pdserve.NotifyQueueSize"  # notifies a server queues, past which RESOURCE_EXHAUSTED
OPTION_COPY_THREADS = "pdserve.CopyThreads"  # threads for shared-memory copies too big to run inline
OPTION_INLINE_COPY_MAX_BYTES = "pdserve.InlineCopyMaxBytes"  # up to this, a copy runs on the caller's thread
OPTION_INLINE_SEND_MAX_BYTES = "pdserve.InlineSendMaxBytes"  # up to this, a TCP frame too (when the socket is free)
# Who may use the link, and for what (transfer/backends/host/server.py, link_auth.py, leases.py):
OPTION_AUTH_KEY = "pdserve.AuthKey"  # hex; both ends of a link must hold the same key
OPTION_REMOTE_WRITE = "pdserve.RemoteWrite"  # "registered" (HIXL) | "leased": only lease_write ranges
OPTION_REMOTE_READ = "pdserve.RemoteRead"  # "1" (HIXL) | "0": every remote READ is PARAM_INVALID
OPTION_MAX_LINKS = "pdserve.MaxLinks"  # links at once (and at most 32 of them in the handshake)
OPTION_HANDSHAKE_TIMEOUT_MS = "pdserve.HandshakeTimeoutMs"  # a handshake's deadline
OPTION_MAX_HANDSHAKES_PER_PEER = "pdserve.MaxHandshakesPerPeer"  # handshakes one source address holds


@dataclass(frozen=True)
class HostEngineOptions:
    """The host engine's own options, parsed from the string map `initialize` takes."""

    transport: str = "auto"
    max_outstanding: int = 4096
    notify_queue: int = 4096
    copy_threads: int = 1
    inline_copy_max_bytes: int = 16 << 20
    inline_send_max_bytes: int = 256 << 10
    auto_connect: bool = False
    auth_key: bytes | None = field(default=None, repr=False)
    remote_write: str = "registered"
    remote_read: bool = True
    max_links: int = 256
    handshake_timeout_ms: int = 5000
    max_handshakes_per_peer: int = 8

    @classmethod
    def parse(cls, options: dict[str, str]) -> HostEngineOptions:
        def positive(key: str, default: int, minimum: int = 1) -> int:
            raw = options.get(key)
            if raw is None:
                return default
            try:
                value = int(raw)
            except (TypeError, ValueError):
                raise ValueError(f"option {key} must be an integer, got {raw!r}") from None
            if value < minimum:
                raise ValueError(f"option {key} must be >= {minimum}, got {value}")
            return value

        transport = str(options.get(OPTION_TRANSPORT, "auto")).lower()
        if transport not in ("auto", "tcp"):
            raise ValueError(f"option {OPTION_TRANSPORT} must be 'auto' or 'tcp', got {transport!r}")
        auto_connect = str(options.get(api.OPTION_AUTO_CONNECT, "0"))
        if auto_connect not in ("0", "1"):
            raise ValueError(f"option {api.OPTION_AUTO_CONNECT} must be '0' or '1', got {auto_connect!r}")
        remote_write = str(options.get(OPTION_REMOTE_WRITE, "registered")).lower()
        if remote_write not in ("registered", "leased"):
            raise ValueError(f"option {OPTION_REMOTE_WRITE} must be 'registered' or 'leased', got {remote_write!r}")
        remote_read = str(options.get(OPTION_REMOTE_READ, "1"))
        if remote_read not in ("0", "1"):
            raise ValueError(f"option {OPTION_REMOTE_READ} must be '0' or '1', got {remote_read!r}")
        raw_key = options.get(OPTION_AUTH_KEY)
        auth_key = link_auth.parse_key(str(raw_key)) if raw_key else None
        return cls(
            transport=transport,
            max_outstanding=positive(OPTION_MAX_OUTSTANDING, cls.max_outstanding),
            notify_queue=positive(OPTION_NOTIFY_QUEUE, cls.notify_queue),
            copy_threads=positive(OPTION_COPY_THREADS, cls.copy_threads),
            inline_copy_max_bytes=positive(OPTION_INLINE_COPY_MAX_BYTES, cls.inline_copy_max_bytes, minimum=0),
            inline_send_max_bytes=positive(OPTION_INLINE_SEND_MAX_BYTES, cls.inline_send_max_bytes, minimum=0),
            auto_connect=auto_connect == "1",
            auth_key=auth_key,
            remote_write=remote_write,
            remote_read=remote_read == "1",
            max_links=positive(OPTION_MAX_LINKS, cls.max_links),
            handshake_timeout_ms=positive(OPTION_HANDSHAKE_TIMEOUT_MS, cls.handshake_timeout_ms),
            max_handshakes_per_peer=positive(OPTION_MAX_HANDSHAKES_PER_PEER, cls.max_handshakes_per_peer),
        )

    def server_policy(self) -> ServerPolicy:
        return ServerPolicy(
            key=self.auth_key,
            remote_write=self.remote_write,
            remote_read=self.remote_read,
            max_links=self.max_links,
            max_pending=min(32, self.max_links),
            max_pending_per_peer=min(self.max_handshakes_per_peer, 32, self.max_links),
            handshake_timeout_s=self.handshake_timeout_ms / 1000.0,
        )

    def link_options(self, copies: CopyCounts) -> LinkOptions:
        return LinkOptions(
            allow_shm=self.transport == "auto",
            inline_send_max_bytes=self.inline_send_max_bytes,
            key=self.auth_key,
            copies=copies,
        )
