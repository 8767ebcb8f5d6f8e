"""Certificates for one run: a CA made on the spot and one certificate it signs.

`pdserve local --tls` (and tests) need what cert-manager gives a pod in Kubernetes: a Secret
with `ca.crt`, `tls.crt` and `tls.key`. The certificate is for both ends of mutual TLS (server
and client auth) and names the hosts the processes are dialled at (127.0.0.1, localhost), so
no client needs a name override. The CA's key is not kept: nothing else can ever be signed by
it. EC P-256 keys: quick to make, and what cert-manager issues by default for ECDSA.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve_common import pod_env as E


@dataclass(frozen=True)
class CertFiles:
    ca: Path
    cert: Path
    key: Path


def write_run_certificates(
    folder: Path, hosts: Sequence[str] = ("127.0.0.1", "localhost"), days: int = 30, common_name: str = "pdserve"
) -> CertFiles:
    """Write `ca.crt`, `tls.crt` and `tls.key` (mode 0600) into `folder`, cert-manager's names."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days))
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _ca_certificate(ca_key, f"{common_name} run CA", valid)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _leaf_certificate(ca_key, ca_cert.subject, key.public_key(), common_name, hosts, valid)
    files = CertFiles(folder / E.TLS_CA_KEY, folder / E.TLS_CERT_KEY, folder / E.TLS_KEY_KEY)
    files.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    fd = os.open(files.key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    return files


def _ca_certificate(ca_key: Any, name: str, valid: tuple[datetime.datetime, datetime.datetime]) -> Any:
    """A self-signed CA that may sign leaf certificates only (path length 0)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    usage = dict.fromkeys(
        ("digital_signature", "content_commitment", "key_encipherment", "data_encipherment", "key_agreement"), False
    )
    return (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid[0])
        .not_valid_after(valid[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(**usage, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )


def _leaf_certificate(
    ca_key: Any,
    ca_name: Any,
    public_key: Any,
    common_name: str,
    hosts: Sequence[str],
    valid: tuple[datetime.datetime, datetime.datetime],
) -> Any:
    """The servers' and clients' certificate: every host as an IP or DNS name."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_name)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid[0])
        .not_valid_after(valid[1])
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )


def tls_env(files: CertFiles, broker_tls: bool = True) -> dict[str, str]:
    """The environment a worker reads its TLS from (what the operator renders for spec.tls)."""
    env = {E.TLS_CERT: str(files.cert), E.TLS_KEY: str(files.key), E.TLS_CA: str(files.ca)}
    if broker_tls:
        env[E.BROKER_TLS] = "true"
    return env
