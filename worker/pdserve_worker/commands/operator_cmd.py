"""`pdserve operator`: reconcile PDInferenceService resources and host the broker.

(The module is not called `operator.py`: that would shadow the standard library's `operator`.)
Every flag has a PDSERVE_OPERATOR_* variable (the operator Deployment sets those); flags win.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("operator", help="run the Kubernetes operator (kopf) and the broker")
    p.add_argument("--namespace", "-n", action="append", dest="namespaces", metavar="NS",
                   help="watch this namespace (repeatable); default: all namespaces")
    p.add_argument("--image", help="worker image for resources that set none")
    p.add_argument("--broker-port", type=int, help="port the gRPC broker listens on")
    p.add_argument("--broker-address", help="host:port pods use to reach the broker")
    p.add_argument("--standalone", action="store_true", default=None,
                   help="no peering (a single replica); otherwise replicas elect one active via kopf peering")
    p.add_argument("--peering", help="kopf peering name shared by the replicas (default pdserve)")
    p.add_argument("--priority", type=int, help="peering priority (default: derived from the pod name)")
    p.add_argument("--replicas", type=int, help="how many operator replicas run; with 1, a missing peering object "
                   "means standalone with a warning (default: unknown, so the operator waits for it)")
    p.add_argument("--liveness", help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--metrics-port", type=int, help="port of the operator's Prometheus /metrics (default: not served)")
    p.add_argument("--kubeconfig", help="kubeconfig file outside a cluster (default: $KUBECONFIG)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pdserve_worker import logs

    from pdserve_operator.runner import run as run_operator
    from pdserve_operator.runtime import OperatorConfig

    logs.setup("operator")
    flags = {
        "namespaces": args.namespaces,
        "image": args.image,
        "broker_port": args.broker_port,
        "broker_address": args.broker_address,
        "standalone": args.standalone,
        "peering": args.peering,
        "priority": args.priority,
        "replicas": args.replicas,
        "liveness": args.liveness,
        "metrics_port": args.metrics_port,
        "kubeconfig": args.kubeconfig,
    }
    config = OperatorConfig(**{k: v for k, v in flags.items() if v is not None})
    run_operator(config)
    return 0
