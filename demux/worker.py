"""One source partition's re-key loop: its source records in, per-table records into its transaction.

Life of a worker: :meth:`open` (the transaction fences the previous owner, then the
positions read the committed offset and the store is checked or rebuilt), then
:meth:`process` / :meth:`commit` in turns, then :meth:`close`. Any failure leaves the
worker unusable: the service closes it and opens a new one, which starts again from
the committed offset, so a failure can never produce a gap or a duplicate.
The parts: demux.transaction (the Kafka transaction), demux.positions (offsets).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from demux.config import DemuxConfig
from demux.dead_letter import dead_letter_record
from demux.ktable import read_ktable_raw
from demux.metrics import DemuxMetrics, TransactionCounts
from demux.positions import Positions, at_position, checkpoint_text
from demux.rekey import (
    FastRecord,
    OutRecord,
    Rekeyed,
    Rekeyer,
    RekeyError,
    StateView,
    single,
    unknown_row,
)
from demux.state import StateStore, store_file_name
from demux.topics import TopicInfo, TopicManager
from demux.transaction import PartitionTransaction
from walbus.aiokafka_shortcuts import NO_HEADERS, SHORTCUTS, SourceRecord
from walbus.contract import ChangeEvent, ContractError
from walbus.kafka import KafkaAdmin, partition_for, record_fits

log = logging.getLogger("walbus.demux")

# Records above this leave the fast path: the general one checks them against their
# topic's max.message.bytes (walbus creates its topics with DEFAULT_MAX_MESSAGE_BYTES).
FAST_RECORD_BYTES = 1_000_000
# Records re-keyed between two turns of the event loop. aiokafka fetches a partition
# again only once its buffer is drained (each getmany drains it: see
# demux.service.FETCH_BYTES), and a fetch needs a few turns of the loop to go out and
# ~16 to read a 4 MiB answer: with a turn every ~6 ms the next run arrives while this
# one is re-keyed, instead of after it (with 4 MiB fetches: +17% events/s measured).
YIELD_EVERY = 1000
# Work over this many keys or rows in one go (a truncate's tombstones, a table loaded into the
# store, the store's commit after them: seconds per million) runs in a thread, off the event
# loop: the consumer's heartbeats, the other partitions' transactions and the metrics need the
# loop. Inline, a truncate of 1M keys stalled it for 20 s: the broker evicted the member from
# the group (past --session-timeout-ms) and the partition was revoked in the middle of it.
OFF_LOOP_ITEMS = 10_000

# (what, table) already warned about: once per process, not once per partition or transaction.
_WARNED: set[tuple[str, str]] = set()




class PartitionWorker:
    def __init__(
        self,
        *,
        tp: TopicPartition,
        config: DemuxConfig,
        client_kwargs: dict[str, Any],
        rekeyer: Rekeyer,
        topics: TopicManager,
        admin: KafkaAdmin,
        metrics: DemuxMetrics,
    ) -> None:
        self.tp = tp
        self.config = config
        self.client_kwargs = client_kwargs
        self.rekeyer = rekeyer
        self.topics = topics
        self.admin = admin  # reads the committed offset with its metadata (the last position)
        self.metrics = metrics
        self.lock = asyncio.Lock()
        self.ready = False
        self.txn = PartitionTransaction(group=config.group, tp=tp, client_kwargs=client_kwargs,
                                        transaction_timeout_ms=config.transaction_timeout_ms, metrics=metrics)
        self.positions = Positions(config.group, tp)
        self.counts = TransactionCounts(metrics, tp.partition)
        self.store: StateStore | None = None
        # Partition counts of the output topics records were appended to (so usable).
        self._fast_parts: dict[str, int] = {}

    @property
    def next_offset(self) -> int | None:
        return self.positions.next_offset

    @property
    def store_path(self) -> Path:
        return Path(self.config.state_dir) / store_file_name(self.config.group, self.tp.topic, self.tp.partition)

    # -- opening ---------------------------------------------------------------

    async def open(self, consumer: AIOKafkaConsumer) -> None:
        """Fence the previous owner, then position the consumer and the store on the committed offset."""
        await self.txn.start()
        # Only now is the committed offset final (the previous owner's last commit,
        # if any, is complete; its open transaction, if any, is aborted).
        committed = await self.positions.start(consumer, await self.admin.committed(self.config.group, self.tp))
        resumed = self.positions.resumed_at()
        if resumed is not None:
            self.rekeyer.resumed_inside(resumed)
        self.store = StateStore(self.store_path)
        expected = checkpoint_text(self.config.group, self.tp, committed)
        have = self.store.checkpoint()
        if have != expected:
            # Crash between the Kafka commit and the store commit, a lost state
            # directory, or offsets moved by hand: start empty, tables are loaded
            # again from their compacted topics when first needed.
            self.store.reset(expected)
            self.metrics.state_resets.inc()
            log.info(
                "last-row store reset; tables will be reloaded from their topics when needed",
                extra={"partition": self.tp.partition, "reason": "missing" if have is None else "stale"},
            )
        self.ready = True
        log.info(
            "partition opened",
            extra={"partition": self.tp.partition, "committed_offset": committed, "transactional_id": self.txn.txn_id,
                   "last_position": None if self.positions.last_key is None else self.positions.last_key.decode(),
                   "looking_back": self.positions.probing},
        )

    async def _commit_boundary(self) -> None:
        """Commit the open transaction now, so that the topics show everything done so far."""
        if self.txn.is_open:
            await self.commit()

    async def _read_table(self, table: str) -> dict[bytes, bytes]:
        """The table's committed rows from its topic, including our own last commit."""
        topic = self.rekeyer.topic_for(table)
        # Our commit markers reach the partitions shortly after commit_transaction
        # returns; wait until the last stable offset covers what we wrote.
        return await read_ktable_raw(client_kwargs=self.client_kwargs, topic=topic,
                                     min_end_offsets=self.txn.written_to(topic))

    async def _track(self, table: str) -> None:
        assert self.store is not None
        await self._commit_boundary()
        started = time.monotonic()
        rows = await self._read_table(table)
        count = await asyncio.to_thread(self.store.track, table, rows.items())  # see OFF_LOOP_ITEMS
        self.metrics.state_table_loads.labels(table).inc()
        log.info(
            "table loaded into the last-row store from its topic",
            extra={"partition": self.tp.partition, "table": table, "rows": count,
                   "seconds": round(time.monotonic() - started, 3)},
        )

    # -- processing --------------------------------------------------------------

    async def process(self, messages: list[SourceRecord]) -> None:
        """Re-key a run of source records into the open transaction."""
        assert self.store is not None and self.ready
        if self.positions.probing:
            resumed = self.positions.resumed_in(messages)
            if resumed is not None:
                self.rekeyer.resumed_inside(resumed)
        await self.txn.begin()
        i, end = 0, len(messages)
        while i < end:
            stop = min(end, i + YIELD_EVERY)
            i, hit = self._fast_run(messages, i, stop)
            if i < stop:
                await self._process_one(messages[i], hit)
                i += 1
            else:
                await asyncio.sleep(0)  # let the next fetch go out and come in: see YIELD_EVERY

    def _fast_run(self, messages: list[SourceRecord], i: int, end: int) -> tuple[int, FastRecord | None]:
        """Process ``messages[i:end]`` while they take the fast path; the first that does not, and its fast result.

        The fast path: one record into a batch that is open, of a topic known to be
        usable, of a table whose rows need no store (or are in it). Anything else
        (the first record of a table or of a batch, a full batch, a big row, rare
        events, bad input) is left to :meth:`_process_one`, with its fast result
        when it had one (so it is not parsed again) and the position checks below
        already done. Everything per record is a local here: this loop is most of
        the demux' own CPU time. A run of one table reuses the batch and store
        decision of the record before it.
        """
        store = self.store
        assert store is not None
        tracked, pending, indexed = store.tracked, store.pending, store.indexed
        counts, positions = self.counts, self.positions
        produced, tombstones = counts.produced, counts.tombstones
        fast, fast_parts, batches = self.rekeyer.fast, self._fast_parts, self.txn.batches
        skip_replayed = self.config.skip_replayed
        next_offset = positions.next_offset
        # Below it: already processed (the look-back after open, or fetched before a seek).
        skip_below = -1 if next_offset is None else next_offset
        last_key = positions.last_key
        done = replayed = 0
        direct, no_headers = SHORTCUTS.direct_append, NO_HEADERS
        # The last single-partition topic appended to: its batch and whether its table is kept.
        cur_topic: str | None = None
        cur_batch: Any = None
        cur_keep = False
        hit: FastRecord | None = None
        try:
            while i < end:
                m = messages[i]
                offset = m.offset
                key, value = m.key, m.value
                if offset < skip_below:
                    # Only learn the highest position seen, from events at their own position.
                    if key is not None and (last_key is None or key > last_key) and at_position(key, value):
                        last_key = key
                    i += 1
                    continue
                # Positions move only on events whose key is their own (commit_lsn, seq) in the
                # contract's fixed-width form (fast() checks it), where byte order is position order.
                if key is None or value is None:
                    return i, None
                hit = fast(value, key)
                if hit is None:
                    return i, None
                if skip_replayed and last_key is not None and key <= last_key:
                    # The producer is at-least-once: after its restart it sends again the
                    # transactions after its last confirmed commit. Same position, same event.
                    replayed += 1
                    done += 1
                    next_offset = offset + 1
                    i += 1
                    continue
                table, topic, out_key, out_value, needs_state = hit
                if out_value is not None and len(out_value) > FAST_RECORD_BYTES:
                    return i, hit
                if topic is cur_topic:  # one table per topic: same batch, same store decision
                    batch, keep = cur_batch, cur_keep
                else:
                    parts = fast_parts.get(topic)
                    if parts is None or (needs_state and table not in tracked) or table in indexed:
                        return i, hit  # (indexed: the store must see its changes, StateStore.find)
                    batch = batches.get((topic, 0 if parts == 1 else partition_for(out_key, parts)))
                    if batch is None:
                        return i, hit
                    keep = table in tracked
                    if parts == 1:  # batches and tracked tables change only outside this loop
                        cur_topic, cur_batch, cur_keep = topic, batch, keep
                if direct:  # aiokafka's Cython builder (walbus.aiokafka_shortcuts.OutputBatch)
                    rel = batch.count
                    if batch.records.append(rel, None, out_key, out_value, no_headers) is None:
                        return i, hit  # full
                    batch.count = rel + 1
                elif not batch.append(out_key, out_value):
                    return i, hit
                if out_value is None:
                    tombstones[table] = tombstones.get(table, 0) + 1
                else:
                    produced[table] = produced.get(table, 0) + 1
                if keep:
                    pending[(table, out_key)] = out_value
                last_key = key
                next_offset = offset + 1
                done += 1
                i += 1
            return i, None
        finally:
            positions.next_offset = next_offset
            positions.last_key = last_key
            counts.records += done
            counts.replayed += replayed

    async def _process_one(self, m: SourceRecord, hit: FastRecord | None) -> None:
        """The general path for one record. Whatever makes its output impossible sends it to the DLQ.

        ``hit``: the record's fast result, when it had one; otherwise it is decoded here, once.
        """
        offset, key, value = m.offset, m.key, m.value
        failure: tuple[str, str] | None = None  # (error, dead-letter reason)
        event: ChangeEvent | None = None
        try:
            if hit is not None:
                out = single(hit)
            else:
                event = self.rekeyer.decode_record(key, value)
                out = await self._rekey(event, self.store)  # type: ignore[arg-type]
        except ContractError as e:
            # Not an event, or not at the position its key says: it moves no position.
            await self._dead_letter(m, str(e), "contract")
            self._advance(offset)
            return
        except RekeyError as e:  # a valid event at its position, that cannot be re-keyed
            out, failure = Rekeyed(), (str(e), "contract")
        except Exception as e:  # a bug must not stall the stream on one record
            log.exception("re-keying failed", extra={"partition": self.tp.partition, "offset": offset})
            await self._dead_letter(m, f"internal error: {type(e).__name__}: {e}", "internal")
            self._advance(offset)
            return
        assert key is not None and value is not None  # the fast path and decode_record checked them
        if self.config.skip_replayed and self.positions.is_replay(key):
            self.counts.replayed += 1  # see _fast_run
            self._advance(offset)
            return
        if failure is None:
            failure = await self._produce(out, event, offset)
        if failure is not None:
            await self._dead_letter(m, *failure)
        # Only now: _produce may commit the transaction so far, whose offset's metadata must not
        # claim this event yet (a failure after that commit would then skip it as a replay).
        self.positions.last_key = key
        self._advance(offset)

    async def _produce(self, out: Rekeyed, event: ChangeEvent | None, offset: int) -> tuple[str, str] | None:
        """Write one event's output; (error, reason) when it cannot be written (then nothing is)."""
        store = self.store
        assert store is not None
        checked = bool(out.records)
        if checked and (unusable := await self._unusable_topic(out)) is not None:
            return unusable, "topic"
        try:
            if out.needs_state and out.table not in store.tracked:
                out = await self._rekey_with_state(event, out)
        except (ContractError, RekeyError) as e:
            return str(e), "contract"
        except (KafkaError, OSError, TimeoutError):
            raise  # transient (reading the table's topic): the worker reopens and tries again
        except Exception as e:
            log.exception("re-keying failed", extra={"partition": self.tp.partition, "offset": offset})
            return f"internal error: {type(e).__name__}: {e}", "internal"
        # Records only the table's state could make (a truncate's tombstones for keys read
        # from the topic): their topic may be new to this process (a restart).
        if out.records and not checked and (unusable := await self._unusable_topic(out)) is not None:
            return unusable, "topic"
        table, records = out.table, out.records
        counts = self.counts
        if out.no_pk:
            counts.other[("no_pk", table)] += 1
            self._warn_once("no_pk", table, offset)
        error = await self._too_large_off_loop(records)
        if error is not None and await self.topics.refresh({rec.topic for rec in records}):
            error = self._too_large(records)  # with the limits as they are now
        if error is not None:
            self._unwritten(out, error, "size")
            return error, "size"
        produced, tombstones = counts.produced, counts.tombstones
        # One event's records beyond a transaction's size (a truncate's tombstones, one per key)
        # go out in transactions of txn_max_records each, with the source offset still at this
        # event, so that a crash redoes it (tombstones again: idempotent). In one transaction a
        # large table's truncate outlived the transaction timeout, the broker aborted it, and
        # the worker reopened on it and failed the same way, for good.
        part = self.config.txn_max_records
        for n, rec in enumerate(records, 1):
            await self._append(rec)
            if rec.value is None:
                tombstones[table] = tombstones.get(table, 0) + 1
            else:
                produced[table] = produced.get(table, 0) + 1
            if n % part == 0 and n < len(records):
                await self.commit()
                await self.txn.begin()
        if len(out.changes) > OFF_LOOP_ITEMS:
            await asyncio.to_thread(store.apply, out.changes)
        elif out.changes:
            store.apply(out.changes)
        if out.unfilled:
            counts.other[("unfilled", table)] += len(out.unfilled)
            self._warn_once("unfilled", table, offset, out.unfilled)
        return None

    async def _unusable_topic(self, out: Rekeyed) -> str | None:
        """Why the event's records cannot go to their topic (then said so: :meth:`_unwritten`)."""
        info = await self._topic_of(out)
        if info.unusable is not None:
            self._unwritten(out, info.unusable, "topic")
        return info.unusable

    async def _topic_of(self, out: Rekeyed) -> TopicInfo:
        """The topic of the event's records (all its table's); a colliding name is traded for the hashed one."""
        first = out.records[0]
        topic, info = await self._table_topic(out.table, first.topic, compact=first.compact)
        if topic != first.topic:
            for rec in out.records:
                rec.topic = topic
        return info

    async def _table_topic(self, table: str, topic: str, *, compact: bool) -> tuple[str, TopicInfo]:
        """The table's topic, ensured: ``topic``, or its hashed name when ``topic`` collides
        with an existing topic's (the rekeyer then names the hashed one for good)."""
        info = await self.topics.ensure(topic, compact=compact)
        if not info.collides:
            return topic, info
        hashed = self.rekeyer.use_hashed_topic(table)
        if ("hashed", table) not in _WARNED:
            _WARNED.add(("hashed", table))
            log.info("table's topic name collides with an existing topic's (Kafka: '.' = '_'); "
                     "it uses its hash-suffixed name",
                     extra={"table": table, "topic": hashed, "colliding_topic": topic})
        return hashed, await self.topics.ensure(hashed, compact=compact)

    async def _too_large_off_loop(self, records: list[OutRecord]) -> str | None:
        if len(records) > OFF_LOOP_ITEMS:  # a truncate's tombstones: see OFF_LOOP_ITEMS
            return await asyncio.to_thread(self._too_large, records)
        return self._too_large(records)

    def _too_large(self, records: list[OutRecord]) -> str | None:
        """Why one of the records exceeds its topic's max.message.bytes (None: all fit)."""
        for rec in records:
            info = self.topics.cached(rec.topic)
            assert info is not None
            if not record_fits(info.max_bytes, rec.key, rec.value):
                size = len(rec.key or b"") + len(rec.value or b"")
                return (f"output record of {size} bytes does not fit topic {rec.topic} "
                        f"(max.message.bytes={info.max_bytes})")
        return None

    def _unwritten(self, out: Rekeyed, error: str, reason: str) -> None:
        """An event's output cannot be written: say so loudly, and keep the store equal to the topic.

        The topic keeps the keys' old rows, which are no longer the table's: the store
        marks them unknown, so that a later update that leaves a TOAST value unchanged
        goes to the DLQ too instead of publishing the old value as current.
        """
        assert self.store is not None
        table = out.table
        self.store.apply((t, k, unknown_row(error, v)) for t, k, v in out.changes)
        self.counts.other[("unwritten", table, reason)] += 1
        log.error(
            "event's output cannot be written; the source record goes to the dead-letter topic",
            extra={"partition": self.tp.partition, "table": table, "reason": reason, "error": error[:500],
                   "keys": [k[:200].decode(errors="replace") for _, k, _ in out.changes[:5]]},
        )

    async def _rekey_with_state(self, event: ChangeEvent | None, out: Rekeyed) -> Rekeyed:
        """Re-key again once the store can answer for the table (rare: once per table).

        ``event`` None: a fast result, complete without the store (it only has to keep the table).
        """
        assert self.store is not None
        if out.truncate:
            assert event is not None  # truncates never take the fast path
            # Keys of a table we do not keep: read them from its topic, once. Which topic is
            # that: after a restart its hashed name is not known until asked (a truncate first
            # read the plain name's nothing and tombstoned no row).
            await self._commit_boundary()
            await self._table_topic(out.table, self.rekeyer.topic_for(out.table), compact=True)
            keys = await self._read_table(out.table)
            out = await self._rekey(event, _KeysView(self.store, out.table, keys.keys()))
        else:
            await self._track(out.table)
            if event is not None:
                out = await self._rekey(event, self.store)
        await self.txn.begin()
        return out

    async def _rekey(self, event: ChangeEvent, state: StateView) -> Rekeyed:
        """The event re-keyed; in a thread (see OFF_LOOP_ITEMS) when that is work over every row
        of its table: a truncate (a tombstone for each key), or the first identity without the
        key (REPLICA IDENTITY USING INDEX), which indexes the table's rows by its columns
        (StateStore.find: 2.3 CPU seconds for 200,000 rows, in one step of the loop before)."""
        if event.operation == "truncate":
            return await asyncio.to_thread(self.rekeyer.rekey, event, state)
        store, identity = self.store, event.identity
        if (identity is not None and store is not None and event.table in store.tracked
                and any(c not in identity.columns for c in event.pk)
                and not store.has_finder(event.table, tuple(identity.columns))):
            # Built here, found by the re-keying below (which touches state shared by partitions).
            await asyncio.to_thread(store.find, event.table, identity.as_dict())
        return self.rekeyer.rekey(event, state)

    def _warn_once(self, what: str, table: str, offset: int, columns: list[str] | None = None) -> None:
        if (what, table) in _WARNED:
            return
        _WARNED.add((what, table))
        if what == "no_pk":
            log.warning(
                "table has no primary key: its rows go to a cleanup.policy=delete topic with null keys",
                extra={"table": table, "topic": self.rekeyer.topic_for(table)},
            )
        else:
            log.warning(
                "unchanged TOAST value unknown (row never seen by the demux); column left out of the row",
                extra={"table": table, "columns": columns, "offset": offset},
            )

    def _advance(self, offset: int) -> None:
        self.positions.advance(offset)
        self.counts.records += 1

    async def _append(self, rec: OutRecord, headers: list[tuple[str, bytes]] | None = None) -> None:
        """Into its partition's open batch; the topic is known to be usable and the record to fit it."""
        info = self.topics.cached(rec.topic)
        assert info is not None and info.unusable is None
        if rec.key is None:
            # Keyless rows of one table stay in one partition, in source order.
            part = self.tp.partition % info.partitions
        else:
            part = partition_for(rec.key, info.partitions)
            if rec.compact:
                self._fast_parts[rec.topic] = info.partitions
        await self.txn.append((rec.topic, part), info.max_bytes, rec.key, rec.value, headers or NO_HEADERS)

    async def send_batches(self) -> None:
        await self.txn.send_batches()

    async def _dead_letter(self, m: SourceRecord, error: str, reason: str) -> None:
        """The source record, whole, to the DLQ; cut (and said so) only when the DLQ topic cannot take it."""
        dlq = self.config.dlq
        info = await self.topics.ensure(dlq, compact=False)
        if info.unusable is not None:  # nowhere to put the record: fail and retry, never skip it
            raise RuntimeError(f"dead-letter topic unusable: {info.unusable}")
        key, value, headers = dead_letter_record(self.tp, m.offset, m.key, m.value, error, info.max_bytes)
        await self._append(OutRecord(dlq, key, value, "", compact=False), headers)
        self.counts.other[("dead_letter", reason)] += 1
        log.warning(
            "record sent to the dead-letter topic",
            extra={"partition": self.tp.partition, "offset": m.offset, "error": error[:500], "dlq": dlq},
        )

    # -- committing --------------------------------------------------------------

    def due(self, now: float) -> bool:
        if not self.txn.is_open:
            return False
        return self.counts.records >= self.config.txn_max_records or self.time_left(now) <= 0

    def time_left(self, now: float) -> float:
        """Seconds until the open transaction is due (inf without one)."""
        return self.txn.time_left(now, self.config.txn_max_ms)

    async def commit(self) -> None:
        """Commit the transaction with the consumed offset; then the store follows."""
        store = self.store
        assert store is not None
        if not self.txn.is_open:
            return
        await self.txn.commit(self.positions.next_offset, self.positions.metadata())
        # Kafka first, the store second: the store may lag behind (then it is rebuilt
        # on the next open) but never run ahead of what readers can see.
        if len(store.pending) > OFF_LOOP_ITEMS:  # a truncate's deletes: see OFF_LOOP_ITEMS
            await asyncio.to_thread(store.commit, self.positions.checkpoint())
        else:
            store.commit(self.positions.checkpoint())
        self.counts.flush()

    # -- closing -----------------------------------------------------------------

    async def close(self, *, commit: bool) -> None:
        """Commit (graceful) or abort the open transaction, then release everything."""
        self.ready = False
        store = self.store
        try:
            if self.txn.producer is not None and self.txn.is_open:
                if commit:
                    try:
                        await self.commit()
                    except Exception as e:
                        log.warning("commit on close failed; the transaction is aborted",
                                    extra={"partition": self.tp.partition, "error": repr(e)})
                        await self.txn.abort()
                else:
                    await self.txn.abort()
        finally:
            self.counts.clear()
            if store is not None:
                store.rollback()
            await self.txn.stop()
            if store is not None:
                store.close()
            self.store = None


class _KeysView:
    """The store, except that one untracked table's keys come from its topic (truncate)."""

    def __init__(self, store: StateStore, table: str, keys: Iterable[bytes]) -> None:
        self._store, self._table, self._keys = store, table, keys

    def get(self, table: str, key: bytes) -> dict[str, Any] | None:
        return self._store.get(table, key)

    def keys(self, table: str) -> Iterable[bytes]:
        return self._keys if table == self._table else self._store.keys(table)

    def find(self, table: str, identity: dict[str, Any]) -> bytes | None:
        return self._store.find(table, identity)
