"""vLLM's own prefill/decode disaggregation as a peer: the proxy in front of its two instances.

vLLM disaggregates with two servers and a proxy (its examples' `toy_proxy_server.py` and
`disagg_proxy_demo.py`): the proxy sends a completion to the prefill instance with max_tokens 1
(which computes the prompt's KV and, with a KV connector as `kv_producer`, saves it), then the
same request to the decode instance (a `kv_consumer`, which loads that KV instead of computing
it) and streams the decode's answer back. This is that proxy, written for benchmarks/vs_vllm.py
(`--servers vllm-pd`), where the two instances share the KV through files (ExampleConnector).

    python benchmarks/vllm_pd_proxy.py --port 18610 --prefill http://127.0.0.1:18611 \
        --decode http://127.0.0.1:18612
"""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


def app(prefill: str, decode: str) -> Starlette:
    client = httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=10.0))

    async def models(_: Request) -> Response:
        answer = await client.get(f"{decode}/v1/models")
        return Response(answer.content, answer.status_code, media_type="application/json")

    async def health(_: Request) -> Response:
        answers = [await client.get(f"{url}/health") for url in (prefill, decode)]
        ok = all(a.status_code == 200 for a in answers)
        return JSONResponse({"prefill": answers[0].status_code, "decode": answers[1].status_code}, 200 if ok else 503)

    async def completions(request: Request) -> Response:
        body = json.loads(await request.body())
        first = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        done = await client.post(f"{prefill}/v1/completions", json=first | {"max_tokens": 1, "min_tokens": 0})
        if done.status_code != 200:
            return Response(done.content, done.status_code, media_type="application/json")
        if not body.get("stream"):
            answer = await client.post(f"{decode}/v1/completions", json=body)
            return Response(answer.content, answer.status_code, media_type="application/json")
        upstream = client.build_request("POST", f"{decode}/v1/completions", json=body)
        response = await client.send(upstream, stream=True)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()

        return StreamingResponse(relay(), response.status_code, media_type="text/event-stream")

    routes = [
        Route("/v1/models", models),
        Route("/health", health),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    return Starlette(routes=routes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", required=True)
    parser.add_argument("--decode", required=True)
    args = parser.parse_args()
    uvicorn.run(app(args.prefill, args.decode), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
