"""`pdserve broker`: run the broker on its own (the operator normally hosts it in-process).

Tokens come from `--tokens-file` (YAML or JSON `{service_key: token}`) and/or the env var
PDSERVE_BROKER_TOKENS (the same mapping as text: a mounted Secret); the file wins on a clash.
TLS when --tls-cert/--tls-key are given (or PDSERVE_TLS_CERT/_KEY/_CA). Stops cleanly on
SIGTERM or SIGINT: watchers are ended, unary calls get the grace period.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from pathlib import Path

TOKENS_ENV = "PDSERVE_BROKER_TOKENS"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("broker", help="run the membership broker (gRPC) stand-alone")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=50051, help="port to listen on; 0 picks a free one (default 50051)")
    p.add_argument("--tokens-file", type=Path, default=None, help="YAML/JSON mapping service_key -> token")
    p.add_argument("--ttl", type=float, default=10.0, help="lease TTL in seconds (default 10)")
    p.add_argument("--grace", type=float, default=2.0, help="seconds in-flight calls get on shutdown (default 2)")
    p.add_argument("--tls-cert", type=Path, default=None, help="server certificate chain (PEM)")
    p.add_argument("--tls-key", type=Path, default=None, help="server private key (PEM)")
    p.add_argument("--tls-ca", type=Path, default=None, help="CA that client certificates must chain to (mTLS)")
    p.set_defaults(func=run)


def parse_tokens(text: str, source: str) -> dict[str, str]:
    """A `{service_key: token}` mapping from YAML or JSON text; ValueError names the source."""
    import yaml

    try:
        data = yaml.safe_load(text) if text.strip() else {}
    except yaml.YAMLError as exc:
        raise ValueError(f"{source}: not YAML/JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{source}: want a mapping service_key -> token, got {type(data).__name__}")
    tokens: dict[str, str] = {}
    for key, token in data.items():
        if not isinstance(key, str) or key.count("/") != 1 or not all(key.split("/")):
            raise ValueError(f"{source}: service key must be 'namespace/name', got {key!r}")
        if not isinstance(token, str) or not token:
            raise ValueError(f"{source}: token of {key!r} must be a non-empty string")
        tokens[key] = token
    return tokens


def load_tokens(tokens_file: Path | None, env: dict[str, str] | os._Environ) -> dict[str, str]:
    tokens: dict[str, str] = {}
    if env.get(TOKENS_ENV):
        tokens.update(parse_tokens(env[TOKENS_ENV], f"${TOKENS_ENV}"))
    if tokens_file is not None:
        try:
            text = tokens_file.read_text()
        except OSError as exc:
            raise ValueError(f"cannot read tokens file {tokens_file}: {exc.strerror}") from exc
        tokens.update(parse_tokens(text, str(tokens_file)))
    return tokens


def run(args: argparse.Namespace) -> int:
    from pdserve_common import logs
    from pdserve_common.auth import TLSConfig
    from pdserve_operator.broker.server import BrokerServer

    log = logs.setup("broker")
    try:
        tokens = load_tokens(args.tokens_file, os.environ)
    except ValueError as exc:
        log.error(logs.kv(event="broker.bad_tokens", error=str(exc)))
        return 2
    if not tokens:
        log.warning(
            logs.kv(event="broker.no_tokens", hint=f"every call will be refused: give --tokens-file or ${TOKENS_ENV}")
        )
    tls = TLSConfig(args.tls_cert, args.tls_key, args.tls_ca) if args.tls_cert or args.tls_key else TLSConfig.from_env()

    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info(logs.kv(event="broker.signal", signal=signal.Signals(signum).name))
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server = BrokerServer(tokens, ttl_s=args.ttl, tls=tls)
    try:
        server.start(args.host, args.port)
    except (OSError, ValueError) as exc:
        log.error(logs.kv(event="broker.start_failed", host=args.host, port=args.port, error=str(exc)))
        return 1
    try:
        while not stop.wait(1.0):
            pass
    finally:
        server.stop(args.grace)
    logging.shutdown()
    return 0
