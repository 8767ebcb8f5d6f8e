"""`pdserve complete`: send one prompt to a router, print the answer and how long it took.

The answer goes to stdout (token by token with `--stream`); one key=value line with time to
first token, time per output token and, when the router reports it, the KV moved from
prefill to decode goes to stderr, so `pdserve complete ... > answer.txt` keeps them apart.
"""

from __future__ import annotations

import argparse
import os
import ssl
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("complete", help="send one prompt to a router; print the answer and its timing")
    p.add_argument("--url", required=True, help="router base URL, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--ca",
        default=None,
        help="CA file to verify an https router with (pdserve local --tls: ca.crt in its log folder)",
    )
    p.add_argument("--prompt", required=True, help="the prompt (a user message with --chat)")
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions (the model's chat template)")
    p.add_argument("--model", default=None, help="model name (default: the one the router serves)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="API key for a router with keys on (default: $OPENAI_API_KEY)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="tokens to generate at most (default: the server's, 16 for a completion, "
        "the rest of the context for --chat)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument("--stream", action="store_true", help="stream the answer as it is generated")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the answer")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import httpx

    from pdserve_worker.cli.client import ApiCallError, RouterClient

    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        with RouterClient(
            args.url,
            timeout_s=args.timeout,
            verify=ssl.create_default_context(cafile=args.ca) if args.ca else True,
            api_key=args.api_key,
        ) as client:
            model = args.model or client.served_model()
            body: dict[str, object] = {"model": model, "temperature": args.temperature, "stream": args.stream}
            if args.max_tokens is not None:
                body["max_tokens"] = args.max_tokens
            if args.stream:
                body["stream_options"] = {"include_usage": True}
            if args.stop:
                body["stop"] = args.stop
            if args.chat:
                body["messages"] = [{"role": "user", "content": args.prompt}]
            else:
                body["prompt"] = args.prompt
            answer = client.complete(body, chat=args.chat, on_text=show)
    except ApiCallError as exc:
        print(f"pdserve complete: {exc}", file=sys.stderr)
        return 1
    except httpx.TransportError as exc:
        print(f"pdserve complete: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write("\n")
    print(answer.stats.summary(), file=sys.stderr)
    return 0
