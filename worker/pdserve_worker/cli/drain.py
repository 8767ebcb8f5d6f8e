"""`pdserve drain`: drain this pod's decode worker (the pod's preStop hook).

Calls `GET /drain` on the worker's admin port, which listens on 127.0.0.1 only, with the
service's token from the pod's environment: so it works from inside the pod (a preStop exec
hook, `kubectl exec`) and nowhere else. Returns once the worker has drained (or its drain
timeout passed) and left the broker; prints the worker's answer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def register(sub: argparse._SubParsersAction) -> None:
    from pdserve_common import pod_env as E

    p = sub.add_parser("drain", help="drain this pod's decode worker (its preStop hook)")
    p.add_argument(
        "--port",
        type=int,
        default=int(os.environ.get(E.ADMIN_PORT_ENV) or E.ADMIN_PORT),
        help=f"the worker's admin port on 127.0.0.1 (default ${E.ADMIN_PORT_ENV} or {E.ADMIN_PORT})",
    )
    p.add_argument(
        "--timeout", type=float, default=None, help=f"seconds to wait (default ${E.DRAIN_TIMEOUT_SECONDS} + 30, or 90)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import httpx

    from pdserve_common import pod_env as E
    from pdserve_worker.process.pod_http import ADMIN_HOST

    token = os.environ.get(E.BROKER_TOKEN, "")
    if not token:
        print(f"pdserve drain: ${E.BROKER_TOKEN} is not set (run it inside the worker's pod)", file=sys.stderr)
        return 2
    timeout = args.timeout if args.timeout is not None else float(os.environ.get(E.DRAIN_TIMEOUT_SECONDS) or 60) + 30
    url = f"http://{ADMIN_HOST}:{args.port}/drain"
    try:
        reply = httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout)
    except httpx.HTTPError as exc:
        print(f"pdserve drain: cannot reach {url}: {exc}", file=sys.stderr)
        return 1
    if reply.status_code != 200:
        print(f"pdserve drain: {url} answered {reply.status_code}: {reply.text[:200]}", file=sys.stderr)
        return 1
    print(json.dumps(reply.json()))
    return 0
