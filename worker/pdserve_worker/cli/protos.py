"""`pdserve protos`: regenerate the checked-in gRPC stubs, or check that they are current."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("protos", help="regenerate the Python stubs of proto/pdserve/v1 (needs grpcio-tools)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a stub is stale")
    p.add_argument(
        "--proto-root",
        type=Path,
        default=None,
        help="folder holding pdserve/v1/*.proto (default: the installed pdserve package's)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pdserve_worker.rpc import codegen

    root = args.proto_root or codegen.proto_root()
    if args.check:
        stale = codegen.check(root)
        if stale:
            print(
                f"stale generated stubs under {root / 'pdserve' / 'v1'}: {', '.join(stale)}; run `pdserve protos`",
                file=sys.stderr,
            )
            return 1
        print("protos: stubs are current", file=sys.stderr)
        return 0
    for path in codegen.generate(root, root):
        print(path)
    return 0
