"""Exponential backoff for transient faults: 1 s doubling to a cap, attempts optional."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass


@dataclass
class Backoff:
    initial: float = 1.0
    maximum: float = 60.0
    attempts: int = 0  # 0: retry forever
    failures: int = 0

    @property
    def exhausted(self) -> bool:
        return self.attempts > 0 and self.failures >= self.attempts

    def next_delay(self) -> float:
        return float(min(self.initial * 2.0 ** max(self.failures - 1, 0), self.maximum))

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
        log.warning(f"{what} failed, retrying", extra={"error": str(error), "attempt": self.failures, "retry_in_s": delay})
        if stop is None:
            await asyncio.sleep(delay)
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)

    def reset(self) -> None:
        self.failures = 0
