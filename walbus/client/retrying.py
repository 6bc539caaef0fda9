"""How often, and how long apart, a feed hands a failed event to its handler again."""

from __future__ import annotations

import random
from dataclasses import dataclass

from walbus.retry import Backoff


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """``attempts`` deliveries in all (the first included), then the dead-letter topic.

    The delay before delivery ``n + 1`` is ``initial * 2**(n-1)`` capped at ``maximum``, times a
    random factor in ``[1 - jitter, 1 + jitter]`` so that a fleet of consumers failing on one
    cause does not retry in lockstep.
    """

    attempts: int = 5
    initial: float = 1.0
    maximum: float = 60.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("RetryPolicy.attempts counts the first delivery: at least 1")
        if self.initial < 0 or self.maximum < self.initial:
            raise ValueError("RetryPolicy needs 0 <= initial <= maximum")
        if not 0 <= self.jitter <= 1:
            raise ValueError("RetryPolicy.jitter is a fraction in [0, 1]")

    def exhausted(self, attempt: int) -> bool:
        """Whether delivery number ``attempt`` was the last one allowed."""
        return attempt >= self.attempts

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after delivery number ``attempt`` failed."""
        base = Backoff(initial=self.initial, maximum=self.maximum, failures=attempt).step()
        factor = 1.0 + self.jitter * (2.0 * (rng or random).random() - 1.0)
        return base * factor
