"""What the serving tests talk to a deployment with: the official `openai` client that asks for
the serving workers' names (`x-pdserve-debug: workers`, so a test can check where a request
went), and a `/metrics` page read into {sample: value}."""

from __future__ import annotations

import re
from typing import Any

METRIC_LINE = re.compile(r"^([a-z_]+(?:\{[^}]*\})?) ([0-9.e+-]+)$", re.M)


def debug_client(url: str, timeout_s: float = 120.0) -> Any:
    import openai

    return openai.OpenAI(
        base_url=f"{url}/v1",
        api_key="unused",
        max_retries=0,
        timeout=timeout_s,
        default_headers={"x-pdserve-debug": "workers"},
    )


def scrape(address: str) -> dict[str, float]:
    """The samples of http://`address`/metrics (labels as Prometheus prints them, sorted)."""
    import httpx

    text = httpx.get(f"http://{address}/metrics").text
    return {m.group(1): float(m.group(2)) for m in METRIC_LINE.finditer(text)}
