"""`pdserve crd`: print the PDInferenceService CustomResourceDefinition (manifests/crd.yaml).

`pdserve crd --docs` prints the configuration reference instead (docs/configuration.md).
"""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("crd", help="print the PDInferenceService CRD as YAML (kubectl apply -f -)")
    p.add_argument("--docs", action="store_true", help="print the configuration reference (markdown) instead")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.docs:
        from pdserve_operator.config_docs import render

        sys.stdout.write(render())
        return 0
    from pdserve_operator.crd import crd_yaml

    sys.stdout.write(crd_yaml())
    return 0
