"""`pdserve local --tls` with workers that advertise another address than the one they listen
on (`--env PDSERVE_POD_IP=127.0.0.2`, the soak's `--links proxied`): the run's certificate names
that address too, so a peer that dials it through the fault proxy verifies the worker; without
it, the same handshake fails on the name."""

from __future__ import annotations

import socket
import ssl
import threading
from pathlib import Path

import pytest

from pdserve_worker.cli.local_env import certificate_hosts
from pdserve_worker.cli.local_plan import LocalPlan
from pdserve_worker.util.tls_certs import write_run_certificates
from support.fault_proxy import FaultProxy

ADVERTISED = "127.0.0.2"


def test_the_certificate_names_the_advertised_address_only_when_one_is_set():
    assert certificate_hosts(LocalPlan()) == ("127.0.0.1", "localhost")
    plan = LocalPlan(extra_env={"PDSERVE_POD_IP": ADVERTISED})
    assert certificate_hosts(plan) == ("127.0.0.1", "localhost", ADVERTISED)
    assert certificate_hosts(LocalPlan(extra_env={"PDSERVE_POD_IP": "127.0.0.1"})) == ("127.0.0.1", "localhost")


def handshake_through_proxy(folder: Path, plan: LocalPlan) -> str:
    """Mutual TLS, as between two workers, from a client dialling 127.0.0.2 through the proxy to
    a server on 127.0.0.1; returns what the server read."""
    certs = write_run_certificates(folder, certificate_hosts(plan))
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(certs.ca))
    server_ctx.load_cert_chain(str(certs.cert), str(certs.key))
    server_ctx.verify_mode = ssl.CERT_REQUIRED
    client_ctx = ssl.create_default_context(cafile=str(certs.ca))
    client_ctx.load_cert_chain(str(certs.cert), str(certs.key))
    got: list[bytes] = []
    with socket.create_server(("127.0.0.1", 0)) as listener, FaultProxy() as proxy:
        listener.settimeout(10)

        def serve() -> None:
            conn, _ = listener.accept()
            try:
                with server_ctx.wrap_socket(conn, server_side=True) as tls:
                    got.append(tls.recv(16))
            except (ssl.SSLError, OSError):
                got.append(b"")

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        address = proxy.link("decode-0", (ADVERTISED, 0), listener.getsockname())
        try:
            with socket.create_connection(address, timeout=10) as raw:
                with client_ctx.wrap_socket(raw, server_hostname=ADVERTISED) as tls:
                    tls.sendall(b"kv")
        finally:
            thread.join(10)
    return got[0].decode()


def test_a_peer_dialling_the_advertised_address_through_the_proxy_verifies_the_worker(tmp_path):
    plan = LocalPlan(tls=True, extra_env={"PDSERVE_POD_IP": ADVERTISED})
    assert handshake_through_proxy(tmp_path, plan) == "kv"


def test_without_the_advertised_address_in_the_certificate_the_handshake_fails_on_the_name(tmp_path):
    with pytest.raises(ssl.SSLCertVerificationError, match="IP address mismatch"):
        handshake_through_proxy(tmp_path, LocalPlan(tls=True))
