"""The endpoint picker's body parsing (gateway/body_parse.py, #58 A3): what it parses, what it
leaves unparsed and why (size, a full queue, a spent CPU budget), and that a routed request
still follows its affinity when its body was not parsed."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve_worker.gateway import body_parse as bp
from pdserve_worker.gateway import ext_proc
from pdserve_worker.gateway.endpoint_picker import Candidate


@pytest.mark.asyncio
async def test_small_bodies_are_parsed_and_bad_ones_named() -> None:
    parser = bp.BodyParser()
    assert await parser.parse(b'{"model": "m"}') == {"model": "m"}
    with pytest.raises(bp.InvalidBody, match="not JSON$"):
        await parser.parse(b"{nope")
    with pytest.raises(bp.InvalidBody, match="not a JSON object"):
        await parser.parse(b"null")


@pytest.mark.asyncio
async def test_a_body_over_the_parse_bound_is_left_unparsed() -> None:
    parser = bp.BodyParser(bp.ParseLimits(max_parse_bytes=100))
    assert await parser.parse(json.dumps({"prompt": "x" * 200}).encode()) == bp.Unparsed("size")
    assert parser.unparsed["size"] == 1


@pytest.mark.asyncio
async def test_the_cpu_budget_is_charged_with_the_parse_time_and_then_refuses() -> None:
    now = [0.0]
    ticks = iter([0.0, 0.0, 0.0, 2.0])  # the parse's start and end, timed in its thread: 2 s

    def clock() -> float:
        return next(ticks, now[0])

    parser = bp.BodyParser(bp.ParseLimits(cpu_seconds_per_minute=1.0), clock=clock)
    assert await parser.parse(b"{}") == {}
    assert await parser.parse(b"{}") == bp.Unparsed("budget")  # 1 s in debt
    assert parser.unparsed["budget"] == 1
    now[0] = 200.0  # refilled
    assert await parser.parse(b"{}") == {}


@pytest.mark.asyncio
async def test_past_the_queue_a_body_is_left_unparsed() -> None:
    parser = bp.BodyParser(bp.ParseLimits(threads=1, queue=2))
    gate = asyncio.Event()
    loop = asyncio.get_running_loop()

    def slow(raw: bytes) -> tuple[object, float]:
        asyncio.run_coroutine_threadsafe(gate.wait(), loop).result()
        return {}, 0.0

    parser._run = slow  # type: ignore[method-assign]  # (parses that take as long as the test says)
    waiting = [asyncio.create_task(parser.parse(b"{}")) for _ in range(2)]
    await asyncio.sleep(0.05)
    assert parser.in_progress == 2
    assert await parser.parse(b"{}") == bp.Unparsed("busy")
    gate.set()
    assert await asyncio.gather(*waiting) == [{}, {}]
    assert parser.in_progress == 0


@pytest.mark.asyncio
async def test_an_unparsed_body_is_routed_by_its_first_bytes() -> None:
    routers = [Candidate(f"10.0.0.{i}:8000") for i in range(8)]
    limits = ext_proc.PickerLimits(parse=bp.ParseLimits(max_parse_bytes=64))
    picker = ext_proc.EndpointPicker("m", lambda: routers, limits)
    body = json.dumps({"model": "another", "prompt": "y" * 500}).encode()
    first = await picker._from_body(body)
    again = await picker._from_body(body)
    assert first.WhichOneof("response") == "request_body"  # routed (the router checks the model)
    assert first.request_body == again.request_body
    assert picker.parser.unparsed["size"] == 2
