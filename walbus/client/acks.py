"""Which offset a partition's consumer has finished with, when its events are acked out of order.

A partition's delivered events wait in offset order; the group may commit up to the end of the
longest acked prefix (the *contiguous* acks). Records between delivered events (filtered out,
duplicates, invalid) are finished with the delivered event after them.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol, TypeVar

from walbus.client.positions import Position


class Settled(Protocol):
    @property
    def offset(self) -> int: ...

    @property
    def position(self) -> Position: ...

    @property
    def outcome(self) -> str: ...


_S = TypeVar("_S", bound=Settled)


def acked_prefix(waiting: deque[_S]) -> tuple[int, Position] | None:
    """Pop the acked events at the front of ``waiting`` (in offset order).

    Returns the offset after the last one popped and the highest position popped (the replay
    topic's positions are not in offset order), or None when the front is not acked.
    """
    if not waiting or waiting[0].outcome != "acked":
        return None
    done = waiting.popleft()
    highest = done.position
    while waiting and waiting[0].outcome == "acked":
        done = waiting.popleft()
        if done.position > highest:
            highest = done.position
    return done.offset + 1, highest
