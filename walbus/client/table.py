"""Table: a compacted per-table topic as a live, read-only mapping (a KTable).

The topic (``<prefix>.<database>.<schema>.<table>``, written by the demux) holds one record
per row change keyed by the primary key (``{"transaction_id":54441}``); a null value
(tombstone) deletes the key. A :class:`Table` reads it from the beginning into a dict (or a
mapping you give, e.g. a disk-backed one), then keeps following it. Records are read with
``isolation_level=read_committed``: the demux writes them in Kafka transactions.

A record that the demux cannot have written (:class:`InvalidTableRecord`) is logged as an
error, counted and skipped; the table keeps following the topic. When the reader itself
fails (the topic was deleted, the brokers refuse it), every read raises :class:`TableError`
instead of serving rows that no longer follow the topic.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer, TopicPartition
from prometheus_client import CollectorRegistry

from walbus.client._connect import client_kwargs as _client_kwargs
from walbus.client._connect import consumer_options as _consumer_options
from walbus.client._connect import topic_partitions
from walbus.client._race import until_set
from walbus.client.metrics import client_metrics
from walbus.client.progress import SourceProgress
from walbus.contract import ContractError, Lsn, demux_group, pop_table_meta, topic_name_error
from walbus.kafka import stop_consumer

log = logging.getLogger("walbus.client.table")

Row = dict[str, Any]


class TableError(RuntimeError):
    """The table's reader failed: its rows no longer follow the topic."""


class InvalidTableRecord(ValueError):
    """A record of a per-table topic that is not a row the demux writes."""


def freeze(value: Any) -> Any:
    """JSON lists as tuples, so that any key value can be a dict key."""
    if isinstance(value, list):
        return tuple(freeze(v) for v in value)
    return value


def table_key(key: Any) -> Any:
    """The mapping key for a primary key: the value for one column, a tuple for several.

    Accepts the key as given by the topic (``{"transaction_id": 54441}`` or its JSON bytes)
    or already in mapping form (``54441``, ``(1, "a")``).
    """
    if isinstance(key, bytes | bytearray):
        key = orjson.loads(key)
    if isinstance(key, dict):
        values = [freeze(v) for v in key.values()]
        return values[0] if len(values) == 1 else tuple(values)
    return freeze(key)


def decode_table_record(key: bytes, value: bytes | None) -> tuple[Any, Row | None, dict[str, Any]]:
    """``(mapping key, row or None for a delete, metadata)`` of one keyed record.

    Raises :class:`InvalidTableRecord` unless the key is a JSON object of the primary-key
    columns and the value is a tombstone or a row object with the demux's metadata whose
    key columns agree with the key (a row built from misaligned lists does not).
    """
    return _decode_record(key, value)[1:]


def _decode_record(key: bytes, value: bytes | None) -> tuple[tuple[str, ...], Any, Row | None, dict[str, Any]]:
    """:func:`decode_table_record`, and the key's column names in key order first."""
    try:
        key_obj = orjson.loads(key)
        row = orjson.loads(value) if value is not None else None
    except orjson.JSONDecodeError as e:
        raise InvalidTableRecord(f"not JSON: {e}") from None
    if not isinstance(key_obj, dict) or not key_obj:
        raise InvalidTableRecord(f"the key is not an object of primary-key columns: {key[:80]!r}")
    mapping_key = table_key(key_obj)
    try:
        hash(mapping_key)
    except TypeError:
        raise InvalidTableRecord(f"the key holds a JSON object: {key[:80]!r}") from None
    columns = tuple(key_obj)
    if row is None:
        return columns, mapping_key, None, {}
    if not isinstance(row, dict):
        raise InvalidTableRecord(f"the value is not a JSON object: {value[:80]!r}" if value else "empty value")
    try:
        meta = pop_table_meta(row)
    except ContractError as e:
        raise InvalidTableRecord(str(e)) from None
    op = meta["__op"]
    clash = [c for c, v in key_obj.items() if c in row and row[c] != v]
    if clash:
        raise InvalidTableRecord(f"the row's key column(s) {clash} differ from the record key")
    return columns, mapping_key, (None if op == "d" else row), meta


def _lsn(lsn: int | str) -> int:
    """An LSN as an int: PostgreSQL's text too (psycopg returns ``pg_lsn`` values as text, which
    compared with the table's positions was a TypeError); ValueError for other text."""
    return Lsn.parse(lsn) if isinstance(lsn, str) else lsn


@dataclass(frozen=True, slots=True)
class TableChange:
    """One applied record: the row before and after (None = absent)."""

    key: Any
    old: Row | None
    new: Row | None
    op: str  # c, u, r, or d (a delete record or a tombstone)
    commit_lsn: int | None  # None for a tombstone: it carries no value
    lsn: int | None
    seq: int | None
    xid: int | None
    ts: str | None
    partition: int
    offset: int


OnChange = Callable[[TableChange], Awaitable[None] | None]


class Table(Mapping[Any, Row]):
    """Current rows of one table, keyed by primary key, kept up to date from its topic.

    ::

        async with Table("walbus.shop.public.transactions", bootstrap_servers=...) as table:
            row = table.get(54441)            # or table.get({"transaction_id": 54441})
            await table.wait_until(commit_lsn)  # read-your-writes

    Args:
        topic: the compacted per-table topic.
        store: where rows live (default: a dict). Any ``MutableMapping``; it is not cleared,
            so a persistent store must start empty or hold this topic's state.
        on_change: called (sync or async) after each record is applied, during the initial
            load too. An exception in it is logged; the table keeps going.
        source_topic: the database topic the demux reads (default: the table topic without
            its ``.<schema>.<table>`` suffix), for :meth:`wait_until`.
        source_group: the demux's consumer group (default ``walbus-demux.<source_topic>``, the
            demux's own default), which makes :meth:`wait_until` exact (see there).
        follow_demux: False: :meth:`wait_until` does not consult the demux group (step 3).
        consumer_options: extra ``AIOKafkaConsumer`` options (not ``enable_auto_commit`` nor
            ``isolation_level``, which the Table sets: a ``ValueError``).
        metrics_registry: where the client's Prometheus counters live (default: the global one).
    """

    def __init__(
        self,
        topic: str,
        *,
        bootstrap_servers: str | None = None,
        client_kwargs: Mapping[str, Any] | None = None,
        store: MutableMapping[Any, Row] | None = None,
        on_change: OnChange | None = None,
        source_topic: str | None = None,
        source_group: str | None = None,
        follow_demux: bool = True,
        consumer_options: Mapping[str, Any] | None = None,
        metrics_registry: CollectorRegistry | None = None,
    ) -> None:
        self.topic = topic
        self.rows: MutableMapping[Any, Row] = {} if store is None else store
        self.on_change = on_change
        self.source_topic = source_topic or topic.rsplit(".", 2)[0]
        # A name Kafka can never create: the consumer would wait for it forever.
        for what, name in (("topic", topic), ("source_topic", self.source_topic)):
            problem = topic_name_error(name)
            if problem is not None:
                raise ValueError(f"{what} {problem}")
        self.source_group = (source_group or demux_group(self.source_topic)) if follow_demux else None
        self._kwargs = _client_kwargs(bootstrap_servers, client_kwargs)
        self._consumer_options = _consumer_options(consumer_options, self._kwargs, {
            "enable_auto_commit": "a Table commits nothing (it reads the whole topic at each start)",
            "isolation_level": "a Table reads read_committed (the demux writes in Kafka transactions)",
        })
        self._metrics_registry = metrics_registry
        self._metrics = client_metrics(metrics_registry)
        self.invalid_skipped = 0
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None
        self._progress: SourceProgress | None = None
        self._hw_consumer: AIOKafkaConsumer | None = None  # read_uncommitted: high watermarks
        self._tps: list[TopicPartition] = []
        self._applied: dict[TopicPartition, int] = {}  # offset after the last applied record
        self._max_commit: dict[TopicPartition, int] = {}  # highest __commit_lsn applied
        self._changed = asyncio.Condition()
        self._progress_lock = asyncio.Lock()
        self._stopped = asyncio.Event()  # stop() was called: waits end with TableError
        self._failure: BaseException | None = None
        self._warned_null_key = False
        self._key_columns: tuple[str, ...] = ()  # the primary key's columns, in key order (from the records)

    # -- mapping -----------------------------------------------------------------------------

    def _lookup_key(self, key: Any) -> Any:
        """The mapping key for ``key``: a dict form is read by column name, in the key's
        column order as the topic's records give it (a dict in another order looked up
        another row's key); KeyError for a dict of other columns."""
        if isinstance(key, bytes | bytearray):
            key = orjson.loads(key)
        columns = self._key_columns
        if isinstance(key, dict) and columns:
            if len(key) != len(columns) or not all(c in key for c in columns):
                raise KeyError(key)
            key = {c: key[c] for c in columns}
        return table_key(key)

    def __getitem__(self, key: Any) -> Row:
        self._check()
        return self.rows[self._lookup_key(key)]

    def __iter__(self) -> Iterator[Any]:
        self._check()
        return iter(self.rows)

    def __len__(self) -> int:
        self._check()
        return len(self.rows)

    def __contains__(self, key: object) -> bool:
        self._check()
        try:
            return self._lookup_key(key) in self.rows
        except (TypeError, KeyError, orjson.JSONDecodeError):
            return False

    def _check(self) -> None:
        if self._failure is not None:
            raise TableError(f"table reader for {self.topic} failed: {self._failure!r}") from self._failure

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Read the topic up to its current end (waiting for it to exist), then follow it."""
        if self._consumer is not None:
            raise RuntimeError("Table already started")
        options = {
            # A fetch with nothing new waits this long on the broker, and wait_until with it:
            # aiokafka's 500 ms default would dominate read-your-writes latency.
            "fetch_max_wait_ms": 100,
            **self._consumer_options,
        }
        consumer = AIOKafkaConsumer(**self._kwargs, enable_auto_commit=False, isolation_level="read_committed", **options)
        try:
            await consumer.start()
        except BaseException:
            await consumer.stop()  # unreachable or refused: not left unclosed
            raise
        self._consumer = consumer
        self._stopped.clear()
        try:
            self._tps = await topic_partitions(self._kwargs, self.topic)
            consumer.assign(self._tps)
            await consumer.seek_to_beginning(*self._tps)
            self._applied = {tp: 0 for tp in self._tps}
            ends = await consumer.end_offsets(self._tps)
            self._task = asyncio.create_task(self._follow(consumer), name=f"walbus-table:{self.topic}")
            await self._wait_offsets(ends)
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        # Every wait_until in progress ends ("Table stopped"), whichever step it is in: one in
        # step 4 waited for a notify that never came, one in step 3 died in an AttributeError.
        self._stopped.set()
        task, consumer, progress = self._task, self._consumer, self._progress
        self._task = self._consumer = self._progress = None
        hw, self._hw_consumer = self._hw_consumer, None
        if hw is not None:
            await stop_consumer(hw)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if consumer is not None:
            await stop_consumer(consumer)
        if progress is not None:
            await progress.stop()

    async def __aenter__(self) -> Table:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    # -- following ---------------------------------------------------------------------------

    async def _follow(self, consumer: AIOKafkaConsumer) -> None:
        try:
            while True:
                batches = await consumer.getmany(timeout_ms=500)
                if not batches and consumer.partitions_for_topic(self.topic) is None:
                    # aiokafka keeps polling a deleted topic in silence: ask the brokers.
                    await topic_partitions(self._kwargs, self.topic, wait=False)
                # Positions also move over transaction markers, which return no record.
                positions = {tp: await consumer.position(tp) for tp in self._tps}
                for tp, msgs in batches.items():
                    for m in msgs:
                        try:
                            await self._apply(tp, m)
                        except InvalidTableRecord as e:
                            self._skip_invalid(m, e)
                        self._applied[tp] = m.offset + 1
                for tp, pos in positions.items():
                    self._applied[tp] = max(self._applied[tp], pos)
                async with self._changed:
                    self._changed.notify_all()
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self._failure = e
            log.exception("table reader failed; reads raise TableError", extra={"topic": self.topic})
            async with self._changed:
                self._changed.notify_all()

    async def _apply(self, tp: TopicPartition, m: Any) -> None:
        if m.key is None:
            if not self._warned_null_key:
                log.warning("ignoring records without a key (table without a primary key?)", extra={"topic": self.topic})
                self._warned_null_key = True
            return
        columns, key, new, meta = _decode_record(m.key, m.value)
        self._key_columns = columns  # the latest: a changed primary key renames them
        op = meta.get("__op", "d")
        old = self.rows.get(key)
        if new is None:
            self.rows.pop(key, None)
        else:
            self.rows[key] = new
        commit_lsn = meta.get("__commit_lsn")
        if isinstance(commit_lsn, int):
            self._max_commit[tp] = max(self._max_commit.get(tp, -1), commit_lsn)
        if self.on_change is not None and (old is not None or new is not None):
            change = TableChange(
                key, old, new, op, commit_lsn, meta.get("__lsn"), meta.get("__seq"), meta.get("__xid"),
                meta.get("__ts"), tp.partition, m.offset,
            )
            try:
                result = self.on_change(change)
                if inspect.isawaitable(result):
                    await result
            except Exception:
                log.exception("on_change failed", extra={"topic": self.topic, "key": repr(key)})

    def _skip_invalid(self, m: Any, error: InvalidTableRecord) -> None:
        self.invalid_skipped += 1
        self._metrics.invalid_records.labels("table", self.topic).inc()
        log.error(
            "skipping a record that is not a walbus table row",
            extra={"topic": m.topic, "partition": m.partition, "offset": m.offset, "error": str(error)},
        )

    async def _wait_offsets(self, targets: Mapping[TopicPartition, int]) -> None:
        def reached() -> bool:
            return self._failure is not None or all(self._applied.get(tp, 0) >= off for tp, off in targets.items())

        async with self._changed:
            await self._changed.wait_for(reached)
        self._check()

    # -- read-your-writes --------------------------------------------------------------------

    def reflects(self, lsn: int | str) -> bool:
        """True when every partition has applied a record committed after ``lsn``."""
        self._check()
        lsn = _lsn(lsn)
        return bool(self._tps) and all(self._max_commit.get(tp, -1) > lsn for tp in self._tps)

    async def wait_until(self, lsn: int | str) -> None:
        """Return once the table reflects every transaction with ``commit_lsn <= lsn``.

        ``lsn`` is a commit LSN (``ChangeEvent.commit_lsn``, ``TableChange.commit_lsn``) or any
        LSN at or before one that reaches the database topic; an int or PostgreSQL's text
        (``"16/B374D848"``, as psycopg returns a ``pg_lsn``). How it decides:

        1. this table has already applied, in every partition, a record committed after
           ``lsn`` (per-partition order is commit order): done;
        2. otherwise it waits until the database topic (``source_topic``) holds every event
           of those commits: it holds an event with ``commit_lsn > lsn``, or a producer's
           heartbeat reports a confirmed position past ``lsn`` (the producer sends one as soon
           as a transaction is acknowledged and it idles). A commit's own events do not end
           this step (a large one is written over several batches), unless heartbeats are
           off. (So an LSN read *after* your commit, e.g. ``pg_current_wal_lsn()``, waits for
           a later commit or the producer's next confirmation of the server's position.)
        3. unless ``follow_demux=False``, it waits until the demux's committed
           offset on the database topic has passed every event of those commits (it reached
           the end seen in step 2, or the record before it belongs to a later commit); the
           demux commits its offsets in the Kafka transaction of its output, so every record
           derived from those commits is then visible. Without this step a lagging demux can
           make the wait return early;
        4. finally it reads this topic's high watermarks and waits until the table's
           ``read_committed`` position has passed them. Not the last stable offsets: a Kafka
           transaction's markers reach its partitions one by one, so the demux's committed
           offset (step 3) can be visible before the marker of its output on this topic; the
           high watermark already counts that output. (A demux transaction open on this topic
           at that moment delays the return until it commits or aborts.)

        Bound the wait with ``async with asyncio.timeout(seconds):``. A ``source_topic`` that
        does not exist raises :class:`LookupError` (pass the topic the demux reads).
        """
        if self._consumer is None:
            raise RuntimeError("Table not started")
        lsn = _lsn(lsn)
        if self.reflects(lsn):
            return
        steps = await until_set(self._reach(lsn), self._stopped)
        self._check_running()
        steps.result()

    async def _reach(self, lsn: int) -> None:
        """wait_until's steps 2 to 4 (stop() cancels them: they use the consumers it stops)."""
        async with self._progress_lock:
            if self._progress is None:
                progress = SourceProgress(
                    self._kwargs, self.source_topic, self.source_group, metrics_registry=self._metrics_registry
                )
                await self._started(progress.start, progress.stop)
                self._progress = progress
            progress = self._progress
        ends = await progress.commit_reached(lsn)
        await progress.group_reached(lsn, ends)
        await self._wait_offsets(await self._high_watermarks())

    def _check_running(self) -> None:
        # A wait in any step when stop() came: one waiting for the demux died in an
        # AttributeError, one waiting for the table's reader waited for good (a client fuzz).
        if self._stopped.is_set():
            raise TableError("Table stopped")

    async def _started(self, start: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[None]]) -> None:
        """Start a client of a wait, not cut short: aiokafka's clients cancelled while starting
        left a connection open, and one started after stop() looked was never stopped (a
        re-fuzz). Then it is stopped here, and the wait ends with TableError."""
        starting = asyncio.ensure_future(start())
        try:
            await asyncio.shield(starting)
            self._check_running()
        except BaseException:
            await asyncio.wait((starting,))
            await stop()
            raise

    async def _high_watermarks(self) -> dict[TopicPartition, int]:
        async with self._progress_lock:  # concurrent first waits: one consumer, not one each (a fuzz)
            if self._hw_consumer is None:
                self._check_running()
                hw = AIOKafkaConsumer(**self._kwargs, enable_auto_commit=False, isolation_level="read_uncommitted")
                await self._started(hw.start, hw.stop)
                self._hw_consumer = hw
            hw = self._hw_consumer
        return dict(await hw.end_offsets(self._tps))
