"""A request for several sequences — a /v1/completions list of prompts, or n > 1 on either
endpoint: one choice per sequence, as vLLM serves them (prompt-major: index = prompt × n + i).

Each prompt runs as a request of its own through the one request path (admission, tenant
limits, a decode slot, metrics, tracing: a list is no way around them), all at once, so the
backend batches them; this module only joins their answers. The full answer has their choices
in prompt order (`index` = the prompt's position) and the usage summed; the stream interleaves
their chunks as they come, each choice tagged with its prompt's index, then one usage chunk
(when asked) and one `[DONE]`. One prompt's error fails the request: an error before any
answer is the response (the others are cancelled and their slots released); one in a stream
is reported in-band, as a single request's is, and the stream ends.
n copies of a prompt share its prefill (api/prompt_copies.py); usage counts the prompt once,
as vLLM does.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any

from starlette.responses import JSONResponse, Response


def merge_bodies(bodies: Sequence[dict[str, Any]], n: int = 1) -> dict[str, Any]:
    """One response from the single-sequence ones: their choices in order, the usage summed."""
    merged = dict(bodies[0])
    merged["choices"] = [{**body["choices"][0], "index": i} for i, body in enumerate(bodies)]
    merged["usage"] = sum_usage([body["usage"] for body in bodies], n)
    merged.pop("pdserve", None)  # (per request: its workers and KV; not one figure for all)
    return merged


def sum_usage(usages: Sequence[dict[str, Any]], n: int = 1) -> dict[str, Any]:
    """The usage of the whole request: completions summed, each prompt counted once (every
    n-th answer is the first copy of a prompt)."""
    firsts = usages[::n]
    prompt = sum(u["prompt_tokens"] for u in firsts)
    completion = sum(u["completion_tokens"] for u in usages)
    cached = sum(u.get("prompt_tokens_details", {}).get("cached_tokens", 0) for u in firsts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def run_all(calls: Sequence[Callable[[], Awaitable[Response]]]) -> list[Response]:
    """Every call at once; if one raises, the others are cancelled and any stream they opened is
    closed (it holds a slot) before the error goes on."""
    tasks = [asyncio.ensure_future(call()) for call in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            close = getattr(result, "close", None)
            if close is not None:
                await close()
        raise


def full_response(responses: Sequence[Response], n: int = 1) -> Response:
    """The joined answer, or the first that is not an answer (a 499 for a client that left)."""
    for response in responses:
        if not isinstance(response, JSONResponse) or response.status_code != 200:
            return response
    bodies = [json.loads(bytes(r.body)) for r in responses]
    return JSONResponse(merge_bodies(bodies, n), headers={"x-request-id": bodies[0]["id"]})


def _data(event: str) -> str:
    return event.removeprefix("data: ").rstrip("\n")


async def merged_stream(
    streams: Sequence[Any], include_usage: bool, request_id: str, n: int = 1
) -> AsyncGenerator[str, None]:
    """The streams' events interleaved as they come, each choice given its prompt's index and
    every chunk the one id of the request (`request_id`, the first prompt's)."""
    queue: asyncio.Queue[tuple[int, str | None]] = asyncio.Queue()

    async def pump(index: int, stream: Any) -> None:
        try:
            async for event in stream.body_iterator:
                await queue.put((index, _data(event)))
        finally:
            await queue.put((index, None))

    pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    usages: dict[int, dict[str, Any]] = {}  # by sequence index: copies of a prompt are counted once
    last: dict[str, Any] = {}
    try:
        open_streams = len(streams)
        while open_streams:
            index, data = await queue.get()
            if data is None:
                open_streams -= 1
                continue
            if data == "[DONE]":
                continue
            payload = json.loads(data)
            if "error" in payload:  # a prompt failed in-band: so does the request
                yield f"data: {data}\n\n"
                break
            if not payload.get("choices") and payload.get("usage"):
                usages[index] = payload["usage"]
                continue
            for choice in payload["choices"]:
                choice["index"] = index
            payload["id"] = request_id
            last = payload
            yield f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"
        else:
            if include_usage and last:
                final = {**last, "choices": [], "usage": sum_usage([usages[i] for i in sorted(usages)], n)}
                final.pop("pdserve", None)
                yield f"data: {json.dumps(final, separators=(',', ':'), ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for stream in streams:
            await stream.close()
