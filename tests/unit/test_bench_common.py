"""bench.common's machine figures: the host's steal share between two /proc/stat readings."""

from __future__ import annotations

from bench.common import cpu_times, steal_percent


def test_steal_is_the_share_of_cpu_time_the_host_took() -> None:
    assert steal_percent((1000, 10), (1400, 110)) == 25.0
    assert steal_percent((1000, 10), (1000, 10)) == 0.0  # no time passed: no division by zero
    total, steal = cpu_times()
    assert total > 0 and 0 <= steal <= total
