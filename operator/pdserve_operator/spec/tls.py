"""TLS on the service's own hops."""

from __future__ import annotations

from pydantic import Field

from pdserve_operator.spec.base import DNS_SUBDOMAIN, Model


class TLSSpec(Model):
    """TLS for the service's own hops, from a Secret in its namespace (cert-manager's shape)."""

    secret_name: str = Field(
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN,
        description=(
            "Secret with tls.crt, tls.key and ca.crt (what a cert-manager Certificate writes). Every pod "
            "mounts it: gRPC between the service's pods is mutual TLS only, the router serves HTTPS. The "
            "certificate needs both server and client auth usages and the name in serverName."
        ),
    )
    server_name: str | None = Field(
        None,
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN,
        description=(
            "The DNS name the certificate carries that peers check (pods dial each other by IP); "
            "default NAME.NAMESPACE.svc, the router Service's name."
        ),
    )
