"""The `pdserve` command: a thin shell that dispatches to one module per subcommand.

Each subcommand lives in `pdserve_worker.cli.<name>` and exposes
`register(subparsers)`, which adds its parser and sets `func`. Heavy imports (torch, kopf)
happen inside the command's run function so that `pdserve crd` does not load torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Module names under pdserve_worker.cli, in the order `pdserve --help` lists them.
COMMANDS: tuple[str, ...] = (
    "info",
    "broker",
    "protos",
    "complete",
    "chat",
    "top",
    "crd",
    "operator",
    "generate",
    "worker",
    "drain",
    "local",
    "plan",
)


# Subcommands whose module name differs (no module may be called `operator`: stdlib shadowing).
_MODULES: dict[str, str] = {"operator": "operator_cmd"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="Prefill/decode disaggregated LLM serving (operator, workers, local deployment).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"pdserve_worker.cli.{_MODULES.get(name, name)}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pdserve_worker.util import stack_dump

    stack_dump.install()  # `kill -USR1 <pid>`: every thread's stack to stderr (util/stack_dump.py)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
