"""Feed: a database topic as an async stream of typed change events for one consumer group.

Delivery guarantees (see docs/client.md):

* events come in commit order (``(commit_lsn, seq)``; total with the default single partition);
* a record that is not a valid v1 event whose key is its own ``(commit_lsn, seq)`` is
  skipped (error log line, ``stats.invalid_skipped``, ``walbus_client_invalid_records``) and
  moves no position;
* a record whose position is not above the highest position already read from its partition
  is a duplicate (the producer re-sends after a crash) and is skipped; the group's highest
  finished position is committed with its offset as metadata, so a restarted consumer skips
  duplicates that were written after the committed offset too;
* an offset is committed only after the caller has finished with the event (the loop body
  returned), so delivery into the caller is at-least-once, without duplicates within a run;
  for exactly-once effects store the position with your effects and pass ``resume_after``.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import re
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from itertools import islice
from types import TracebackType
from typing import Any, Final, Literal

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import ConsumerStoppedError, KafkaError
from prometheus_client import CollectorRegistry

from walbus.aiokafka_shortcuts import read_in_runs, send_next_fetch
from walbus.client._connect import client_kwargs as _client_kwargs
from walbus.client._connect import consumer_options as _consumer_options
from walbus.client._connect import read_records, topic_partitions
from walbus.client._race import until_set
from walbus.client.acks import acked_prefix
from walbus.client.beats import HeartbeatWatch
from walbus.client.deadletters import (
    DeadLetterWriter,
    Origin,
    dead_letter_headers,
    error_text,
    origin_of,
    replay_topic,
)
from walbus.client.event import FeedEvent, feed_event
from walbus.client.event import set_attempt as _set_attempt
from walbus.client.event import set_settler as _set_settler
from walbus.client.filters import EventFilter
from walbus.client.metrics import client_metrics
from walbus.client.parallel import Dispatcher
from walbus.client.positions import (
    Position,
    decode_legacy_metadata,
    decode_metadata,
    encode_metadata,
    newest,
    valid_event,
)
from walbus.client.retrying import RetryPolicy
from walbus.client.start import Start, StartAt, parse_start, start_floor
from walbus.contract import (
    ChangeEvent,
    ContractError,
    decode_keyed_event_as,
    event_key,
    topic_name_error,
    try_decode_keyed_event,
)
from walbus.kafka import stop_consumer

log = logging.getLogger("walbus.client.feed")
_try_decode = try_decode_keyed_event
# The feed's own clock for commit intervals, retry due times and read deadlines: the default
# event loop's (loop.time() is time.monotonic() there), without its Python method on the hot path.
_now = time.monotonic

# How long a feed waits for records before it commits what its caller has finished with.
IDLE_COMMIT_AFTER_S = 0.05
# transactions(): a linger that ends while the consumer is behind the partition's end (catching
# up, between fetches) is extended by up to this much: a 0.01 s linger split 30,000-row
# transactions that were wholly in the topic (a client fuzz).
LINGER_CATCH_UP_S = 10.0
# Records moved from a fetched batch into a partition's buffer at a time (_PartitionState.refill).
REFILL_RECORDS = 64
# How far back from its committed offset a version-1 group position is looked for.
LEGACY_MARK_WINDOW = 10_000

# The consumer options a Feed sets itself, and what to use instead (consumer_options= is checked).
FEED_OWN_OPTIONS: Final = {
    "group_id": "use Feed(group_id=...)",
    "enable_auto_commit": "the Feed commits what your code finished with (commit_interval=, feed.commit())",
    "auto_offset_reset": "use start= ('earliest', 'latest', a commit LSN or a time)",
    "isolation_level": "the Feed reads read_committed",
}

ResumeAfter = Callable[[str, int], Awaitable[Position | None]]
"""``async (topic, partition) -> position | None``: the last position your handler durably applied."""


@dataclass(frozen=True, slots=True)
class Transaction:
    """The events of one committed database transaction that passed the feed's filter."""

    commit_lsn: int
    xid: int
    timestamp: str
    events: tuple[ChangeEvent, ...]

    @property
    def tables(self) -> frozenset[str]:
        return frozenset(e.table for e in self.events)


@dataclass
class FeedStats:
    """Counters, for logs and tests."""

    delivered: int = 0
    duplicates_skipped: int = 0
    filtered: int = 0
    invalid_skipped: int = 0
    before_start: int = 0  # below an LSN ``start``
    commits: int = 0
    retries: int = 0  # nacked deliveries handed out again
    dead_letters: int = 0


class _Stopped(Exception):
    """Internal: the feed was stopped or reached the end it was asked to stop at."""


@dataclass(eq=False, slots=True)
class _Record:
    """One record read and, once delivered, the event in the caller's hands until it is acked,
    retried or dead-lettered (the FeedEvent's settler): one object per event."""

    state: _PartitionState  # the partition's state when it was read: invalid once revoked
    offset: int
    position: Position
    event: ChangeEvent | None  # dropped once acked (the FeedEvent refers to its settler)
    wanted: bool
    msg: Any  # the Kafka record: key, value and headers for a dead letter
    attempt: int = 1
    outcome: Literal["pending", "acked", "retry", "dead"] = "pending"
    error: str = ""

    @property
    def tp(self) -> TopicPartition:
        return self.state.tp

    @property
    def settled(self) -> bool:
        return self.outcome != "pending"

    @property
    def replayed(self) -> bool:
        return self.state.replay

    @property
    def timestamp_ms(self) -> int | None:
        ts = getattr(self.msg, "timestamp", None)
        return ts if isinstance(ts, int) and ts >= 0 else None

    def ack(self) -> None:
        if self.outcome == "pending":
            self.state.feed._acked(self)

    def nack(self, retry_in: float | None, error: BaseException | str | None) -> None:
        if self.outcome == "pending":
            self.state.feed._nacked(self, retry_in, error)


# Per partition: (assignment epoch, offset after the last record read, highest position read).
_Marks = dict[TopicPartition, tuple[int, int, Position | None]]


@dataclass(eq=False, slots=True)
class _PartitionState:
    feed: Feed
    tp: TopicPartition
    epoch: int
    seen: Position | None  # highest position read: the duplicate high-water mark
    read_offset: int | None = None  # offset after the last record read
    done_offset: int | None = None  # offset after the last record the caller finished with
    done_position: Position | None = None
    committed: tuple[int, Position | None] | None = None
    end_offset: int | None = None  # until_end: where this partition ended when assigned
    replay: bool = False  # the group's replay topic: dead letters sent back, no duplicate check
    buffer: deque[Any] = field(default_factory=deque)
    batches: deque[Iterator[Any]] = field(default_factory=deque)  # fetched, not yet in buffer (lazy runs)
    inflight: deque[_Record] = field(default_factory=deque)  # delivered, in offset order
    delivered: Position | None = None  # highest position handed to the caller
    revoked: bool = False  # no longer in the feed's assignment (a new state holds it if re-assigned)

    def refill(self) -> bool:
        """Move the next few records of the fetched batches into the empty buffer; False when
        there are none. A few at a time: records made long before they are reached outlive
        the garbage collector's young generations (see aiokafka_shortcuts.RunRecords)."""
        batches, buffer = self.batches, self.buffer
        while batches:
            buffer.extend(islice(batches[0], REFILL_RECORDS))
            if len(buffer) < REFILL_RECORDS:
                batches.popleft()  # that batch is done
            if buffer:
                return True
        return False


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, feed: Feed) -> None:
        self._feed = feed

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        await self._feed._on_revoked(list(revoked))

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        self._feed._on_assigned(list(assigned))
        await self._feed._start_fresh_partitions(list(assigned))


class Feed:
    """Change events of one database topic (``walbus.<database>``), filtered, deduplicated.

    ::

        async with Feed("walbus.shop", group_id="notify", bootstrap_servers="localhost:9092",
                        tables=["public.transactions"], operations=["insert"]) as feed:
            async for event in feed:
                await notify(event.row())      # offset committed after this returns

    Args:
        topic: the database topic.
        group_id: the consumer group; None reads every partition without committing anything.
        bootstrap_servers / client_kwargs: where the brokers are; ``client_kwargs`` takes any
            aiokafka connection options (``KafkaOptions.kafka_client_kwargs()``).
        tables: fnmatch patterns on ``schema.table`` (no dot: the table in any schema); a name
            with a dot or quote is quoted as in the event (``public."a.b"``).
        operations: ``insert``, ``update``, ``delete``, ``truncate``, ``read``; empty = all.
        start: where a group without committed offsets (or a group-less feed) starts:
            ``"latest"`` (default: only changes from now on, like binding a new queue),
            ``"earliest"``, a commit LSN (``Lsn``, int or ``"16/B374D848"``: events with
            ``commit_lsn >= lsn``) or an aware ``datetime`` (records written since). A group's
            start is committed when it first gets a partition, so a restart before its first
            event does not move it. A group with committed offsets ignores ``start``.
        from_beginning: the older form: ``True`` is ``start="earliest"``, ``False`` ``"latest"``.
        commit_interval: seconds between offset commits while events keep coming; the feed
            also commits once it has waited ``IDLE_COMMIT_AFTER_S`` (50 ms) for new records, and on stop.
        resume_after: for exactly-once effects: returns the last position your handler stored
            (in the same transaction as its effects); events at or before it are skipped.
        transaction_linger: without the producers' heartbeats, ``transactions()`` yields the
            last transaction of the topic once no record arrived for this many seconds (v1
            events carry no end-of-transaction mark); with them, once a heartbeat confirmed
            past it and the topic is read to its end.
        until_end: stop iterating once the partitions are read up to where they ended when
            they were assigned (for tools and tests).
        strict: raise :class:`~walbus.contract.ContractError` on a record that is not a valid
            v1 event keyed by its own position, instead of logging and skipping it.
        consumer_options: extra ``AIOKafkaConsumer`` options (e.g. ``session_timeout_ms``); one
            the Feed sets itself (:data:`FEED_OWN_OPTIONS`) is a ``ValueError`` naming what to use.
        auto_ack: ack an event the caller did not settle when it asks for the next one (or
            leaves the loop with ``break``). With ``False`` every event needs ``event.ack()``
            or ``event.nack()``; offsets commit up to the highest contiguous acked position.
        retry: how often a nacked event (or one whose ``run`` handler raised) is retried, and
            how long apart, before it goes to the dead-letter topic ``<topic>.group--<group>.dlq``.
        dead_letters: create and use the group's dead-letter and replay topics (groups only).
        metrics_registry: where the client's Prometheus counters live (default: the global one).
    """

    def __init__(
        self,
        topic: str,
        *,
        group_id: str | None = None,
        bootstrap_servers: str | None = None,
        client_kwargs: Mapping[str, Any] | None = None,
        tables: Iterable[str] = (),
        operations: Iterable[str] = (),
        start: StartAt = "latest",
        from_beginning: bool | None = None,
        commit_interval: float = 1.0,
        resume_after: ResumeAfter | None = None,
        transaction_linger: float = 0.5,
        until_end: bool = False,
        strict: bool = False,
        consumer_options: Mapping[str, Any] | None = None,
        metrics_registry: CollectorRegistry | None = None,
        auto_ack: bool = True,
        retry: RetryPolicy | None = None,
        dead_letters: bool = True,
    ) -> None:
        # A name Kafka can never create: the consumer would wait for it forever.
        problem = topic_name_error(topic)
        if problem is not None:
            raise ValueError(f"topic {problem}")
        self.topic = topic
        self.group_id = group_id
        self.filter = EventFilter(tables, operations)
        self._wants_all = not self.filter.tables and not self.filter.operations
        self.stats = FeedStats()
        self._kwargs = _client_kwargs(bootstrap_servers, client_kwargs)
        if from_beginning is not None:
            start = "earliest" if from_beginning else "latest"
        self._start: Start = parse_start(start)
        self._floor = start_floor(self._start)
        self._fresh: set[TopicPartition] = set()  # assigned without a committed offset
        self._first_assignment = asyncio.Event()
        self._unloaded = True  # the assignment may hold partitions without a _PartitionState
        self._commit_interval = commit_interval
        self._resume_after = resume_after
        self._linger = transaction_linger
        self._until_end = until_end
        self._strict = strict
        self._consumer_options = _consumer_options(consumer_options, self._kwargs, FEED_OWN_OPTIONS)
        self._metrics = client_metrics(metrics_registry)
        self._consumer: AIOKafkaConsumer | None = None
        self._admin: AIOKafkaAdminClient | None = None
        self._parts: dict[TopicPartition, _PartitionState] = {}
        self._epochs: dict[TopicPartition, int] = {}
        # Highest position per partition this run finished with: survives a revoke/re-assign
        # of the same partition, so a run does not deliver a finished event twice (_run_mark).
        self._delivered: dict[TopicPartition, Position] = {}
        self._left: dict[TopicPartition, _PartitionState] = {}  # revoked, not yet assigned again
        self._loop: asyncio.AbstractEventLoop | None = None  # start()'s
        self._current: _Marks | None = None  # what the caller is handling now
        self._lookahead: _Record | None = None  # transactions(): first record of the next one
        self._holding = False  # transactions(): a transaction is being gathered
        self._mode: Literal["events", "transactions"] | None = None
        self._runs = False  # the consumer hands over runs of records (aiokafka shortcut)
        self._last_commit = 0.0
        self._stopping = False
        self._auto_ack = auto_ack
        self._retry = retry or RetryPolicy()
        self._last: _Record | None = None  # the event handed out last (auto-ack)
        self._retries: list[tuple[float, int, _Record]] = []  # heap by due time
        self._retry_order = itertools.count()
        self._dead: deque[_Record] = deque()  # exhausted, to write to the dead-letter topic
        # Set by a nack: a reader waiting for records wakes up to retry or dead-letter it (a
        # run() lane nacks while the dispatcher waits; the retry waited for the next record).
        self._nudge = asyncio.Event()
        # transactions(): the producers' heartbeats, which tell when a commit is all there.
        self._beats: HeartbeatWatch | None = None
        self._dlq: DeadLetterWriter | None = None
        self._replay_topic: str | None = None
        if group_id is not None and dead_letters:
            self._dlq = DeadLetterWriter(self._kwargs, topic, group_id)
            self._replay_topic = replay_topic(topic, group_id)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, and join the group (or assign every partition when there is no group)."""
        if self._consumer is not None:
            raise RuntimeError("Feed already started")
        self._stopping = False
        consumer = AIOKafkaConsumer(
            **self._kwargs,
            group_id=self.group_id,
            enable_auto_commit=False,
            auto_offset_reset="latest" if self._start == "latest" else "earliest",
            isolation_level="read_committed",
            **self._consumer_options,
        )
        self._consumer = consumer
        self._first_assignment = asyncio.Event()
        self._unloaded = True  # the assignment may hold partitions without a _PartitionState
        try:
            if self.group_id is not None:
                self._admin = AIOKafkaAdminClient(**self._kwargs)
                await self._admin.start()
                # A pattern subscription learns new topics only every metadata_max_age_ms:
                # wait for the database topic here, as a group-less feed does.
                await topic_partitions(self._kwargs, self.topic)
                # A pattern, so that the group's replay topic is picked up when a replay creates
                # it (on the consumer's next metadata refresh, metadata_max_age_ms).
                names = [self.topic] if self._replay_topic is None else [self.topic, self._replay_topic]
                pattern = "^(" + "|".join(re.escape(n) for n in names) + ")$"
                # Subscribed before start(): start() then returns once the group assigned
                # partitions, and the first assignment has committed a new group's start, so
                # "latest" means "from when start() returned".
                consumer.subscribe(pattern=pattern, listener=_Rebalance(self))
                await consumer.start()
                await self._first_assignment.wait()
            else:
                await consumer.start()
                tps = await topic_partitions(self._kwargs, self.topic)
                consumer.assign(tps)
                for tp, offset in (await self._start_or_resume(tps)).items():
                    consumer.seek(tp, offset)
                self._fresh.update(tps)
        except BaseException:
            await self._close_clients()  # a failed start leaves the clients' connections open
            raise
        # Record batches, without a ConsumerRecord each (walbus.aiokafka_shortcuts): each
        # record is made, and decoded, only when it is reached.
        self._runs = read_in_runs(consumer, lazy=True)
        self._loop = asyncio.get_running_loop()
        self._last_commit = _now()

    async def stop(self) -> None:
        """Commit what the caller has finished with, leave the group and disconnect."""
        if self._consumer is None:
            return
        self._stopping = True
        try:
            await self._maybe_commit(force=True)
        finally:
            await self._close_clients()

    async def _close_clients(self) -> None:
        consumer, admin, beats = self._consumer, self._admin, self._beats
        self._consumer = self._admin = self._beats = None
        for tp in list(self._parts):
            self._forget(tp)
        self._retries.clear()
        self._dead.clear()
        self._last = None
        try:
            if beats is not None:
                await beats.stop()
            if consumer is not None:
                await stop_consumer(consumer)
            if admin is not None:
                await admin.close()
        finally:
            if self._dlq is not None:
                await self._dlq.close()

    async def __aenter__(self) -> Feed:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # Leaving the loop with `break` finished the current event; an exception did not.
        if exc_type is None:
            self._finish_current()
        await self.stop()

    async def commit(self) -> None:
        """Mark the event (or transaction) being handled as finished and commit now."""
        self._finish_current()
        await self._maybe_commit(force=True)

    # -- iteration ---------------------------------------------------------------------------

    def __aiter__(self) -> Feed:
        return self

    async def __anext__(self) -> FeedEvent:
        if self._mode != "events" or self._consumer is None:
            self._use_mode("events")
        # _finish_current(), inline: once per event.
        if self._current is not None:
            self._apply_done(self._current)
            self._current = None
        last = self._last
        if last is not None:
            self._last = None
            if self._auto_ack and last.outcome == "pending":
                # _acked(last), its usual case inline: acked in order, nothing else in flight.
                state = last.state
                inflight = state.inflight
                done = state.done_offset
                if len(inflight) == 1 and inflight[0] is last and not state.revoked and (done is None or last.offset >= done):
                    last.outcome = "acked"
                    last.event = None
                    inflight.pop()
                    state.done_offset = last.offset + 1
                    position = state.done_position
                    if position is None or last.position > position:
                        state.done_position = last.position
                else:
                    self._acked(last)
        event = self._take_buffered()
        return event if event is not None else await self._next_event()

    def _something_due(self) -> bool:
        """Whether :meth:`_next_event` must run before the next buffered event is handed out:
        the feed is not started or is stopping, a dead letter, a retry or a commit is due, or
        the assignment changed."""
        if self._loop is None or self._dead or self._unloaded or self._stopping:
            return True
        now = _now()
        if self._retries and self._retries[0][0] <= now:
            return True
        return now - self._last_commit >= self._commit_interval and self.group_id is not None

    def _take_buffered(self) -> FeedEvent | None:
        """The next event if it is already fetched and nothing else is due (no await: the hot path).

        None when :meth:`_next_event` must decide: nothing buffered, a commit, retry or dead
        letter is due, or the assignment changed.
        """
        if self._something_due():
            return None
        parts = self._parts
        if len(parts) == 1:  # the default single partition: nothing to merge
            for state in parts.values():
                rec = self._accept(state, True, True)
                if rec is None:
                    return None
                # _deliver(rec), inline: once per event.
                state.inflight.append(rec)
                delivered = state.delivered
                if delivered is None or rec.position > delivered:
                    state.delivered = rec.position
                self.stats.delivered += 1
                self._last = rec
                event: Any = rec.event
                _set_attempt(event, 1)
                _set_settler(event, rec)
                return event  # type: ignore[no-any-return]
        while (found := self._next_buffered()) is not None:
            rec = self._accept(found, False, True)
            if rec is not None:
                return self._deliver(rec)
        return None

    def _take_buffered_run(self, most: int) -> list[FeedEvent] | None:
        """Up to ``most`` already-fetched events of the single partition, delivered at once:
        run()'s hot path (the checks of :meth:`_take_buffered` once per run, not per event).

        None when :meth:`_next_event` must decide (several partitions, nothing buffered, a
        commit, retry or dead letter due). The events are in flight together, each acked when
        its handler finished.
        """
        if self._something_due():
            return None
        parts = self._parts
        if len(parts) != 1:
            return None
        for state in parts.values():
            records: list[_Record] = []
            self._accept(state, True, True, records, most)
            if not records:
                return None
            out: list[FeedEvent] = []
            inflight = state.inflight
            delivered = state.delivered
            for rec in records:
                # _deliver(rec), inline: once per event.
                inflight.append(rec)
                if delivered is None or rec.position > delivered:
                    delivered = rec.position
                event: Any = rec.event
                _set_attempt(event, 1)
                _set_settler(event, rec)
                out.append(event)
            state.delivered = delivered
            self.stats.delivered += len(out)
            self._last = records[-1]
            return out
        return None

    async def _next_event(self) -> FeedEvent:
        """The next event: a due retry, else the next wanted record (nothing is auto-acked)."""
        while True:
            self._nudge.clear()  # what it asks for is looked at now
            if self._dead:
                await self._write_dead_letters()
            now = _now()
            if now - self._last_commit >= self._commit_interval:
                await self._maybe_commit()
            retried = self._due_retry(now) if self._retries else None
            if retried is not None:
                self.stats.retries += 1
                self._last = retried
                assert retried.event is not None  # kept until acked
                return feed_event(retried.event, retried.attempt, retried)
            wait = self._retries[0][0] - now if self._retries else None
            try:
                rec = await self._read(None if wait is None else max(wait, 0.001))
            except _Stopped:
                raise StopAsyncIteration from None
            if rec is None:
                continue
            if not rec.wanted:
                self.stats.filtered += 1
                continue
            return self._deliver(rec)

    def _deliver(self, rec: _Record) -> FeedEvent:
        """Hand a newly read record's event to the caller (built as a FeedEvent in events mode)."""
        state = rec.state
        state.inflight.append(rec)
        delivered = state.delivered
        if delivered is None or rec.position > delivered:
            state.delivered = rec.position
        self.stats.delivered += 1
        self._last = rec
        event: Any = rec.event  # a FeedEvent: _accept decodes FeedEvents in events mode
        _set_attempt(event, 1)
        _set_settler(event, rec)
        return event  # type: ignore[no-any-return]

    async def run(self, handler: Callable[[FeedEvent], Awaitable[None]], *, concurrency: int = 1) -> None:
        """Call ``handler`` for every event until the feed ends (``until_end``) or is cancelled.

        An event is acked when ``handler`` returns (unless it settled the event itself). When it
        raises, the event is retried in place after the retry policy's delay (later events of
        the same key wait; other keys go on), and after the last attempt it goes to the
        dead-letter topic: a poison event never stops the feed. ``concurrency`` handlers run at
        once, events of one key (table and primary key) one after the other, in order; see
        docs/client.md for the exact guarantee.
        """
        if concurrency > 1 and self._resume_after is not None:
            # The resumed position is the partition's mark: what is not past it is skipped. Lanes
            # finish out of delivery order, so a stored "last applied" position can be past an
            # event still in flight (PgPositions.mark then refused that event: apply() returned
            # False and its effect was never applied; after a crash it was skipped).
            raise ValueError(
                "resume_after keeps one position per partition, which holds only when events finish in "
                "delivery order: use run(concurrency=1) with resume_after (or PgPositions)"
            )
        self._use_mode("events")
        dispatcher = Dispatcher(self, handler, concurrency)
        try:
            await dispatcher.run()
        finally:
            self._last = None  # run() acks what it handled; auto-ack must not ack the rest

    async def handle(self, event: FeedEvent, handler: Callable[[FeedEvent], Awaitable[None]]) -> None:
        """Run ``handler`` on ``event`` with the retry policy; ack, or dead-letter when exhausted."""
        assert isinstance(event._settler, _Record), "handle() takes events this feed delivered"
        try:
            await handler(event)
        except Exception as e:
            await self._handle_failed(event, handler, e)
            return
        self._handled(event)

    def _handled(self, event: FeedEvent) -> None:
        """``handler`` returned: ack the event unless it settled itself."""
        delivery: Any = event._settler
        if delivery.outcome == "pending":
            self._acked(delivery)

    async def _handle_failed(self, event: FeedEvent, handler: Callable[[FeedEvent], Awaitable[None]], error: Exception) -> None:
        """Retry a failed handler in place, then dead-letter the event once its attempts are used up."""
        delivery = event._settler
        assert isinstance(delivery, _Record), "a handler failed on an event this feed did not deliver"
        while True:
            self._log_failure(delivery, error)
            if delivery.settled:
                return  # the handler acked or nacked it itself before raising
            if self._retry.exhausted(delivery.attempt):
                delivery.error = error_text(error)
                await self._dead_letter(delivery)
                return
            self.stats.retries += 1
            self._metrics.retries.labels(self.topic, self.group_id or "").inc()
            await asyncio.sleep(self._retry.delay(delivery.attempt))
            delivery.attempt += 1
            assert delivery.event is not None  # kept until acked
            try:
                await handler(feed_event(delivery.event, delivery.attempt, delivery))
            except Exception as e:
                error = e
                continue
            if delivery.outcome == "pending":
                self._acked(delivery)
            return

    # -- acknowledgement, retries, dead letters -------------------------------------------

    def _acked(self, rec: _Record) -> None:
        rec.outcome = "acked"
        rec.event = None  # the FeedEvent refers to rec: no reference cycle to leave to the GC
        state = rec.state
        if state.revoked:
            return  # revoked meanwhile: the new owner takes it from the last commit
        inflight = state.inflight
        if not inflight or inflight[0] is not rec:
            return  # an earlier event is still out: nothing new is contiguous (run()'s lanes)
        if len(inflight) == 1 or inflight[1].outcome != "acked":
            # Acked in order, nothing acked after it: the usual case (acked_prefix's of one).
            inflight.popleft()
            if state.done_offset is None or rec.offset >= state.done_offset:
                state.done_offset = rec.offset + 1
                position = state.done_position
                if position is None or rec.position > position:
                    state.done_position = rec.position
            return
        done = acked_prefix(inflight)
        if done is not None and (state.done_offset is None or done[0] > state.done_offset):
            state.done_offset = done[0]
            state.done_position = done[1] if state.done_position is None or done[1] > state.done_position else state.done_position

    def _nacked(self, delivery: _Record, retry_in: float | None, error: BaseException | str | None) -> None:
        delivery.error = error_text(error if error is not None else "nacked")
        if self._retry.exhausted(delivery.attempt):
            delivery.outcome = "dead"
            self._dead.append(delivery)
            self._nudge.set()
            return
        delivery.outcome = "retry"
        delay = self._retry.delay(delivery.attempt) if retry_in is None else max(retry_in, 0.0)
        due = _now() + delay
        heapq.heappush(self._retries, (due, next(self._retry_order), delivery))
        self._metrics.retries.labels(self.topic, self.group_id or "").inc()
        self._nudge.set()

    def _due_retry(self, now: float) -> _Record | None:
        while self._retries and self._retries[0][0] <= now:
            delivery = heapq.heappop(self._retries)[2]
            if self._valid(delivery):  # else revoked: the new owner reads it again
                delivery.attempt += 1
                delivery.outcome = "pending"
                return delivery
        return None

    def _log_failure(self, rec: _Record, error: BaseException) -> None:
        log.warning(
            "handler failed",
            extra={"topic": rec.tp.topic, "partition": rec.tp.partition, "offset": rec.offset, "group": self.group_id,
                   "key": event_key(*rec.position).decode(), "attempt": rec.attempt, "error": error_text(error)},
        )

    async def _write_dead_letters(self) -> None:
        while self._dead:
            await self._dead_letter(self._dead.popleft())

    async def _dead_letter(self, delivery: _Record) -> None:
        """Write an exhausted event to the group's dead-letter topic, then ack it: the feed goes on."""
        rec = delivery
        origin = origin_of(list(rec.msg.headers or ())) if self._is_replay(rec.tp) else None
        origin = origin or Origin(rec.tp.topic, rec.tp.partition, rec.offset)
        fields = {"topic": rec.tp.topic, "partition": rec.tp.partition, "offset": rec.offset, "group": self.group_id,
                  "key": event_key(*rec.position).decode(), "attempts": delivery.attempt, "error": delivery.error}
        if self._dlq is None or self.group_id is None:
            log.error("dropping an event whose retries are used up (no consumer group, no dead-letter topic)", extra=fields)
        else:
            headers = dead_letter_headers(error=delivery.error, attempts=delivery.attempt, group=self.group_id, origin=origin)
            await self._dlq.write(rec.msg.key, rec.msg.value, headers)
            log.error("event sent to the dead-letter topic", extra={**fields, "dead_letter_topic": self._dlq.topic})
        self.stats.dead_letters += 1
        self._metrics.dead_letters.labels(self.topic, self.group_id or "").inc()
        delivery.outcome = "pending"
        delivery.ack()

    def _is_replay(self, tp: TopicPartition) -> bool:
        return self._replay_topic is not None and tp.topic == self._replay_topic

    def transactions(self) -> AsyncIterator[Transaction]:
        """Iterate over whole transactions instead of single events.

        A transaction is complete when the first event of a later commit arrives, or when a
        producer's heartbeat confirmed past it and the topic is read to its end; without
        heartbeats, when its partition stays silent for ``transaction_linger`` seconds. All of a transaction is held
        in memory. Offsets are committed after the caller has finished with the transaction.
        """
        return _TransactionStream(self)

    async def _next_transaction(self) -> Transaction:
        self._use_mode("transactions")
        self._finish_current()
        await self._maybe_commit()
        if self._beats is None and not self._until_end:
            beats = self._beats = HeartbeatWatch(self._kwargs, self.topic, metrics=self._metrics)
            await beats.start()
        group: list[_Record] = []
        marks: _Marks = {}
        while True:
            rec: _Record | None
            if self._lookahead is not None:
                rec, self._lookahead = self._lookahead, None
                if not self._valid(rec):
                    continue
            else:
                self._holding = bool(group)
                wake = self._beats.advanced if group and self._beats is not None else None
                try:
                    rec = await self._read(self._linger if group else None, wake)
                except _Stopped:
                    raise StopAsyncIteration from None
                finally:
                    self._holding = False
            if rec is not None and (not group or rec.position[0] == group[0].position[0]):
                group.append(rec)
                marks = self._marks()
                continue
            if rec is not None:
                self._lookahead = rec
            if not group:
                continue
            if rec is None and not await self._all_there(group[0].position[0]):
                continue  # the rest of the commit is on its way
            kept = [r for r in group if self._valid(r)]
            wanted = [r for r in kept if r.wanted]
            self.stats.filtered += len(kept) - len(wanted)
            group = []
            if not wanted:
                self._apply_done(marks)  # nothing for the caller: finished at once
                continue
            self._current = marks
            self._note_delivered(wanted)
            events = tuple(r.event for r in wanted if r.event is not None)  # all: only acks drop one
            first = events[0]
            return Transaction(first.commit_lsn, first.xid, first.timestamp, events)

    async def _all_there(self, commit_lsn: int) -> bool:
        """Whether a commit whose last event read was followed by silence (``transaction_linger``,
        or a heartbeat) is all there. A producer's heartbeat confirmed past it says every event
        of it is in the topic: then it is when the database topic's partitions are read up to
        their ends looked up now. A producer that beats but confirmed less is still writing it
        (a large transaction, a slow broker): wait. Without heartbeats, the silence decides, as
        before (see :data:`~walbus.client.beats.BEAT_WAIT_S`)."""
        beats, consumer = self._beats, self._consumer
        if beats is None or consumer is None or not beats.enabled:
            return True
        if not beats.past(commit_lsn):
            return not beats.alive()
        tps = [tp for tp in self._parts if tp.topic == self.topic]  # the producers' own writes
        try:
            ends = await consumer.end_offsets(tps)
        except KafkaError as e:
            # A broker that did not answer in time (a pause, an election, a restart): not all
            # there yet; asked again after the next silence. Raised, it ended the caller's loop.
            log.warning(
                "cannot look up the topic's end offsets to finish a transaction; trying again",
                extra={"topic": self.topic, "commit_lsn": commit_lsn, "error": f"{type(e).__name__}: {e}"},
            )
            return False
        for tp in tps:
            state = self._parts.get(tp)
            if state is None:
                continue  # revoked meanwhile
            if state.buffer or state.batches:
                return False
            at = state.read_offset if state.read_offset is not None else await consumer.position(tp)
            if at < ends[tp]:
                return False
        return True

    def _use_mode(self, mode: Literal["events", "transactions"]) -> None:
        if self._consumer is None:
            raise RuntimeError("Feed not started: use `async with Feed(...)` or `await feed.start()`")
        if self._mode is None:
            self._mode = mode
        elif self._mode != mode:
            raise RuntimeError("iterate a Feed either by event or by transactions(), not both")

    # -- reading -----------------------------------------------------------------------------

    async def _read(self, wait_s: float | None, wake: asyncio.Event | None = None) -> _Record | None:
        """The next record that is neither a duplicate nor invalid; None after ``wait_s`` s, or
        once ``wake`` is set (which it clears) while no record is at hand."""
        consumer = self._consumer
        if consumer is None or self._stopping:
            raise _Stopped
        deadline = None if wait_s is None else _now() + wait_s
        give_up = None if deadline is None else deadline + LINGER_CATCH_UP_S
        while True:
            if self._stopping:
                raise _Stopped
            if self._nudge.is_set():
                return None  # a nack: its retry or dead letter is decided by the caller
            if self._unloaded:
                await self._load_new_partitions()
            ready = self._next_buffered()
            if ready is not None:
                rec = self._accept(ready, False, False)
                if rec is not None:
                    return rec
                continue
            if wake is not None and wake.is_set():
                wake.clear()
                return None
            if self._until_end and await self._at_end():
                if self._holding:
                    return None
                self._mark_read_done()
                raise _Stopped
            try:
                # What the consumer has fetched in the background already: no waiting, so no
                # commit in between (one per fetch was a broker round trip per ~1 MB of events).
                batches = await consumer.getmany(timeout_ms=0)
                if not batches:
                    # A feed catching up waits a fetch's round trip for its next records: commit
                    # only when the wait outlasts that (a commit per fetch cost ~9% of throughput).
                    batches = await self._wait_records(consumer, deadline, IDLE_COMMIT_AFTER_S, wake)
                if not batches:
                    await self._idle()
                    batches = await self._wait_records(consumer, deadline, 1.0, wake)
                    if not batches and deadline is not None and deadline <= _now():
                        if self._holding and give_up is not None and _now() < give_up and self._behind(consumer):
                            deadline = min(_now() + 0.1, give_up)  # records to fetch: not the tail yet
                            continue
                        return None
            except ConsumerStoppedError:
                raise _Stopped from None
            if batches and self._unloaded:
                await self._load_new_partitions()
            runs = self._runs
            for tp, msgs in batches.items():
                state = self._parts.get(tp)
                if state is not None:
                    if runs:
                        state.batches.extend(msgs)
                    else:
                        state.buffer.extend(msgs)
            if batches:
                await send_next_fetch()  # the next records arrive while these are handled

    def _behind(self, consumer: AIOKafkaConsumer) -> bool:
        """Whether a partition has records past what was read (its end as the last fetch saw it)."""
        for tp, state in self._parts.items():
            end = consumer.last_stable_offset(tp)  # read_committed
            if end is not None and state.read_offset is not None and state.read_offset < end:
                return True
        return False

    async def _wait_records(
        self, consumer: AIOKafkaConsumer, deadline: float | None, most_s: float, wake: asyncio.Event | None = None,
    ) -> dict[TopicPartition, list[Any]]:
        """What arrives within ``most_s`` seconds (and before ``deadline``): empty when nothing,
        or at once when a nack asks for the reader (:attr:`_nudge`) or ``wake`` is set."""
        wait = most_s if deadline is None else min(most_s, deadline - _now())
        events = (self._nudge,) if wake is None else (self._nudge, wake)
        if wait <= 0 or any(e.is_set() for e in events):
            return {}
        # getmany() takes records only when it returns them: cancelled while waiting, it took none.
        getter = await until_set(consumer.getmany(timeout_ms=max(1, int(wait * 1000))), *events)
        try:
            batches: dict[TopicPartition, list[Any]] = await getter
        except asyncio.CancelledError:
            if not any(e.is_set() for e in events):
                raise  # not ours: the caller is cancelled
            return {}
        return batches

    def _next_buffered(self) -> _PartitionState | None:
        """The partition whose next buffered record has the lowest key: merges partitions in commit order."""
        if len(self._parts) == 1:  # the default single partition: nothing to merge
            for only in self._parts.values():
                return only if only.buffer or only.refill() else None
        best: _PartitionState | None = None
        best_key = b""
        for state in self._parts.values():
            if state.buffer or state.refill():
                key = state.buffer[0].key or b""
                if best is None or key < best_key:
                    best, best_key = state, key
        return best

    def _accept(
        self, state: _PartitionState, run: bool, wanted_only: bool, out: list[_Record] | None = None, most: int = 0
    ) -> _Record | None:
        """The next record of ``state``'s buffer that is neither invalid nor a duplicate (nor
        filtered out, with ``wanted_only``); None when there is none. With ``run`` it pops
        records until it finds one (nothing to merge with another partition), else just one;
        with ``out`` (and ``run``) it appends up to ``most`` such records there instead, and
        returns None. The consumers' hot path: every record goes through here once."""
        buffer = state.buffer
        # In events mode the event is built as the FeedEvent it will be handed out as.
        cls = FeedEvent if self._mode == "events" else ChangeEvent
        stats = self.stats
        while buffer or state.refill():
            msg = buffer.popleft()
            offset = msg.offset
            state.read_offset = offset + 1
            key, value = msg.key, msg.value
            # The compiled decoder first, without decode_keyed_event_as's Python frame.
            event = _try_decode(key, value, cls) if _try_decode is not None else None
            if event is None:
                try:
                    event = decode_keyed_event_as(key, value, cls)
                except ContractError as e:
                    self._skip_invalid(state.tp, msg, e)
                    if run:
                        continue
                    return None
            position = (event.commit_lsn, event.seq)
            if not state.replay:
                seen = state.seen
                if seen is not None and position <= seen:
                    if self._floor is not None and position <= self._floor:
                        stats.before_start += 1
                    else:
                        stats.duplicates_skipped += 1
                    if run:
                        continue
                    return None
                state.seen = position
            wanted = self._wants_all or self.filter.wants(event.table, event.operation)
            if wanted or not wanted_only:
                if out is None:
                    return _Record(state, offset, position, event, wanted, msg)
                out.append(_Record(state, offset, position, event, wanted, msg))
                if len(out) >= most:
                    return None
                continue
            stats.filtered += 1
            if not run:
                return None
        return None

    def _skip_invalid(self, tp: TopicPartition, msg: Any, error: ContractError) -> None:
        # Skipped for good (its offset is committed with the next ones), but never silently.
        self.stats.invalid_skipped += 1
        self._metrics.invalid_records.labels("feed", tp.topic).inc()
        log.error(
            "skipping a record that is not a valid walbus v1 event",
            extra={
                "topic": tp.topic,
                "partition": tp.partition,
                "offset": msg.offset,
                "key": repr(msg.key[:40]) if msg.key is not None else None,
                "error": str(error),
            },
        )
        if self._strict:
            raise error

    async def _stored_position(self, tp: TopicPartition, offset: int, metadata: str) -> Position | None:
        """The position the group stored with ``offset``; a version-1 one only once verified.

        Feeds before version 2 moved the position on any key, so one record with a high key
        and a broken value could store a position no event has, after which everything
        looked like a replay. Such a position is used only if a valid event just before the
        committed offset carries it; otherwise it is ignored (logged and counted), which at
        worst lets a re-send written after the committed offset through once.
        """
        position = decode_metadata(metadata)
        legacy = decode_legacy_metadata(metadata)
        if position is not None or legacy is None:
            return position
        key = event_key(*legacy)
        for msg in reversed(await read_records(self._kwargs, tp, offset - LEGACY_MARK_WINDOW, offset)):
            if msg.key == key:
                try:
                    valid_event(msg.key, msg.value)
                except ContractError:
                    break
                return legacy
        self._metrics.stored_positions_ignored.labels(tp.topic).inc()
        log.error(
            "ignoring the group's stored position: no valid event before the committed offset has it",
            extra={"topic": tp.topic, "partition": tp.partition, "offset": offset, "group": self.group_id, "position": key.decode()},
        )
        return None

    async def _load_new_partitions(self) -> None:
        """Set up the dedup state of newly assigned partitions from what the group stored."""
        consumer = self._consumer
        if consumer is None:
            return
        new = [tp for tp in consumer.assignment() if tp not in self._parts]
        if not new:
            self._unloaded = False
            return
        epochs = {tp: self._epochs.get(tp, 0) for tp in new}
        stored: dict[TopicPartition, Position | None] = {}
        if self.group_id is not None and self._admin is not None:
            offsets = await self._admin.list_consumer_group_offsets(self.group_id, partitions=new)
            for tp, om in offsets.items():
                if om.offset >= 0:
                    stored[tp] = await self._stored_position(tp, om.offset, om.metadata)
        resumed: dict[TopicPartition, Position | None] = {}
        if self._resume_after is not None:
            for tp in new:
                if self._is_replay(tp):
                    continue
                resumed[tp] = await self._resume_after(tp.topic, tp.partition)
        ends: dict[TopicPartition, int] = await consumer.end_offsets(new) if self._until_end else {}
        assigned = consumer.assignment()
        for tp in new:
            # A rebalance may have happened while we were asking: keep only what still holds.
            if tp not in assigned or self._epochs.get(tp, 0) != epochs[tp] or tp in self._parts:
                continue
            replay = self._is_replay(tp)
            floor = self._floor if tp in self._fresh and not replay else None
            seen = None if replay else newest(stored.get(tp), resumed.get(tp), self._run_mark(tp), floor)
            self._parts[tp] = _PartitionState(self, tp, epochs[tp], seen=seen, end_offset=ends.get(tp), replay=replay)
            log.debug("partition assigned", extra={"topic": tp.topic, "partition": tp.partition, "resume_after": seen})

    async def _at_end(self) -> bool:
        consumer = self._consumer
        if consumer is None or not self._parts or self._retries or self._dead:
            return False
        for tp, state in self._parts.items():
            if state.buffer or state.batches or state.end_offset is None:
                return False
            if await consumer.position(tp) < state.end_offset:
                return False
        return True

    # -- progress and commits ----------------------------------------------------------------

    def _marks(self) -> _Marks:
        # A partition with events in the caller's hands moves only by their acks.
        return {
            tp: (s.epoch, s.read_offset, s.seen)
            for tp, s in self._parts.items()
            if s.read_offset is not None and not s.inflight
        }

    def _apply_done(self, marks: _Marks) -> None:
        for tp, (epoch, offset, position) in marks.items():
            state = self._parts.get(tp)
            if state is None or state.epoch != epoch:
                continue  # revoked meanwhile: the new owner takes it from the last commit
            if state.done_offset is None or offset > state.done_offset:
                state.done_offset, state.done_position = offset, position

    def _finish_current(self) -> None:
        if self._current is not None:
            self._apply_done(self._current)
            self._current = None
        last, self._last = self._last, None
        if last is not None and self._auto_ack and last.outcome == "pending":
            self._acked(last)

    def _mark_read_done(self) -> None:
        """Nothing is in the caller's hands: every record read so far is finished."""
        if self._current is None and not self._holding and self._lookahead is None:
            self._apply_done(self._marks())

    def _note_delivered(self, records: list[_Record]) -> None:
        for r in records:
            state = r.state
            if state.delivered is None or r.position > state.delivered:
                state.delivered = r.position
        self.stats.delivered += len(records)

    def _forget(self, tp: TopicPartition) -> None:
        """Drop a partition's state; it is kept aside (``_left``) until the partition comes
        back, when :meth:`_run_mark` reads what this run finished of it."""
        state = self._parts.pop(tp, None)
        if state is not None:
            state.revoked = True
            self._left[tp] = state

    def _run_mark(self, tp: TopicPartition) -> Position | None:
        """The highest position of ``tp`` this run may skip when the partition comes back to it.

        That is the highest one it delivered, unless an event it delivered is not finished:
        run() passed it over after the revoke, it waits for a retry (dropped with the revoke),
        or its handler still runs. Then it is the last position before the first such event,
        so that one and those after it come again (a handler still running may so see its
        event twice: at-least-once). Marking every delivered position lost such events for
        good when the partition came back to the same member (a fuzz found it)."""
        left = self._left.pop(tp, None)
        if left is not None:
            mark = left.delivered
            before = left.done_position  # the acked prefix, popped from inflight
            for rec in left.inflight:
                if rec.outcome == "pending" or rec.outcome == "retry":
                    mark = before
                    break
                before = rec.position
            if mark is not None:
                known = self._delivered.get(tp)
                if known is None or mark > known:
                    self._delivered[tp] = mark
        return self._delivered.get(tp)

    def _valid(self, rec: _Record) -> bool:
        """Whether ``rec``'s partition is still assigned as it was when it was read."""
        return not rec.state.revoked

    async def _idle(self) -> None:
        # About to wait for the broker: a good moment to commit, so that a quiet feed's
        # committed offset is never behind what its caller has finished with.
        self._mark_read_done()
        await self._maybe_commit(force=True)

    async def _maybe_commit(self, *, force: bool = False) -> None:
        consumer = self._consumer
        if consumer is None or self.group_id is None:
            return
        if not force and _now() - self._last_commit < self._commit_interval:
            return
        assigned = consumer.assignment()
        pending: dict[TopicPartition, tuple[int, Position | None]] = {}
        for tp, s in self._parts.items():
            if s.done_offset is not None and tp in assigned and s.committed != (s.done_offset, s.done_position):
                pending[tp] = (s.done_offset, s.done_position)
        self._last_commit = _now()
        if not pending:
            return
        try:
            await consumer.commit({tp: (off, encode_metadata(pos)) for tp, (off, pos) in pending.items()})
        except KafkaError as e:
            # A rebalance took the partition away: its new owner starts from the previous
            # commit and the stored position keeps it from repeating what it can recognise.
            log.warning("offset commit failed", extra={"group": self.group_id, "error": str(e)})
            return
        self.stats.commits += 1
        for tp, done in pending.items():
            state = self._parts.get(tp)
            if state is not None:
                state.committed = done

    async def _on_revoked(self, revoked: list[TopicPartition]) -> None:
        # Commit what is finished while the partitions are still ours, then forget them.
        try:
            await self._maybe_commit(force=True)
        except Exception as e:  # the listener must not fail the rebalance
            log.warning("commit on revoke failed", extra={"error": str(e)})
        for tp in revoked:
            self._forget(tp)

    async def _start_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        """Where each partition starts for ``self._start`` (an LSN start reads from the
        beginning and skips below its floor: keys are ordered, offsets do not know LSNs)."""
        consumer = self._consumer
        assert consumer is not None
        start = self._start
        if not tps:
            return {}
        if start == "latest":
            return dict(await consumer.end_offsets(tps))
        if isinstance(start, datetime):
            found = await consumer.offsets_for_times({tp: int(start.timestamp() * 1000) for tp in tps})
            ends = await consumer.end_offsets(tps)
            return {tp: found[tp].offset if found.get(tp) is not None else ends[tp] for tp in tps}
        return dict(await consumer.beginning_offsets(tps))

    async def _start_fresh_partitions(self, assigned: list[TopicPartition]) -> None:
        """Seek partitions the group never committed to the start, and commit it there.

        Committing at once makes the start durable, like a queue binding: without it, a member
        that stopped before its first commit would start at ``latest`` again and miss what
        happened in between."""
        try:
            await self._commit_start(assigned)
        finally:
            self._first_assignment.set()

    async def _commit_start(self, assigned: list[TopicPartition]) -> None:
        consumer, admin = self._consumer, self._admin
        if consumer is None or admin is None or self.group_id is None or not assigned:
            return
        try:
            committed = await admin.list_consumer_group_offsets(self.group_id, partitions=assigned)
            fresh = [tp for tp in assigned if committed.get(tp) is None or committed[tp].offset < 0]
            if not fresh:
                return
            # The replay topic holds only what was sent back to this group: all of it is new.
            replays = [tp for tp in fresh if self._is_replay(tp)]
            offsets = await self._start_or_resume([tp for tp in fresh if tp not in replays])
            if replays:
                offsets.update(await consumer.beginning_offsets(replays))
            for tp, offset in offsets.items():
                consumer.seek(tp, offset)
            self._fresh.update(fresh)
            await consumer.commit({tp: (offset, encode_metadata(self._floor)) for tp, offset in offsets.items()})
            log.info(
                "new group: starting partitions",
                extra={"group": self.group_id, "topic": self.topic, "start": str(self._start), "offsets": {tp.partition: o for tp, o in offsets.items()}},
            )
        except KafkaError as e:  # the listener must not fail the rebalance; auto_offset_reset still applies
            log.warning("could not set the group's start position", extra={"group": self.group_id, "error": str(e)})

    async def _start_or_resume(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        """Where partitions without a committed offset start: from ``start=``, except those
        ``resume_after`` has a position for. Those (a group whose offsets expired after the
        broker's offsets.retention.minutes, a new group id on the same positions, a group-less
        feed) are read from the beginning, and the resumed position, the partition's mark
        (_load_new_partitions), skips what was applied: from start= ("latest" by default)
        every event between the stored position and the end was skipped."""
        resumed: list[TopicPartition] = []
        if self._resume_after is not None:
            resumed = [tp for tp in tps if await self._resume_after(tp.topic, tp.partition) is not None]
        offsets = await self._start_offsets([tp for tp in tps if tp not in resumed])
        if resumed:
            assert self._consumer is not None
            offsets.update(await self._consumer.beginning_offsets(resumed))
            log.info("partitions resumed after their stored positions, read from the beginning",
                     extra={"topic": self.topic, "partitions": [tp.partition for tp in resumed]})
        return offsets

    def _on_assigned(self, assigned: list[TopicPartition]) -> None:
        self._unloaded = True
        for tp in assigned:
            self._epochs[tp] = self._epochs.get(tp, 0) + 1
            self._forget(tp)


class _TransactionStream:
    def __init__(self, feed: Feed) -> None:
        self._feed = feed

    def __aiter__(self) -> _TransactionStream:
        return self

    async def __anext__(self) -> Transaction:
        return await self._feed._next_transaction()
