"""How a pdserve worker sets up its transfer engine: who it admits, what it lets them do.

- The engine id: a decode listens on `ip:port` (prefills push into it); a prefill only ever
  connects out, so it initializes as a client (`ip`, no port, HIXL's rule) and listens on
  nothing an attacker could reach.
- With the host engine, the options that close the KV plane (transfer/backends/host/engine.py): the link key
  derived from the service's token (pdserve_common/service_keys.py; a pod holds only its role's
  token and is given the key, never the service token), READ off (no pull mode exists),
  and on a decode that owns a slot table, WRITE only into leased slots. A layer-sharded
  group's followers have no slot table (the leader's grants are not sent to them), so their
  pool stays writable for authenticated peers of the service. These keys override any of the
  same name in the user's `PDSERVE_ENGINE_OPTIONS`.
- Real HIXL has no such options (HIXL.md 1.3): there the user's options go through as they
  are, and the NetworkPolicy plus the reservation capability do the job.
"""

from __future__ import annotations

from collections.abc import Mapping

from pdserve_worker.transfer.backends.host.options import OPTION_AUTH_KEY, OPTION_REMOTE_READ, OPTION_REMOTE_WRITE


def local_engine_id(role: str, advertise_host: str, transfer_port: int) -> str:
    """What the worker passes to `initialize`: a port only where something must listen."""
    return f"{advertise_host}:{transfer_port}" if role == "decode" else advertise_host


def engine_options(backend_name: str, link_key: bytes, user: Mapping[str, str], leased_writes: bool) -> dict[str, str]:
    options = dict(user)
    if backend_name != "cpu":
        return options
    options[OPTION_AUTH_KEY] = link_key.hex()
    options[OPTION_REMOTE_READ] = "0"
    options[OPTION_REMOTE_WRITE] = "leased" if leased_writes else "registered"
    return options
