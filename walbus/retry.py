"""Exponential backoff with jitter for transient faults: 1 s doubling to a cap, attempts optional.

Each delay is drawn from [(1 - jitter) * d, d] where d is the exponential step: processes that
failed together (a broker restart) do not retry in lockstep. All delays are in seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from dataclasses import dataclass


@dataclass
class Backoff:
    initial: float = 1.0  # seconds
    maximum: float = 60.0  # seconds
    attempts: int = 0  # 0: retry forever
    failures: int = 0
    jitter: float = 0.5  # the share of each delay that is random

    @property
    def exhausted(self) -> bool:
        return self.attempts > 0 and self.failures >= self.attempts

    def step(self) -> float:
        """The exponential step of the current failure count, before jitter."""
        return float(min(self.initial * 2.0 ** max(self.failures - 1, 0), self.maximum))

    def next_delay(self) -> float:
        step = self.step()
        return step * (1.0 - self.jitter * random.random())

    async def wait(
        self, log: logging.Logger, what: str, error: BaseException, *, stop: asyncio.Event | None = None
    ) -> None:
        """Count one failure and sleep; raises ``error`` again when attempts are used up.

        ``stop``: the sleep ends early when it is set (a graceful shutdown must not wait out
        a minute of backoff)."""
        self.failures += 1
        if self.exhausted:
            raise error
        delay = self.next_delay()
        log.warning(f"{what} failed, retrying", extra={"error": str(error), "attempt": self.failures, "retry_in_s": round(delay, 3)})
        if stop is None:
            await asyncio.sleep(delay)
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)

    def reset(self) -> None:
        self.failures = 0
