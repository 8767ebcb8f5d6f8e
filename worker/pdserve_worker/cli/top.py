"""`pdserve top`: a terminal view of a running deployment from its routers' `/metrics`.

    pdserve top --url http://127.0.0.1:8000 [--url ...] [--interval 2] [--once]

Every `--interval` seconds: workers the routers reach by role, requests in flight, KV slot usage
per decode, and over the interval request and token rates, TTFT/TPOT percentiles, failures and
resumes (top_view.py). `--once` prints one view after one interval and exits (scripts, tests).
"""

from __future__ import annotations

import argparse
import ssl
import sys
import time


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("top", help="a terminal view of a running deployment from its routers' metrics")
    p.add_argument(
        "--url", action="append", required=True, help="a router's base URL (repeatable: every router of the deployment)"
    )
    p.add_argument("--ca", default=None, help="CA file to verify https routers with")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between two scrapes (default 2)")
    p.add_argument("--once", action="store_true", help="print one view and exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import httpx

    from pdserve_worker.cli.top_view import parse, render, view

    if args.interval <= 0:
        print(f"pdserve top: --interval must be positive, got {args.interval}", file=sys.stderr)
        return 2
    verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=args.ca) if args.ca else True
    urls = [u.rstrip("/") for u in args.url]

    def scrape(client: httpx.Client) -> list[str]:
        return [client.get(f"{u}/metrics").raise_for_status().text for u in urls]

    with httpx.Client(timeout=10, verify=verify) as client:
        try:
            prev, then = parse(scrape(client)), time.monotonic()
            while True:
                time.sleep(args.interval)
                cur, now = parse(scrape(client)), time.monotonic()
                text = render(view(prev, cur, now - then, len(urls)), ", ".join(urls))
                if args.once:
                    print(text)
                    return 0
                sys.stdout.write("\x1b[H\x1b[2J" + text + "\n")  # home, clear: redraw in place
                sys.stdout.flush()
                prev, then = cur, now
        except httpx.HTTPError as exc:
            print(f"pdserve top: cannot read metrics: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 0
