import random

import pytest

from pdserve_worker.rpc.backoff import Backoff


def test_delay_doubles_up_to_the_cap_with_jitter_in_the_upper_half() -> None:
    backoff, rng = Backoff(base_s=0.1, cap_s=1.0), random.Random(7)
    for attempt, ceiling in [(0, 0.1), (1, 0.2), (2, 0.4), (3, 0.8), (4, 1.0), (60, 1.0), (10_000, 1.0)]:
        delays = [backoff.delay(attempt, rng) for _ in range(200)]
        assert all(ceiling / 2 <= d <= ceiling for d in delays), (attempt, min(delays), max(delays))
        assert max(delays) - min(delays) > ceiling / 4, "jitter must spread retries out"


def test_nonsense_is_refused() -> None:
    with pytest.raises(ValueError, match="base_s"):
        Backoff(base_s=2.0, cap_s=1.0)
