"""`pdserve chat`: an interactive, multi-turn conversation with a router, streamed.

Each turn sends the whole conversation so far (the router is stateless), prints the reply as
it arrives and a key=value timing line on stderr. `/reset` starts over, `/exit` or end of
input leaves. A failed turn is reported and forgotten, so the conversation can go on.
"""

from __future__ import annotations

import argparse
import os
import ssl
import sys
from collections.abc import Iterator


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with a router interactively (multi-turn, streamed)")
    p.add_argument("--url", required=True, help="router base URL, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--ca",
        default=None,
        help="CA file to verify an https router with (pdserve local --tls: ca.crt in its log folder)",
    )
    p.add_argument("--model", default=None, help="model name (default: the one the router serves)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="API key for a router with keys on (default: $OPENAI_API_KEY)",
    )
    p.add_argument("--system", default=None, help="a system message to start the conversation with")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="tokens per reply at most (default: the rest of the model's context)",
    )
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for a reply")
    p.set_defaults(func=run)


def _user_lines() -> Iterator[str]:
    """Lines typed by the user; the prompt goes to stderr so stdout holds only the replies."""
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401  (line editing and history for input())
    while True:
        if interactive:
            try:
                line = input("you> ")
            except EOFError:
                return
        else:
            sys.stderr.write("you> ")
            sys.stderr.flush()
            line = sys.stdin.readline()
            if not line:
                return
        yield line.rstrip("\n")


def run(args: argparse.Namespace) -> int:
    import httpx

    from pdserve_worker.cli.client import ApiCallError, RouterClient

    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    with RouterClient(
        args.url,
        timeout_s=args.timeout,
        verify=ssl.create_default_context(cafile=args.ca) if args.ca else True,
        api_key=args.api_key,
    ) as client:
        try:
            model = args.model or client.served_model()
        except (ApiCallError, httpx.TransportError) as exc:
            print(f"pdserve chat: cannot use {args.url}: {exc}", file=sys.stderr)
            return 1
        opening = [{"role": "system", "content": args.system}] if args.system else []
        history = list(opening)
        for line in _user_lines():
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                break
            if text == "/reset":
                history = list(opening)
                print("(conversation reset)", file=sys.stderr)
                continue
            turn = [*history, {"role": "user", "content": line}]
            body: dict[str, object] = {
                "model": model,
                "messages": turn,
                "temperature": args.temperature,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if args.max_tokens is not None:
                body["max_tokens"] = args.max_tokens
            try:
                answer = client.complete(body, chat=True, on_text=show)
            except (ApiCallError, httpx.TransportError) as exc:
                print(f"\npdserve chat: {exc}", file=sys.stderr)
                continue
            sys.stdout.write("\n")
            sys.stdout.flush()
            print(answer.stats.summary(), file=sys.stderr)
            history = [*turn, {"role": "assistant", "content": answer.text}]
    return 0
