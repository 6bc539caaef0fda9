"""Backoff: exponential steps with jitter, in seconds (no services)."""

from __future__ import annotations

from walbus.retry import Backoff


def test_delays_are_jittered_below_the_exponential_step() -> None:
    backoff = Backoff(initial=1.0, maximum=8.0)
    for failures, step in ((1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (9, 8.0)):
        backoff.failures = failures
        delays = {backoff.next_delay() for _ in range(200)}
        assert all(step * 0.5 <= d <= step for d in delays), (failures, min(delays), max(delays))
        assert len(delays) > 100, "no jitter: processes that failed together would retry together"


def test_no_jitter_when_asked() -> None:
    backoff = Backoff(initial=0.5, maximum=10.0, jitter=0.0, failures=3)
    assert backoff.next_delay() == backoff.step() == 2.0
