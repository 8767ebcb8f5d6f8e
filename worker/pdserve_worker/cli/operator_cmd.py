"""`pdserve operator`: reconcile PDInferenceService resources and host the broker.

(The module is not called `operator.py`: that would shadow the standard library's `operator`.)
The flags live beside the operator (`pdserve_operator.command`); this only mounts them.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from pdserve_operator.command import add_arguments

    p = sub.add_parser("operator", help="run the Kubernetes operator (kopf) and the broker")
    add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pdserve_common import logs
    from pdserve_operator.command import config_from_args
    from pdserve_operator.runner import run as run_operator

    logs.setup("operator")
    run_operator(config_from_args(args))
    return 0
