"""The `pdserve operator` command line: its flags and the config they make.

Here, beside the operator, so that the flag table of docs/configuration.md (`config_docs`) is
read from the parser without importing the worker package; the `pdserve` CLI
(`pdserve_worker.cli.operator_cmd`) only mounts it. Every flag has a PDSERVE_OPERATOR_*
variable (the operator Deployment sets those); flags win.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI builds every parser at start: no kopf or grpc import for that
    from pdserve_operator.runtime import OperatorConfig

FLAGS: tuple[str, ...] = (
    "namespaces",
    "image",
    "broker_port",
    "broker_address",
    "standalone",
    "peering",
    "priority",
    "replicas",
    "liveness",
    "metrics_port",
    "kubeconfig",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--namespace",
        "-n",
        action="append",
        dest="namespaces",
        metavar="NS",
        help="watch this namespace (repeatable); default: all namespaces",
    )
    p.add_argument("--image", help="worker image for resources that set none")
    p.add_argument("--broker-port", type=int, help="port the gRPC broker listens on")
    p.add_argument("--broker-address", help="host:port pods use to reach the broker")
    p.add_argument(
        "--standalone",
        action="store_true",
        default=None,
        help="no peering (a single replica); otherwise replicas elect one active via kopf peering",
    )
    p.add_argument("--peering", help="kopf peering name shared by the replicas (default pdserve)")
    p.add_argument("--priority", type=int, help="peering priority (default: derived from the pod name)")
    p.add_argument(
        "--replicas",
        type=int,
        help="how many operator replicas run; with 1, a missing peering object "
        "means standalone with a warning (default: unknown, so the operator waits for it)",
    )
    p.add_argument("--liveness", help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--metrics-port", type=int, help="port of the operator's Prometheus /metrics (default: not served)")
    p.add_argument("--kubeconfig", help="kubeconfig file outside a cluster (default: $KUBECONFIG)")


def config_from_args(args: argparse.Namespace) -> OperatorConfig:
    """The environment's config with the flags that were given laid over it."""
    from pdserve_operator.runtime import OperatorConfig

    flags = {name: getattr(args, name) for name in FLAGS}
    return OperatorConfig(**{k: v for k, v in flags.items() if v is not None})
