"""``Feed.run(handler, concurrency=N)``: N handlers at once, each key's events in order.

An event's *order key* is its table and primary-key values. Events are spread over N lanes by
the hash of their key; each lane is one task handling its events one after the other, so two
events of one key are handled in the order the feed delivered them (commit order), and a retry
holds back its lane (the later events of its key, and of the keys that share the lane) until it
succeeded or was dead-lettered. Events with no key of their own are *barriers*, handled alone
after every lane drained: a truncate, and an update that changed the primary key (it follows
the old key's events and precedes the new key's). A table without a primary key is one key.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from typing import TYPE_CHECKING, Any

from walbus.client.event import FeedEvent
from walbus.contract import RowImage

if TYPE_CHECKING:
    from walbus.client.feed import Feed

LANE_DEPTH = 64  # events queued per lane: the feed reads ahead at most N * LANE_DEPTH events

Handler = Callable[[FeedEvent], Awaitable[None]]


def order_key(event: FeedEvent) -> Hashable | None:
    """The key whose events must stay in order; None for a barrier.

    The primary-key values come from the new row, else the identity (``event.key_values()``);
    an update whose identity holds other key values changed its key.
    """
    if event.operation == "truncate":
        return None
    pk = event.pk
    new, ident = event.new, event.identity
    key = _key_in(new, pk) if new is not None and pk else None
    if key is None:
        key = _key_in(ident, pk) if ident is not None and pk else None
        if key is None:
            return (event.table,)
    elif event.operation == "update" and ident is not None:
        old = _key_in(ident, pk)
        if old is not None and old != key:
            return None
    return (event.table, *key)


# Column positions by column names (the last of a repeated name, as RowImage.as_dict): a
# table's events repeat the same names, so each is indexed once.
_column_index: dict[tuple[str, ...], dict[str, int]] = {}
_MAX_INDEXED = 4096  # distinct column lists kept; beyond, the memory starts again (schema churn, junk)


def _key_in(image: RowImage, pk: tuple[str, ...]) -> tuple[Any, ...] | None:
    """The values of ``pk``'s columns in ``image``, in key order; None when one is missing."""
    columns = image.columns
    index = _column_index.get(columns)
    if index is None:
        if len(_column_index) >= _MAX_INDEXED:
            _column_index.clear()
        index = _column_index[columns] = {c: i for i, c in enumerate(columns)}
    values = image.values
    try:
        if len(pk) == 1:  # the common key: no loop
            return (values[index[pk[0]]],)
        key = []
        for c in pk:
            key.append(values[index[c]])
        return tuple(key)
    except KeyError:
        return None


def lane_of(key: Hashable, lanes: int) -> int:
    try:
        return hash(key) % lanes
    except TypeError:  # a key value that is not hashable (never from contract v1): its text
        return hash(repr(key)) % lanes


class _Lane:
    """One lane's events, handled one after the other by its own task.

    A deque and two futures instead of an asyncio.Queue: the queue's put/get/task_done
    bookkeeping was a fifth of run(concurrency=N)'s time per event.
    """

    __slots__ = ("_wake", "_watchers", "events", "handling")

    def __init__(self) -> None:
        self.events: deque[FeedEvent] = deque()
        self.handling = False  # its task is inside the handler
        self._wake: asyncio.Future[None] | None = None  # its task waits for events
        self._watchers: list[asyncio.Future[None]] = []  # the dispatcher waits for room or a drain

    @property
    def idle(self) -> bool:
        return not self.events and not self.handling

    def push(self, event: FeedEvent) -> None:
        self.events.append(event)
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def next_event(self) -> FeedEvent:
        while not self.events:
            self._wake = asyncio.get_running_loop().create_future()
            try:
                await self._wake
            finally:
                self._wake = None
        return self.events.popleft()

    def changed(self) -> asyncio.Future[None]:
        """Done after the lane's task finished its next event."""
        watcher: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._watchers.append(watcher)
        return watcher

    def finished_one(self) -> None:
        self.handling = False
        if self._watchers:
            watchers, self._watchers = self._watchers, []
            for w in watchers:
                if not w.done():
                    w.set_result(None)


class Dispatcher:
    def __init__(self, feed: Feed, handler: Handler, concurrency: int) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self._feed = feed
        self._handler = handler
        self._lanes = [_Lane() for _ in range(concurrency)]
        self._workers: list[asyncio.Task[None]] = []

    async def run(self) -> None:
        feed = self._feed
        if len(self._lanes) == 1:
            while True:
                try:
                    event = feed._take_buffered() or await feed._next_event()
                except StopAsyncIteration:
                    return
                await feed.handle(event, self._handler)
        self._workers = [asyncio.create_task(self._work(lane)) for lane in self._lanes]
        lanes = self._lanes
        try:
            while True:
                try:
                    event = feed._take_buffered() or await feed._next_event()
                except StopAsyncIteration:
                    break
                key = order_key(event)
                if key is None:
                    await self._drain()
                    await feed.handle(event, self._handler)
                    continue
                lane = lanes[lane_of(key, len(lanes))]
                while len(lane.events) >= LANE_DEPTH:
                    await self._until(lane.changed())
                lane.push(event)
            await self._drain()
        finally:
            for w in self._workers:
                w.cancel()
            await asyncio.gather(*self._workers, return_exceptions=True)

    async def _work(self, lane: _Lane) -> None:
        feed, handler = self._feed, self._handler
        while True:
            event = lane.events.popleft() if lane.events else await lane.next_event()
            lane.handling = True
            try:
                await feed.handle(event, handler)
            finally:
                lane.finished_one()

    async def _until(self, waiting: Awaitable[object]) -> None:
        """Await ``waiting``, but raise at once if a lane's task died (never wait on it forever)."""
        task = asyncio.ensure_future(waiting)
        try:
            done, _ = await asyncio.wait([task, *self._workers], return_when=asyncio.FIRST_COMPLETED)
            for w in self._workers:
                if w in done:
                    w.result()  # raises its error
                    raise RuntimeError("a feed worker stopped")
            await task
        finally:
            task.cancel()

    async def _drain(self) -> None:
        """Until every lane handled all its events (before a barrier, and at the end)."""
        for lane in self._lanes:
            while not lane.idle:
                await self._until(lane.changed())
