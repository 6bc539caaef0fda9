"""The initial consistent snapshot: every existing row once, then streaming from exactly there.

The design, and why no row is missing or doubled: docs/producer.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, cast

import orjson
import psycopg
from aiokafka import AIOKafkaConsumer, TopicPartition
from psycopg import sql

from producer import setup
from producer.codec import CaptureFilter, ChangeRun, EncodedEvent, EventEncoder, Relation
from producer.config import ProducerConfig
from producer.metrics import SnapshotMetrics
from producer.native import EncodeCopyRows, encode_copy_rows
from producer.offsets import OffsetStore
from producer.progress import Progress
from producer.replication import ReplicationStream
from producer.session import session_options
from producer.sink import KafkaSink
from producer.tablescan import (
    ScanTable,
    convert_line,
    convert_row,
    copy_table_blocks,
    describe_table,
    str_converters,
)
from walbus.config import ConfigError
from walbus.contract import MASK, Lsn, decode_event, qualify_table
from walbus.retry import Backoff

log = logging.getLogger("walbus.producer.snapshot")

KIND = "initial"
_COPY_RUN = 512  # lines the native path encodes per call: one Kafka batch's worth or so


class SnapshotAborted(Exception):
    """The producer was asked to stop mid-snapshot; the next start redoes it."""


class SnapshotOutdated(Exception):
    """A table to read changed in a way the exported snapshot cannot read (rewritten, dropped,
    renamed) after its consistent point, or could not be locked: the export is taken again."""


# A table of at least this many heap pages (8 MB) is read by several connections at once,
# in ranges of pages (TID range scans), when there are several workers.
SPLIT_MIN_PAGES = 1024


@dataclass
class Part:
    """One unit of work: a whole table, or a range of its heap pages."""

    table: ScanTable
    pages: tuple[int, int | None] | None = None


@dataclass
class Batch:
    table: ScanTable
    rows: list[list[Any]]  # converted rows (the pure-Python path)
    done: bool = False  # the last batch of its part
    lines: list[bytes] | None = None  # or COPY text lines, for the native run (then rows is empty)


def plan_parts(tables: list[ScanTable], workers: int) -> list[Part]:
    """Largest tables first; a large table split into ``2 * workers`` page ranges so that the
    workers share it. The last range is open-ended: rows the snapshot sees never move to
    pages added since the size was read (new pages hold only newer row versions), but
    open-ended costs nothing and needs no such argument."""
    parts: list[Part] = []
    for t in sorted(tables, key=lambda t: -max(t.pages, t.estimated_rows)):
        if workers > 1 and t.pages >= SPLIT_MIN_PAGES:
            n = 2 * workers
            step = -(-t.pages // n)
            bounds = [i * step for i in range(n)]
            parts += [Part(t, (lo, bounds[i + 1] if i + 1 < n else None)) for i, lo in enumerate(bounds)]
        else:
            parts.append(Part(t))
    return parts


@dataclass
class SnapshotResult:
    consistent_point: int  # where the snapshot was taken
    reads_at: int  # the commit LSN of its events (see Snapshot._reads_before_the_replay)
    first_seq: int = 0  # and the seq of the first (see reads_position)
    rows: int = 0
    deletes: int = 0
    seconds: float = 0.0
    per_table: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class SnapshotPlan:
    """What to do at start: recreate the slot, snapshot, or just create the slot."""

    snapshot: bool = False
    drop_slot: bool = False  # before anything else (interrupted snapshot, lost slot)
    create_slot: bool = False  # without a snapshot (never, no_data)
    record_no_data: bool = False  # write initial.status = completed without reading (no_data)


def plan_snapshot(mode: str, slot: setup.SlotState, status: str | None, *, over_existing_slot: bool = False) -> SnapshotPlan:
    """Debezium's snapshot modes over walbus's facts: whether the slot exists or was lost, and
    the last snapshot's status in the progress store (``running``: interrupted;
    ``over_existing_slot``: that attempt read over a slot that had streamed before)."""
    if slot.lost:
        if mode in ("when_needed", "always"):
            return SnapshotPlan(snapshot=True, drop_slot=True)
        raise ConfigError(
            "the replication slot was invalidated (wal_status lost: its WAL was removed, max_slot_wal_keep_size): it cannot "
            "stream again. Start once with --snapshot-mode when_needed (drops it, creates it and snapshots), or drop the slot"
        )
    if mode in ("never", "no_data"):
        return SnapshotPlan(create_slot=not slot.exists, record_no_data=mode == "no_data" and status != "completed")
    if status == "running":
        # Interrupted. Over the slot it created itself, nothing was streamed from it yet: a new
        # slot and snapshot lose nothing. Over a slot that had streamed (always, when_needed),
        # the slot holds what changed since: dropping it lost those changes (a row deleted
        # while the producer was down stayed live; found by a fuzz). Redo it over the slot.
        return SnapshotPlan(snapshot=True, drop_slot=slot.exists and not over_existing_slot)
    if not slot.exists or mode == "always":
        return SnapshotPlan(snapshot=True)
    if mode == "when_needed" and status != "completed":
        return SnapshotPlan(snapshot=True)  # no offsets: what the slot holds may not be everything
    return SnapshotPlan()


def reads_position(replay_from: int, last: tuple[int, int] | None) -> tuple[int, int]:
    """The (commit LSN, first seq) of the reads of a snapshot over an existing slot that will
    send again what commits from ``replay_from`` on, when the topic's highest position is
    ``last``: above every position in the topic, below every one the slot sends that is not.

    Commit records the slot sends start at ``replay_from`` or later, so ``replay_from - 1`` is
    below them all; reads of an earlier snapshot may already sit there (an interrupted one
    redone, ``always`` twice before the slot moved): then after their seqs. Before, these
    reads went to ``replay_from`` itself, the commit LSN of a transaction whose commit record
    starts exactly there, and its events, sent after, were skipped as re-sends (a fuzz). When
    the topic holds a commit at or after ``replay_from`` (completed first: see
    InitialSnapshot.open_transaction_position), just after it."""
    below = replay_from - 1
    if last is None or last[0] < below:
        return (max(below, 0), 0)
    if last[0] == below:
        return (below, last[1] + 1)
    return (last[0] + 1, 0)


class InitialSnapshot:
    """Decides whether a snapshot is due, creates the slot, and runs it."""

    def __init__(
        self,
        config: ProducerConfig,
        capture: CaptureFilter,
        *,
        offsets: OffsetStore,
        metrics: SnapshotMetrics,
        client_kwargs: dict[str, Any],
        partitions: int,
        stopping: asyncio.Event,
        new_sink: Callable[[Progress], KafkaSink],
    ) -> None:
        self.config = config
        self.capture = capture
        self.offsets = offsets
        self.metrics = metrics
        self.client_kwargs = client_kwargs
        self.partitions = partitions
        self.stopping = stopping
        self.new_sink = new_sink  # the stream's sink settings and topic limit
        self.result: SnapshotResult | None = None

    # -- the decision ------------------------------------------------------------------------

    async def prepare(self, slot: setup.SlotState) -> bool:
        """Create the slot and snapshot as the mode says. False: the producer should exit now
        (``initial_only``)."""
        cfg = self.config
        mode = cfg.snapshot_mode
        state: dict[str, Any] = self.offsets.doc.get("initial") or {}
        status = state.get("status")
        plan = plan_snapshot(mode, slot, status, over_existing_slot=bool(state.get("over_existing_slot")))
        interrupted = plan.snapshot and status == "running"
        if interrupted:
            log.warning(
                "the initial snapshot was interrupted before completion: redoing it",
                extra={"slot": cfg.slot_name, "attempt": int(state.get("attempt", 1)) + 1},
            )
        if plan.drop_slot:
            log.warning(
                "dropping and recreating the slot for the new snapshot"
                + (": nothing was streamed from it yet, so nothing is lost" if interrupted else ": it was invalidated (wal_status lost)"),
                extra={"slot": cfg.slot_name},
            )
            await asyncio.to_thread(setup.drop_slot, cfg.pg_dsn, cfg.slot_name)
            slot = setup.SlotState(False)
        if plan.create_slot:
            await asyncio.to_thread(self._create_slot_without_snapshot)
        if plan.record_no_data:
            # Recorded as Debezium records it: a later when_needed/initial start does not read the tables.
            self.offsets.doc["initial"] = {
                "status": "completed", "mode": "no_data", "rows": 0, "completed_at": datetime.now(UTC).isoformat(timespec="seconds"),
            }
            await self.offsets.save()
            log.info("snapshot mode no_data: streaming from the slot's position without reading the tables", extra={"slot": cfg.slot_name})
        if slot.exists and not plan.snapshot and status != "completed" and mode in ("initial", "initial_only"):
            log.info(
                "the slot exists and no snapshot was recorded for it (created with --snapshot-mode never or before "
                "snapshots existed): streaming without a snapshot (--snapshot-mode when_needed would read the tables)",
                extra={"slot": cfg.slot_name},
            )
        if plan.snapshot:
            if slot.exists and not interrupted and mode == "when_needed":
                log.info("snapshot mode when_needed: the slot exists but no completed snapshot is recorded: reading the tables",
                         extra={"slot": cfg.slot_name})
            self.result = await self.run(existing_slot=slot.exists, previous=state if interrupted else None)
        return mode != "initial_only"

    async def open_transaction_position(self, slot: setup.SlotState) -> int | None:
        """The commit LSN the stream must first reach when a snapshot over this existing slot is
        due and the topic's last transaction may be in it only in part; None otherwise.

        The slot has not confirmed that transaction (it confirms a transaction's end once all
        of it is acknowledged), so it sends it again in full; once complete in the topic, the
        reads can go after it (:meth:`_reads_before_the_replay`)."""
        state: dict[str, Any] = self.offsets.doc.get("initial") or {}
        plan = plan_snapshot(self.config.snapshot_mode, slot, state.get("status"), over_existing_slot=bool(state.get("over_existing_slot")))
        if not (plan.snapshot and slot.exists and not plan.drop_slot):
            return None
        last = await self.offsets.topic_last_position(self.config.topic_name, self.partitions)
        return last[0] if last is not None and last[0] >= slot.confirmed_flush_lsn else None

    def _create_slot_without_snapshot(self) -> None:
        cfg = self.config
        stream = ReplicationStream.connect(cfg.pg_dsn)
        try:
            stream.execute(f'CREATE_REPLICATION_SLOT "{cfg.slot_name}" LOGICAL {cfg.plugin} NOEXPORT_SNAPSHOT')
        finally:
            stream.close()
        log.info("created replication slot", extra={"slot": cfg.slot_name, "plugin": cfg.plugin})

    # -- the snapshot ------------------------------------------------------------------------

    async def run(self, *, existing_slot: bool, previous: dict[str, Any] | None) -> SnapshotResult:
        cfg = self.config
        started = time.monotonic()
        await asyncio.to_thread(self._check_readable)
        if previous is not None and previous.get("from_offsets"):
            from_offsets = [int(o) for o in previous["from_offsets"]]
        else:
            from_offsets = await self.offsets.topic_end_offsets(cfg.topic_name, self.partitions)
        attempt = int(previous.get("attempt", 1)) + 1 if previous is not None else 1
        # Keys the interrupted attempts emitted, to delete those the new snapshot no longer has.
        earlier = await self._emitted_keys(from_offsets) if previous is not None else {}
        self.offsets.doc["initial"] = {
            "status": "running", "attempt": attempt, "from_offsets": from_offsets, "over_existing_slot": existing_slot,
        }
        await self.offsets.save()  # before the slot exists: a crash from here on is seen as "interrupted"

        backoff = Backoff(initial=0.5, maximum=30.0)
        try:
            while True:
                export = await asyncio.to_thread(_Export.open, cfg, existing_slot)
                try:
                    # A new slot sends the commits from its consistent point on (a transaction running
                    # when the slot became consistent may commit exactly there, outside the snapshot):
                    # its reads go below that point too, as an existing slot's below its position.
                    replay_from = export.replay_from if export.replay_from is not None else export.consistent_point
                    reads_at = await self._reads_before_the_replay(replay_from)
                    result = await self._read(export, earlier, reads_at)
                    break
                except SnapshotOutdated as e:
                    outdated = e
                finally:
                    await asyncio.to_thread(export.close)
                # Nothing was read yet, and nothing streamed from a slot this attempt created: a new
                # slot (and export) lose nothing. An existing slot keeps its position; only the
                # export is taken again.
                if not existing_slot:
                    await asyncio.to_thread(setup.drop_slot, cfg.pg_dsn, cfg.slot_name)
                await backoff.wait(log, "the initial snapshot's export", outdated, stop=self.stopping)
                if self.stopping.is_set():
                    raise SnapshotAborted("stop requested during the initial snapshot")
        except Exception:
            if not existing_slot:
                # The slot this attempt created would hold WAL until the next start drops it
                # (nothing was streamed from it): dropped now, a refusal (exit 2) or a crash
                # loop holds no WAL meanwhile.
                await asyncio.to_thread(_drop_new_slot, cfg)
            raise
        result.seconds = time.monotonic() - started
        self.offsets.doc["initial"] = {
            "status": "completed", "attempt": attempt, "consistent_point": result.consistent_point,
            "rows": result.rows, "completed_at": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        await self.offsets.save()
        self.metrics.end(KIND, result.seconds)
        log.info(
            "initial snapshot completed",
            extra={
                "rows": result.rows, "deletes_of_vanished_rows": result.deletes, "seconds": round(result.seconds, 3),
                "rows_per_s": round(result.rows / result.seconds) if result.seconds else None,
                "consistent_point": str(Lsn(result.consistent_point)), "attempt": attempt,
            },
        )
        return result

    async def _reads_before_the_replay(self, replay_from: int) -> tuple[int, int]:
        """The commit LSN of the reads of a snapshot from an existing slot: after every event
        already in the topic, before every one the slot is about to send again that is not.

        The snapshot is taken now, but streaming then starts at the slot's confirmed position,
        before it: changes committed in between come again. Placed at the snapshot's own
        position, the reads came before those changes in the topic but after them in position
        order, so every consumer that skips re-sent positions (the demux, Feed, Table) skipped
        them: a row deleted in between stayed live for good (found by a fuzz, --snapshot-mode
        always). Placed here, the changes apply after the reads, and the latest of each row
        wins, as after any re-send. A commit LSN is a commit record's own position: the one
        after the topic's last is at least a record further on, so ``last + 1`` is free."""
        last = await self.offsets.topic_last_position(self.config.topic_name, self.partitions)
        return reads_position(replay_from, last)

    async def _read(self, export: _Export, earlier: dict[str, set[bytes]], reads_at: tuple[int, int]) -> SnapshotResult:
        cfg = self.config
        loop = asyncio.get_running_loop()
        workers = max(1, cfg.snapshot_workers)
        conns = await asyncio.to_thread(export.import_into, workers)
        try:
            tables = await asyncio.to_thread(self._tables, conns[0])
        except BaseException:
            for c in conns:
                with contextlib.suppress(Exception):
                    c.close()
            raise
        result = SnapshotResult(export.consistent_point, reads_at=reads_at[0], first_seq=reads_at[1])
        self.metrics.begin(KIND, len(tables))
        log.info(
            "initial snapshot started",
            extra={"consistent_point": str(Lsn(export.consistent_point)), "tables": [t.qualified for t in tables], "workers": workers},
        )
        progress = Progress(self.partitions + 1)
        sink = self.new_sink(progress)
        await sink.start()
        todo: queue.SimpleQueue[Part] = queue.SimpleQueue()
        parts = plan_parts(tables, workers)
        for part in parts:
            todo.put(part)
        parts_left: dict[str, int] = {}
        for part in parts:
            parts_left[part.table.qualified] = parts_left.get(part.table.qualified, 0) + 1
        batches: asyncio.Queue[Batch | None] = asyncio.Queue(maxsize=4 * workers)
        errors: list[BaseException] = []
        cancel = threading.Event()

        def put(item: Batch | None) -> None:
            # Blocks the worker while the queue is full: Kafka's pace is the snapshot's pace.
            fut = asyncio.run_coroutine_threadsafe(batches.put(item), loop)
            while not cancel.is_set():
                with contextlib.suppress(TimeoutError):
                    fut.result(timeout=0.5)
                    return
            fut.cancel()

        copy_rows = encode_copy_rows()
        raw = copy_rows is not None  # the native run converts the lines: the workers only read
        threads = [
            threading.Thread(target=_worker, args=(c, todo, cfg.snapshot_fetch_rows, put, errors, cancel, raw), daemon=True,
                             name=f"snapshot-{i}")
            for i, c in enumerate(conns)
        ]
        for th in threads:
            th.start()
        try:
            await self._emit(sink, batches, len(threads), result, earlier, parts_left, copy_rows)
            if errors:
                raise errors[0]
            await sink.wait_acked(timeout=120)
        except BaseException:
            self.metrics.end(KIND, 0.0, aborted=True)
            raise
        finally:
            cancel.set()
            for th in threads:
                await asyncio.to_thread(th.join, 10)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(sink.stop(), 30)
            for c in conns:
                with contextlib.suppress(Exception):
                    c.close()
        return result

    async def _emit(
        self, sink: KafkaSink, batches: asyncio.Queue[Batch | None], workers: int, result: SnapshotResult,
        earlier: dict[str, set[bytes]], parts_left: dict[str, int], copy_rows: EncodeCopyRows | None,
    ) -> None:
        cp = result.reads_at
        encoder = EventEncoder(partitioned=self.partitions > 1)
        encoder.begin(cp, 0, datetime.now(UTC).isoformat(timespec="microseconds"))
        encoder.seq = result.first_seq
        scanned = self.metrics.rows_scanned
        remaining = len(parts_left)
        seen_tables: dict[str, ScanTable] = {}
        while workers:
            if self.stopping.is_set():
                raise SnapshotAborted("stop requested during the initial snapshot")
            batch = await batches.get()
            if batch is None:
                workers -= 1
                continue
            table = batch.table
            rel = table.relation
            seen_tables[rel.qualified] = table
            rows = batch.rows
            if batch.lines is not None:
                assert copy_rows is not None
                rows = await _emit_lines(encoder, sink, rel, cp, batch.lines, copy_rows)
            else:
                await _emit_rows(encoder, sink, rel, cp, rows)
            gone = earlier.get(rel.qualified)
            if gone and rel.pk_index:
                for values in rows:
                    gone.discard(snapshot_key(rel, values))
            n = len(rows)
            result.rows += n
            result.per_table[rel.qualified] = result.per_table.get(rel.qualified, 0) + n
            scanned.labels(KIND, rel.qualified).inc(n)
            if batch.done:
                parts_left[rel.qualified] -= 1
            if batch.done and not parts_left[rel.qualified]:
                remaining -= 1
                self.metrics.tables_remaining.labels(KIND).set(remaining)
                log.info("snapshot of table done", extra={"table": rel.qualified, "rows": result.per_table.get(rel.qualified, 0)})
            await sink.flush_idle()
            sink.raise_if_failed()
        for name, keys in earlier.items():
            known = seen_tables.get(name)
            if known is None or not keys or not known.relation.pk_index:
                continue  # a table dropped since (or keyless): nothing to say the row is gone
            for ev in _deletes(encoder, known, keys, cp):
                await sink.put(ev)
                result.deletes += 1
        if result.deletes:
            log.info("emitted deletes for rows the interrupted snapshot had read and that are gone", extra={"deletes": result.deletes})

    def _tables(self, conn: psycopg.Connection[tuple[object, ...]]) -> list[ScanTable]:
        """The captured tables as the snapshot sees them (listed inside the snapshot, so a table
        created after the consistent point is left to the stream), locked until the snapshot
        ends and checked to be readable by it (:func:`lock_tables`)."""
        names = self._names(conn)
        lock_tables(conn, names)
        out: list[ScanTable] = []
        read_as_itself = self.config.plugin == "pgoutput"  # else (wal2json) a partitioned table is read as its leaves
        for relid, (schema, table) in enumerate(names, start=1):
            scan = describe_table(conn, schema, table, self.capture, relid)
            if scan is not None and (scan.kind == "r" or read_as_itself):
                out.append(scan)
        check_unchanged(conn, [(t.relation.schema, t.relation.name) for t in out])
        return out

    def _names(self, conn: psycopg.Connection[tuple[object, ...]]) -> list[setup.TableName]:
        """The captured tables the snapshot reads (partitioned ones too; see :meth:`_tables`):
        under the names the stream gives their changes. pgoutput's publication lists them (a
        partitioned table's leaves, or the table itself under publish_via_partition_root);
        wal2json names the leaves."""
        published = setup.published_tables(conn, self.config.publication_name) if self.config.plugin == "pgoutput" else None
        return [
            (schema, table) for schema, table in setup.list_tables(conn)
            if self.capture.captures(name := qualify_table(schema, table)) and name != self.capture.signal_table
            and (published is None or (schema, table) in published)
        ]

    def _check_readable(self) -> None:
        """ConfigError before anything is created when the role may not read a table the
        snapshot reads (see setup.check_select)."""
        with setup.connect(self.config.pg_dsn) as conn:
            setup.check_select(conn, self._names(conn), partitioned=self.config.plugin == "pgoutput")

    async def _emitted_keys(self, from_offsets: list[int]) -> dict[str, set[bytes]]:
        """Primary keys of the ``read`` events already in the topic from ``from_offsets`` on."""
        cfg = self.config
        consumer = AIOKafkaConsumer(**self.client_kwargs, enable_auto_commit=False, max_partition_fetch_bytes=8 << 20)
        await consumer.start()
        keys: dict[str, set[bytes]] = {}
        try:
            tps = [TopicPartition(cfg.topic_name, p) for p in range(len(from_offsets))]
            consumer.assign(tps)
            ends = await consumer.end_offsets(tps)
            for tp, start in zip(tps, from_offsets, strict=True):
                consumer.seek(tp, start)
                while await consumer.position(tp) < ends[tp]:
                    got = await consumer.getmany(tp, timeout_ms=1000, max_records=50000)
                    for m in got.get(tp, []):
                        read = emitted_read_key(m.value)
                        if read is not None:
                            keys.setdefault(read[0], set()).add(read[1])
        finally:
            await consumer.stop()
        log.info("keys emitted by the interrupted snapshot", extra={"tables": {t: len(k) for t, k in keys.items()}})
        return keys


def snapshot_key(rel: Relation, values: list[Any]) -> bytes:
    """A row's primary key as :func:`emitted_read_key` reads it back from the topic (a masked
    key column is ``MASK`` there)."""
    masked = rel.masked
    return orjson.dumps([MASK if i in masked and values[i] is not None else values[i] for i in rel.pk_index])


def emitted_read_key(value: bytes) -> tuple[str, bytes] | None:
    """The table and primary key (JSON of the key values, as the snapshot compares them) of a
    read event in the topic; None for other events, and for a read that lacks a key column
    (excluded from events): no delete could name that row."""
    ev = decode_event(value)  # our own records: a contract error is a fault
    key = ev.key_values() if ev.operation == "read" else None
    return None if key is None else (ev.table, orjson.dumps(list(key.values())))


def _deletes(encoder: EventEncoder, table: ScanTable, keys: set[bytes], cp: int) -> list[EncodedEvent]:
    rel = table.relation
    out = []
    for key in sorted(keys):
        old: list[Any] = [None] * len(rel.columns)
        for i, v in zip(rel.pk_index, orjson.loads(key), strict=True):
            old[i] = v
        out.append(encoder.encode(rel, "delete", cp, None, old=old))
    return out


async def _emit_rows(encoder: EventEncoder, sink: KafkaSink, rel: Relation, cp: int, rows: list[list[Any]]) -> None:
    """Converted rows as read events, one at a time (the pure-Python path)."""
    read, append = encoder.read, sink.append
    for values in rows:
        ev = read(rel, cp, values)
        if not append(ev):  # a full batch: the only await
            await sink.put(ev)


def read_events(
    encoder: EventEncoder, rel: Relation, cp: int, lines: list[bytes], copy_rows: EncodeCopyRows,
) -> Iterator[ChangeRun | EncodedEvent]:
    """COPY text lines as read events: runs encoded natively, and a line the run leaves (text
    its converters refuse) converted the pure-Python way, which decides."""
    convs, i = rel.converters, 0
    while i < len(lines):
        run = copy_rows(lines, i, rel.kinds, encoder.read_parts(rel), encoder.key_parts(), encoder.seq, cp, _COPY_RUN)
        if run[0]:
            yield encoder.changed_run(rel, run)
            i += len(run[0])
        else:
            yield encoder.read(rel, cp, convert_row(lines[i], convs)[0])
            i += 1


async def _emit_lines(
    encoder: EventEncoder, sink: KafkaSink, rel: Relation, cp: int, lines: list[bytes], copy_rows: EncodeCopyRows,
) -> list[list[Any]]:
    """:func:`read_events` into ``sink``; returns the rows' values."""
    rows: list[list[Any]] = []
    for item in read_events(encoder, rel, cp, lines, copy_rows):
        if isinstance(item, ChangeRun):
            await sink.put_run(item)
            rows.extend(cast(list[list[Any]], item.images()[0]))
        else:
            if not sink.append(item):
                await sink.put(item)
            rows.append(cast(list[Any], item.new))
    return rows


def _worker(
    conn: psycopg.Connection[tuple[object, ...]], todo: queue.SimpleQueue[Part], fetch_rows: int,
    put: Callable[[Batch | None], None], errors: list[BaseException], cancel: threading.Event, raw: bool,
) -> None:
    """One snapshot connection: reads whole tables, hands rows to the event loop: converted,
    or (``raw``, a table without excluded or masked columns) as COPY lines for the native run."""
    try:
        while not cancel.is_set():
            try:
                part = todo.get_nowait()
            except queue.Empty:
                break
            table = part.table
            convs = table.relation.converters
            str_convs = str_converters(table.relation.types)
            as_lines = raw and table.relation.plain
            rows: list[list[Any]] = []
            lines: list[bytes] = []
            for block in copy_table_blocks(conn, table, part.pages, stop=cancel):
                if as_lines:
                    lines.extend(block)
                else:
                    rows.extend([convert_line(line, convs, str_convs) for line in block])
                if len(rows) + len(lines) >= fetch_rows:
                    put(Batch(table, rows, lines=lines if as_lines else None))
                    rows, lines = [], []
                    if cancel.is_set():
                        return
            put(Batch(table, rows, done=True, lines=lines if as_lines else None))
    except BaseException as e:
        errors.append(e)
    finally:
        put(None)


def _drop_new_slot(cfg: ProducerConfig) -> None:
    """Drop the slot a failed snapshot created (not if something streams from it: a slot in
    use cannot be dropped)."""
    try:
        setup.drop_slot(cfg.pg_dsn, cfg.slot_name)
    except Exception as e:  # the database away, the slot in use: the next start sees to it
        log.warning("the slot the failed snapshot created could not be dropped", extra={"slot": cfg.slot_name, "error": str(e)})


# How long the snapshot waits for one table's lock before it gives the export up and takes it
# again (a session holding ACCESS EXCLUSIVE is about to rewrite or drop the table, most often;
# waiting on without a limit could also deadlock with DDL that holds one table and waits for
# another this snapshot already locked).
LOCK_WAIT = "5s"


def lock_tables(conn: psycopg.Connection[tuple[object, ...]], tables: list[setup.TableName]) -> None:
    """Lock ``tables`` in ACCESS SHARE mode inside the snapshot's transaction, until it ends.

    PostgreSQL's table rewrites (TRUNCATE, ALTER TABLE … TYPE, VACUUM FULL, CLUSTER) are not
    MVCC-safe: the table gets a new heap whose rows a snapshot taken before them does not see.
    Without the locks, a table rewritten while the snapshot read other tables was read as
    empty, and its rows were lost for good (an ALTER … TYPE streams no row change; found by a
    fuzz). With them (as pg_dump takes them) such DDL waits until the snapshot ends; one that
    committed between the consistent point and the lock is caught by :func:`check_unchanged`.
    A table dropped or renamed since (not found under its name) or still locked after
    ``LOCK_WAIT`` raises SnapshotOutdated: the export is taken again."""
    conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(LOCK_WAIT)))
    for schema, table in tables:
        ident = sql.Identifier(schema, table)
        try:
            # One round trip; the savepoint keeps the transaction (and its snapshot) usable when the lock fails.
            conn.execute(sql.SQL("SAVEPOINT walbus_lock; LOCK TABLE {} IN ACCESS SHARE MODE; RELEASE SAVEPOINT walbus_lock").format(ident))
        except (psycopg.errors.LockNotAvailable, psycopg.errors.UndefinedTable) as e:
            conn.execute("ROLLBACK TO SAVEPOINT walbus_lock")
            name = qualify_table(schema, table)
            if isinstance(e, psycopg.errors.UndefinedTable):
                raise SnapshotOutdated(f"table {name} was dropped or renamed after the snapshot's consistent point") from e
            holders = conn.execute(
                "SELECT l.pid, l.mode, a.state, left(a.query, 200) FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid "
                "WHERE l.locktype = 'relation' AND l.relation = to_regclass(%s) AND l.granted AND l.mode = 'AccessExclusiveLock' "
                "AND l.pid <> pg_backend_pid()",
                (ident.as_string(conn),),
            ).fetchall()
            log.warning(
                "a table to snapshot is locked by another session: taking the snapshot again",
                extra={"table": name, "waited": LOCK_WAIT,
                       "blockers": [{"pid": h[0], "mode": h[1], "state": h[2], "query": h[3]} for h in holders]},
            )
            raise SnapshotOutdated(f"table {name} stayed locked by another session for {LOCK_WAIT}") from e
    conn.execute("SET LOCAL lock_timeout TO DEFAULT")


def check_unchanged(conn: psycopg.Connection[tuple[object, ...]], tables: list[setup.TableName]) -> None:
    """SnapshotOutdated when one of ``tables`` (locked) was rewritten, dropped or replaced
    after the snapshot's consistent point.

    ``pg_class`` read by a query shows the table as the snapshot sees it; the catalog lookups
    behind ``pg_relation_filenode`` and ``to_regclass`` show it as it is now. A different heap
    (relfilenode; a partitioned table's: each partition's) means a rewrite the snapshot cannot
    read; a different oid under the name, a table dropped or renamed and replaced.

    Why the whole export is taken again rather than that table read anew: nothing was read
    yet (the check comes before the first row), so that costs one new slot and export, and
    the result is exact. A fresh read of just that table would see changes the stream also
    sends from the consistent point on, and under the old column types."""
    if not tables:
        return
    rows = conn.execute(
        "WITH RECURSIVE rels(nsp, rel, oid, root) AS ("
        " SELECT n.nspname, c.relname, c.oid, true FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " JOIN unnest(%s::text[], %s::text[]) AS t(nsp, rel) ON n.nspname = t.nsp AND c.relname = t.rel"
        " UNION ALL"
        " SELECT rels.nsp, rels.rel, i.inhrelid, false FROM rels JOIN pg_class p ON p.oid = rels.oid AND p.relkind = 'p'"
        " JOIN pg_inherits i ON i.inhparent = rels.oid)"
        " SELECT DISTINCT rels.nsp, rels.rel FROM rels JOIN pg_class c ON c.oid = rels.oid"
        " WHERE (rels.root AND to_regclass(format('%%I.%%I', rels.nsp, rels.rel)) IS DISTINCT FROM rels.oid)"
        " OR (c.relkind <> 'p' AND c.relfilenode IS DISTINCT FROM pg_relation_filenode(c.oid))",
        ([t[0] for t in tables], [t[1] for t in tables]),
    ).fetchall()
    if rows:
        names = sorted(qualify_table(str(r[0]), str(r[1])) for r in rows)
        log.warning(
            "tables to snapshot were rewritten (TRUNCATE, ALTER TABLE … TYPE, VACUUM FULL, CLUSTER) or replaced after "
            "the snapshot's consistent point, which cannot read them: taking the snapshot again",
            extra={"tables": names},
        )
        raise SnapshotOutdated(f"tables rewritten or replaced after the snapshot's consistent point: {', '.join(names)}")


class _Export:
    """A snapshot to read from: the new slot's exported one, or (existing slot, ``always``) one
    exported from a normal connection. Held open until the reading connections imported it
    and finished."""

    def __init__(self, dsn: str, name: str, consistent_point: int, holder: Any, replay_from: int | None = None) -> None:
        self.dsn = dsn
        self.name = name
        self.consistent_point = consistent_point
        self.replay_from = replay_from  # an existing slot's confirmed position: streaming starts there
        self._holder = holder  # the connection whose next command would end the export

    @classmethod
    def open(cls, cfg: ProducerConfig, existing_slot: bool) -> _Export:
        if existing_slot:
            conn = psycopg.connect(cfg.pg_dsn, autocommit=True, application_name="walbus-snapshot-export", options=session_options(cfg.pg_dsn))
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            row = conn.execute(
                "SELECT pg_export_snapshot(), (pg_current_wal_insert_lsn() - '0/0')::int8, "
                "(SELECT (confirmed_flush_lsn - '0/0')::int8 FROM pg_replication_slots WHERE slot_name = %s)",
                (cfg.slot_name,),
            ).fetchone()
            assert row is not None
            confirmed = int(str(row[2])) if row[2] is not None else int(str(row[1]))
            return cls(cfg.pg_dsn, str(row[0]), int(str(row[1])), conn, replay_from=confirmed)
        stream = ReplicationStream.connect(cfg.pg_dsn, application_name="walbus-snapshot")
        try:
            rows = stream.execute(f'CREATE_REPLICATION_SLOT "{cfg.slot_name}" LOGICAL {cfg.plugin} EXPORT_SNAPSHOT')
        except BaseException:
            stream.close()
            raise
        _slot, point, name, _plugin = rows[0]
        log.info("created replication slot with an exported snapshot", extra={"slot": cfg.slot_name, "consistent_point": str(point), "snapshot": str(name)})
        return cls(cfg.pg_dsn, str(name), int(Lsn.parse(str(point))), stream)

    def import_into(self, count: int) -> list[psycopg.Connection[tuple[object, ...]]]:
        conns = []
        try:
            for i in range(count):
                c = psycopg.connect(self.dsn, autocommit=True, application_name=f"walbus-snapshot-{i}", options=session_options(self.dsn))
                conns.append(c)
                c.execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                c.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(self.name)))
        except BaseException:
            for c in conns:
                c.close()
            raise
        return conns

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._holder.close()
