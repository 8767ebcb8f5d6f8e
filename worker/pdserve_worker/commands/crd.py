"""`pdserve crd`: print the PDInferenceService CustomResourceDefinition (manifests/crd.yaml)."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("crd", help="print the PDInferenceService CRD as YAML (kubectl apply -f -)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pdserve_operator.crd import crd_yaml

    sys.stdout.write(crd_yaml())
    return 0
