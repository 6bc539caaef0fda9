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
import contextvars
from asyncio.tasks import _enter_task, _leave_task
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Generator, Hashable
from types import CoroutineType
from typing import TYPE_CHECKING, Any

from walbus.client.event import FeedEvent
from walbus.contract import RowImage
from walbus.native import native_module

if TYPE_CHECKING:
    from walbus.client.feed import Feed

LANE_DEPTH = 16  # events queued per lane: the feed reads ahead at most N * LANE_DEPTH + RUN_EVENTS events
# (16 rather than 64: fewer events decoded ahead stay in the CPU caches; run(8) +10% on bench.client)

# Events taken from the feed's buffer at once (one check of what is due per run of them):
# at most this many are in flight beyond the lanes' queues.
RUN_EVENTS = 32

Handler = Callable[[FeedEvent], Awaitable[None]]


class _Started:
    """A handler call the dispatcher started on an idle lane that did not finish at once:
    suspended at its first await (``coro`` and what it yielded), or failed (``error``). The
    lane's task goes on with it before the lane's later events."""

    __slots__ = ("coro", "error", "event", "step")

    def __init__(self, event: FeedEvent, coro: Coroutine[Any, Any, Any] | None, step: Any, error: Exception | None) -> None:
        self.event, self.coro, self.step, self.error = event, coro, step, error


async def _awaiting(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


class _Resume:
    """Await the rest of a coroutine that already yielded ``step``: what ``await`` does for a
    fresh one (each value it yields goes up to the awaiting task, each value or exception the
    task sends or throws goes down to it), for one started by hand."""

    __slots__ = ("coro", "step", "throw")

    def __init__(self, coro: Coroutine[Any, Any, Any], step: Any, throw: BaseException | None = None) -> None:
        self.coro, self.step, self.throw = coro, step, throw

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, step = self.coro, self.step
        if self.throw is not None:  # a cancellation that reached the task before it took the coroutine over
            try:
                step = coro.throw(self.throw)
            except StopIteration as stop:
                return stop.value
        while True:
            try:
                sent = yield step
            except BaseException as e:  # cancellation (or close) of the awaiting task: the handler's
                try:
                    step = coro.throw(e)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    step = coro.send(sent)
                except StopIteration as stop:
                    return stop.value


def order_key(event: FeedEvent) -> Hashable | None:
    """The key whose events must stay in order; None for a barrier.

    The primary-key values come from the new row, else the identity (``event.key_values()``);
    an update whose identity holds other key values changed its key.
    """
    operation = event.operation
    if operation == "truncate":
        return None
    pk, table = event.pk, event.table
    if not pk:
        return (table,)
    new, ident = event.new, event.identity
    if new is not None:
        key = _key_in(new, pk, table)
        if key is not None:
            if operation == "update" and ident is not None:
                old = _key_in(ident, pk, table)
                if old is not None and old != key:
                    return None
            return key
        if operation == "update":
            return None  # a key column's unchanged TOAST value is not in the row: key unknown here
    if ident is not None:
        key = _key_in(ident, pk, table)
        if key is not None:
            return key
    return (table,)


# Where a key's columns are in a row image, by its column names and key: a table's events
# repeat the same names, so each pair is indexed once.
_key_positions: dict[tuple[tuple[str, ...], tuple[str, ...]], tuple[int, ...] | None] = {}
_MAX_INDEXED = 4096  # pairs kept; beyond, the memory starts again (schema churn, junk)
# The pair looked up last, by identity: a table's events share one tuple of names and one of
# key columns (the decoder keeps them), so most events need no tuple hash at all.
_last_positions: tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...] | None] = ((), (), None)


def _positions(columns: tuple[str, ...], pk: tuple[str, ...]) -> tuple[int, ...] | None:
    """Each of ``pk``'s columns' place in ``columns`` (the last of a repeated name, as
    RowImage.as_dict); None when one is missing."""
    found = _key_positions.get((columns, pk), ())
    if found == ():
        index = {c: i for i, c in enumerate(columns)}
        found = tuple(index[c] for c in pk) if all(c in index for c in pk) else None
        if len(_key_positions) >= _MAX_INDEXED:
            _key_positions.clear()
        _key_positions[columns, pk] = found
    return found


def _key_in(image: RowImage, pk: tuple[str, ...], table: str) -> tuple[Any, ...] | None:
    """``(table, *the values of pk's columns in image)``; None when one is missing."""
    global _last_positions
    columns = image.columns
    last_columns, last_pk, positions = _last_positions
    if last_columns is not columns or last_pk is not pk:
        positions = _positions(columns, pk)
        _last_positions = (columns, pk, positions)
    if positions is None:
        return None
    values = image.values
    if len(positions) == 1:  # the common key: no loop
        return (table, values[positions[0]])
    return (table, *[values[i] for i in positions])


def lane_of(key: Hashable, lanes: int) -> int:
    try:
        return hash(key) % lanes
    except TypeError:  # a key value that is not hashable (never from contract v1): its text
        return hash(repr(key)) % lanes


def _python_lane(event: FeedEvent, lanes: int) -> int | None:
    key = order_key(event)
    return None if key is None else lane_of(key, lanes)


def _native_lanes() -> Callable[[FeedEvent, int], int | None] | None:
    """``walbus_native.OrderLanes(...).lane``: the same lane as :func:`_python_lane`, without its
    Python frames (it raises TypeError for what the Python path must decide)."""
    native = native_module()
    if native is None or not hasattr(native, "OrderLanes"):
        return None
    lanes: Callable[[FeedEvent, int], int | None] = native.OrderLanes(
        ("operation", "pk", "table", "new", "identity"), ("columns", "values"), "truncate", "update").lane
    return lanes


_native_lane = _native_lanes()


def event_lane(event: FeedEvent, lanes: int) -> int | None:
    """The lane of ``event`` among ``lanes``: its order key's hash; None for a barrier."""
    if _native_lane is not None:
        try:
            return _native_lane(event, lanes)
        except TypeError:
            pass
    return _python_lane(event, lanes)


class _Lane:
    """One lane's events, handled one after the other by its own task.

    A deque and two futures instead of an asyncio.Queue: the queue's put/get/task_done
    bookkeeping was a fifth of run(concurrency=N)'s time per event.
    """

    __slots__ = ("_wake", "_watchers", "context", "events", "handling", "task")

    def __init__(self) -> None:
        self.events: deque[FeedEvent | _Started] = deque()
        self.handling = False  # its task is inside the handler
        # Where its handlers run, the part the dispatcher starts too: one context a lane, as
        # when every handler ran in the lane's task.
        self.context = contextvars.copy_context()
        self._wake: asyncio.Future[None] | None = None  # its task waits for events
        self.task: asyncio.Task[None] | None = None  # the lane's task
        self._watchers: list[asyncio.Future[None]] = []  # the dispatcher waits for room or a drain

    @property
    def idle(self) -> bool:
        return not self.events and not self.handling

    def push(self, event: FeedEvent | _Started) -> None:
        self.events.append(event)
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def next_event(self) -> FeedEvent | _Started:
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
        self._closing = False

    async def run(self) -> None:
        feed = self._feed
        if len(self._lanes) == 1:
            while True:
                try:
                    event = feed._take_buffered() or await feed._next_event()
                except StopAsyncIteration:
                    return
                await feed.handle(event, self._handler)
        self._workers = [asyncio.create_task(self._work(lane), context=lane.context) for lane in self._lanes]
        for lane, task in zip(self._lanes, self._workers, strict=True):
            lane.task = task
        # Each lane's task to its first wait: a handler started as one that has not run yet, and
        # cancelling it (its own task.cancel()), would kill it before it took the handler over.
        await asyncio.sleep(0)
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        assert me is not None
        lanes = self._lanes
        n = len(lanes)
        native_lane = _native_lane
        handler, acked = self._handler, feed._acked
        try:
            while True:
                events = feed._take_buffered_run(RUN_EVENTS)
                if events is None:
                    try:
                        events = [await feed._next_event()]
                    except StopAsyncIteration:
                        break
                for event in events:
                    if event._settler.state.revoked:  # type: ignore[union-attr]
                        continue  # taken away while an earlier one waited: its new owner has it
                    # event_lane(event, n), inline: once per event.
                    try:
                        at = native_lane(event, n) if native_lane is not None else _python_lane(event, n)
                    except TypeError:
                        at = _python_lane(event, n)
                    if at is None:
                        await self._drain()
                        await feed.handle(event, self._handler)
                        continue
                    lane = lanes[at]
                    if not lane.events and not lane.handling:
                        # An idle lane: start the handler here, in the lane's context and as the
                        # lane's task, as an eager task would. One that returns without awaiting
                        # is done (and acked) with no hand-over; else the lane's task goes on with
                        # it. As the lane's task: what the handler's first step binds to the
                        # current task (asyncio.timeout, a TaskGroup) is then the task that runs
                        # the rest of it (bound to this one, a handler's timeout cancelled run()).
                        worker: Any = lane.task
                        _leave_task(loop, me)
                        _enter_task(loop, worker)
                        try:
                            try:
                                # A plain function may raise at once, or return any awaitable (a
                                # gather, a Task): started by hand it must be a coroutine.
                                coro: Any = lane.context.run(handler, event)
                                if type(coro) is not CoroutineType:
                                    coro = _awaiting(coro)
                                step = lane.context.run(coro.send, None)
                            finally:
                                _leave_task(loop, worker)
                                _enter_task(loop, me)
                        except StopIteration:
                            # feed._handled(event), inline: once per event.
                            delivery: Any = event._settler
                            if delivery.outcome == "pending":
                                acked(delivery)
                            continue
                        except Exception as e:
                            lane.push(_Started(event, None, None, e))  # retried (or dead-lettered) by the lane
                            continue
                        lane.push(_Started(event, coro, step, None))
                        continue
                    while len(lane.events) >= LANE_DEPTH:
                        await self._until(lane.changed())
                    lane.push(event)
            await self._drain()
        finally:
            self._closing = True
            for w in self._workers:
                w.cancel()
            await asyncio.gather(*self._workers, return_exceptions=True)

    async def _work(self, lane: _Lane) -> None:
        feed, handler = self._feed, self._handler
        while True:
            cancel: BaseException | None = None
            if lane.events:
                item = lane.events.popleft()
            else:
                try:
                    item = await lane.next_event()
                except asyncio.CancelledError as e:
                    # A handler the dispatcher started as this task cancelled it (its timeout
                    # expired at once, say) before this task took the handler over: the
                    # cancellation is the handler's.
                    if self._closing or not (lane.events and isinstance(lane.events[0], _Started)):
                        raise
                    item, cancel = lane.events.popleft(), e
            lane.handling = True
            try:
                # feed.handle(event, handler), without its coroutine: once per event.
                try:
                    if isinstance(item, _Started):
                        event = item.event
                        if item.error is not None:
                            raise item.error
                        assert item.coro is not None
                        await _Resume(item.coro, item.step, cancel)
                    else:
                        event = item
                        if event._settler.state.revoked:  # type: ignore[union-attr]
                            # Its partition was taken away while it waited in the lane: not
                            # started, so its new owner (or this member, given it back) has it.
                            continue
                        await handler(event)
                except Exception as e:
                    await feed._handle_failed(event, handler, e)
                else:
                    feed._handled(event)
            finally:
                if lane._watchers:
                    lane.finished_one()
                else:
                    lane.handling = False

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
