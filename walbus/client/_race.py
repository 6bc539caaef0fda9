"""Waiting for work that an event may call off (a Feed's nack, a Table's stop)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


# How long a task called off may take to clean up (it closes what it opened) before the caller
# goes on without it.
CLEANUP_S = 30.0


async def until_set(work: Coroutine[Any, Any, T], *events: asyncio.Event) -> asyncio.Task[T]:
    """Run ``work`` until it is done or one of ``events`` is set, whichever comes first; its
    task, cancelled in the second case (and when the caller is), and given time to clean up."""
    task = asyncio.ensure_future(work)
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait((task, *waiters), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait((task,), timeout=CLEANUP_S)
    return task
