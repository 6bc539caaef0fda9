"""One source partition: its transactional producer, its last-row store, its open transaction.

See demux.service for why there is one transactional producer per source partition.

Life of a worker: :meth:`open` (fence the previous owner, read the committed
offset, check or rebuild the store, seek), then :meth:`process` /
:meth:`commit` in turns, then :meth:`close`. Any failure leaves the worker
unusable: the service closes it and opens a new one, which starts again from
the committed offset, so a failure can never produce a gap or a duplicate.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError

from demux.batches import DIRECT_APPEND, NO_HEADERS, new_batch
from demux.config import DemuxConfig
from demux.fetch import SourceRecord
from demux.ktable import read_ktable_raw
from demux.metrics import DemuxMetrics
from demux.rekey import OutRecord, Rekeyed, Rekeyer, RekeyError, unknown_row
from demux.state import StateStore
from demux.topics import TopicInfo, TopicManager
from walbus.contract import ContractError, check_key, decode_event
from walbus.kafka import (
    DEFAULT_MAX_MESSAGE_BYTES,
    RECORD_OVERHEAD_BYTES,
    partition_for,
    record_fits,
)

log = logging.getLogger("walbus.demux")

# A record batch holds at most this much (less when its topic's max.message.bytes is
# smaller); a larger record, if its topic takes it, gets a batch of its own.
BATCH_BYTES = 1_000_000
# Records above this leave the fast path: the general one checks them against their
# topic's max.message.bytes (walbus creates its topics with DEFAULT_MAX_MESSAGE_BYTES).
FAST_RECORD_BYTES = 1_000_000
# Source records read again before the committed offset on open, to learn the last position.
LOOK_BACK = 1000
# Records re-keyed between two turns of the event loop. aiokafka fetches a partition
# again only once its buffer is drained (each getmany drains it: see
# demux.service.FETCH_BYTES), and a fetch needs a few turns of the loop to go out and
# ~16 to read a 4 MiB answer: with a turn every ~6 ms the next run arrives while this
# one is re-keyed, instead of after it (with 4 MiB fetches: +17% events/s measured).
YIELD_EVERY = 1000

# (what, table) already warned about: once per process, not once per partition or transaction.
_WARNED: set[tuple[str, str]] = set()


def transactional_id(group: str, topic: str, partition: int) -> str:
    """Stable per source partition: whoever processes the partition next fences the last owner."""
    return f"{group}.{topic}.{partition}"


def checkpoint_text(group: str, tp: TopicPartition, offset: int | None) -> str:
    return f"{group}|{tp.topic}|{tp.partition}|{-1 if offset is None else offset}"


class PartitionWorker:
    def __init__(
        self,
        *,
        tp: TopicPartition,
        config: DemuxConfig,
        client_kwargs: dict[str, Any],
        rekeyer: Rekeyer,
        topics: TopicManager,
        metrics: DemuxMetrics,
    ) -> None:
        self.tp = tp
        self.config = config
        self.group = config.group
        self.client_kwargs = client_kwargs
        self.rekeyer = rekeyer
        self.topics = topics
        self.metrics = metrics
        self.lock = asyncio.Lock()
        self.ready = False
        self.producer: AIOKafkaProducer | None = None
        self.store: StateStore | None = None
        self.next_offset: int | None = None
        self.last_key: bytes | None = None  # highest source event key processed
        self._replayed = 0
        self.in_txn = False
        self.txn_started = 0.0
        self.txn_records = 0
        self._batches: dict[tuple[str, int], Any] = {}
        # Partition counts of the output topics records were appended to (so usable).
        self._fast_parts: dict[str, int] = {}
        self._futures: list[tuple[asyncio.Future[Any], int]] = []
        # (topic, partition) -> offset after the last record we committed there.
        self._written: dict[tuple[str, int], int] = {}
        self._stats: Counter[tuple[str, ...]] = Counter()
        # Per-table counts of the open transaction (plain dicts: cheapest per record).
        self._produced: dict[str, int] = {}
        self._tombstones: dict[str, int] = {}
        self._partition_label = str(tp.partition)
        # Bumped when a transaction ends: acknowledgements of an ended one no longer count.
        self._txn_serial = 0
        self._open_records = metrics.open_transaction_records.labels(self._partition_label)

    @property
    def txn_id(self) -> str:
        return transactional_id(self.group, self.tp.topic, self.tp.partition)

    @property
    def store_path(self) -> Path:
        safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in f"{self.group}__{self.tp.topic}")
        return Path(self.config.state_dir) / f"{safe}-{self.tp.partition}.sqlite"

    # -- opening ---------------------------------------------------------------

    async def open(self, consumer: AIOKafkaConsumer) -> None:
        """Fence the previous owner, then position the consumer and the store on the committed offset."""
        producer = AIOKafkaProducer(
            **self.client_kwargs,
            transactional_id=self.txn_id,
            transaction_timeout_ms=self.config.transaction_timeout_ms,
            max_batch_size=BATCH_BYTES,
            # Only send() checks it (the demux sends batches); the limit of walbus's topics.
            max_request_size=DEFAULT_MAX_MESSAGE_BYTES,
            linger_ms=0,
            request_timeout_ms=30000,
        )
        self.producer = producer
        # start() runs InitProducerId: the broker bumps the epoch for this transactional
        # id, aborts any transaction a previous owner left open and, if that one was
        # already committing, finishes it before answering. After this line no
        # zombie can commit output or offsets for this partition any more.
        await producer.start()
        # Only now is the committed offset final (the previous owner's last commit,
        # if any, is complete; its open transaction, if any, is aborted).
        committed = await consumer.committed(self.tp)
        self.store = StateStore(self.store_path)
        expected = checkpoint_text(self.group, self.tp, committed)
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
        if committed is None:
            await consumer.seek_to_beginning(self.tp)
        else:
            # Start a little before the committed offset: those records are skipped
            # but tell the highest event position already processed (replay detection).
            consumer.seek(self.tp, max(0, committed - LOOK_BACK))
        self.next_offset = committed
        self.last_key = None
        self.ready = True
        log.info(
            "partition opened",
            extra={"partition": self.tp.partition, "committed_offset": committed, "transactional_id": self.txn_id},
        )

    async def _commit_boundary(self) -> None:
        """Commit the open transaction now, so that the topics show everything done so far."""
        if self.in_txn:
            await self.commit()

    async def _read_table(self, table: str) -> dict[bytes, bytes]:
        """The table's committed rows from its topic, including our own last commit."""
        topic = self.rekeyer.topic_for(table)
        # Our commit markers reach the partitions shortly after commit_transaction
        # returns; wait until the last stable offset covers what we wrote.
        min_end = {p: off for (t, p), off in self._written.items() if t == topic}
        return await read_ktable_raw(client_kwargs=self.client_kwargs, topic=topic, min_end_offsets=min_end)

    async def _track(self, table: str) -> None:
        assert self.store is not None
        await self._commit_boundary()
        started = time.monotonic()
        rows = await self._read_table(table)
        count = self.store.track(table, rows.items())
        self.metrics.state_table_loads.labels(table).inc()
        log.info(
            "table loaded into the last-row store from its topic",
            extra={"partition": self.tp.partition, "table": table, "rows": count,
                   "seconds": round(time.monotonic() - started, 3)},
        )

    # -- processing --------------------------------------------------------------

    async def process(self, messages: list[SourceRecord]) -> None:
        """Re-key a run of source records into the open transaction."""
        assert self.producer is not None and self.store is not None and self.ready
        await self._ensure_txn()
        i, end = 0, len(messages)
        while i < end:
            stop = min(end, i + YIELD_EVERY)
            i = self._fast_run(messages, i, stop)
            if i < stop:
                await self._process_one(messages[i])
                i += 1
            else:
                await asyncio.sleep(0)  # let the next fetch go out and come in: see YIELD_EVERY

    def _fast_run(self, messages: list[SourceRecord], i: int, end: int) -> int:
        """Process ``messages[i:end]`` while they take the fast path; the index of the first that does not.

        The fast path: one record into a batch that is open, of a topic known to be
        usable, of a table whose rows need no store (or are in it). Anything else
        (the first record of a table or of a batch, a full batch, a big row, rare
        events, bad input) is left to :meth:`_process_one`, which gets it with
        the position checks below already done. Everything per record is a local
        here: this loop is most of the demux' own CPU time. Records go straight into
        aiokafka's Cython batch builder (see demux.batches), and a run of one table
        reuses the batch and store decision of the record before it.
        """
        store = self.store
        assert store is not None
        tracked, pending = store.tracked, store.pending
        produced, tombstones = self._produced, self._tombstones
        fast, fast_parts, batches = self.rekeyer.fast, self._fast_parts, self._batches
        skip_replayed = self.config.skip_replayed
        next_offset = self.next_offset
        # Below it: already processed (the look-back after open, or fetched before a seek).
        skip_below = -1 if next_offset is None else next_offset
        last_key = self.last_key
        done = replayed = 0
        direct, no_headers = DIRECT_APPEND, NO_HEADERS
        # The last single-partition topic appended to: its batch and whether its table is kept.
        cur_topic: str | None = None
        cur_batch: Any = None
        cur_keep = False
        try:
            while i < end:
                m = messages[i]
                offset = m.offset
                key, value = m.key, m.value
                if offset < skip_below:
                    # Only learn the highest position seen, from events at their own position.
                    if key is not None and (last_key is None or key > last_key) and _at_position(key, value):
                        last_key = key
                    i += 1
                    continue
                # Positions move only on events whose key is their own (commit_lsn, seq) in the
                # contract's fixed-width form (fast() checks it), where byte order is position order.
                if key is None or value is None:
                    return i
                hit = fast(value, key)
                if hit is None:
                    return i
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
                    return i
                if topic is cur_topic:  # one table per topic: same batch, same store decision
                    batch, keep = cur_batch, cur_keep
                else:
                    parts = fast_parts.get(topic)
                    if parts is None or (needs_state and table not in tracked):
                        return i
                    batch = batches.get((topic, 0 if parts == 1 else partition_for(out_key, parts)))
                    if batch is None:
                        return i
                    keep = table in tracked
                    if parts == 1:  # batches and tracked tables change only outside this loop
                        cur_topic, cur_batch, cur_keep = topic, batch, keep
                if direct:
                    rel = batch._relative_offset
                    if batch._builder.append(rel, None, out_key, out_value, no_headers) is None:
                        return i  # full
                    batch._relative_offset = rel + 1
                elif batch.append(timestamp=None, key=out_key, value=out_value) is None:
                    return i
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
            return i
        finally:
            self.next_offset = next_offset
            self.last_key = last_key
            self.txn_records += done
            self._replayed += replayed

    async def _process_one(self, m: SourceRecord) -> None:
        """The general path for one record. Whatever makes its output impossible sends it to the DLQ."""
        offset, key, value = m.offset, m.key, m.value
        failure: tuple[str, str] | None = None  # (error, dead-letter reason)
        try:
            if value is None:
                raise ContractError("record has no value")
            out = self.rekeyer.rekey_record(key, value, self.store)  # type: ignore[arg-type]
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
        assert key is not None and value is not None  # rekey_record checked them
        if self.config.skip_replayed and self.last_key is not None and key <= self.last_key:
            self._replayed += 1  # see _fast_run
            self._advance(offset)
            return
        self.last_key = key
        if failure is None:
            failure = await self._produce(out, value, offset)
        if failure is not None:
            await self._dead_letter(m, *failure)
        self._advance(offset)

    async def _produce(self, out: Rekeyed, value: bytes, offset: int) -> tuple[str, str] | None:
        """Write one event's output; (error, reason) when it cannot be written (then nothing is)."""
        store = self.store
        assert store is not None
        if out.records:
            info = await self._topic_of(out)
            if info.unusable is not None:
                self._unwritten(out, info.unusable, "topic")
                return info.unusable, "topic"
        try:
            if out.needs_state and out.table not in store.tracked:
                out = await self._rekey_with_state(value, out)
        except (ContractError, RekeyError) as e:
            return str(e), "contract"
        except (KafkaError, OSError, TimeoutError):
            raise  # transient (reading the table's topic): the worker reopens and tries again
        except Exception as e:
            log.exception("re-keying failed", extra={"partition": self.tp.partition, "offset": offset})
            return f"internal error: {type(e).__name__}: {e}", "internal"
        table, records = out.table, out.records
        if out.no_pk:
            self._stats[("no_pk", table)] += 1
            self._warn_once("no_pk", table, offset)
        error = self._too_large(records)
        if error is not None:
            self._unwritten(out, error, "size")
            return error, "size"
        produced, tombstones = self._produced, self._tombstones
        for rec in records:
            await self._append(rec)
            if rec.value is None:
                tombstones[table] = tombstones.get(table, 0) + 1
            else:
                produced[table] = produced.get(table, 0) + 1
        if out.changes:
            store.apply(out.changes)
        if out.unfilled:
            self._stats[("unfilled", table)] += len(out.unfilled)
            self._warn_once("unfilled", table, offset, out.unfilled)
        return None

    async def _topic_of(self, out: Rekeyed) -> TopicInfo:
        """The topic of the event's records (all its table's); a colliding name is traded for the hashed one."""
        first = out.records[0]
        info = await self.topics.ensure(first.topic, compact=first.compact)
        if info.collides:
            topic = self.rekeyer.use_hashed_topic(out.table)
            for rec in out.records:
                rec.topic = topic
            if ("hashed", out.table) not in _WARNED:
                _WARNED.add(("hashed", out.table))
                log.info("table's topic name collides with an existing topic's (Kafka: '.' = '_'); "
                         "it uses its hash-suffixed name",
                         extra={"table": out.table, "topic": topic, "colliding_topic": first.topic})
            info = await self.topics.ensure(topic, compact=first.compact)
        return info

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
        self.store.apply((t, k, unknown_row(error)) for t, k, _ in out.changes)
        self._stats[("unwritten", table, reason)] += 1
        log.error(
            "event's output cannot be written; the source record goes to the dead-letter topic",
            extra={"partition": self.tp.partition, "table": table, "reason": reason, "error": error[:500],
                   "keys": [k[:200].decode(errors="replace") for _, k, _ in out.changes[:5]]},
        )

    async def _ensure_txn(self) -> None:
        if not self.in_txn:
            assert self.producer is not None
            await self.producer.begin_transaction()
            self.in_txn = True
            self.txn_started = time.monotonic()

    async def _rekey_with_state(self, value: bytes, out: Rekeyed) -> Rekeyed:
        """Re-key again once the store can answer for the table (rare: once per table)."""
        assert self.store is not None
        if out.truncate:
            # Keys of a table we do not keep: read them from its topic, once.
            await self._commit_boundary()
            keys = await self._read_table(out.table)
            out = self.rekeyer.rekey_value(value, _KeysView(self.store, out.table, set(keys)))
        else:
            await self._track(out.table)
            out = self.rekeyer.rekey_value(value, self.store)
        await self._ensure_txn()
        return out

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
        self.next_offset = offset + 1
        self.txn_records += 1

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
        slot = (rec.topic, part)
        batch = self._batches.get(slot)
        if batch is None:
            batch = self._batches[slot] = _new_batch(info)
        if batch.append(timestamp=None, key=rec.key, value=rec.value, headers=headers or []) is None:
            await self._send(slot, batch)
            batch = self._batches[slot] = _new_batch(info)
            # An empty batch takes any record (the topic's limit is checked before).
            batch.append(timestamp=None, key=rec.key, value=rec.value, headers=headers or [])

    async def _send(self, slot: tuple[str, int], batch: Any) -> None:
        assert self.producer is not None
        batch.close()
        count = batch.record_count()
        fut = await self.producer.send_batch(batch, slot[0], partition=slot[1])
        fut.add_done_callback(_retrieve)
        fut.add_done_callback(functools.partial(self._acknowledged, self._txn_serial, count))
        self._futures.append((fut, count))

    async def send_batches(self) -> None:
        """Ship the batches built so far; the transaction stays open.

        Called after each fetched run of records: the broker gets the data while
        the demux works on the next run, so a commit only waits for the tail.
        """
        for slot, batch in list(self._batches.items()):
            await self._send(slot, batch)
        self._batches.clear()

    def _acknowledged(self, serial: int, count: int, fut: asyncio.Future[Any]) -> None:
        if serial == self._txn_serial and not fut.cancelled() and fut.exception() is None:
            self._open_records.inc(count)

    def _end_txn_records(self) -> None:
        """The open transaction's records no longer count as open (it commits or aborts)."""
        self._txn_serial += 1
        self._open_records.set(0)

    async def _dead_letter(self, m: SourceRecord, error: str, reason: str) -> None:
        """The source record, whole, to the DLQ; cut (and said so) only when the DLQ topic cannot take it."""
        dlq = self.config.dlq
        info = await self.topics.ensure(dlq, compact=False)
        if info.unusable is not None:  # nowhere to put the record: fail and retry, never skip it
            raise RuntimeError(f"dead-letter topic unusable: {info.unusable}")
        key, value = m.key, m.value
        headers = [
            ("walbus.error", error.encode()[:4000]),
            ("walbus.source.topic", self.tp.topic.encode()),
            ("walbus.source.partition", str(self.tp.partition).encode()),
            ("walbus.source.offset", str(m.offset).encode()),
        ]
        header_bytes = sum(len(k) + len(v) for k, v in headers) + 200  # + the cut headers below
        if not record_fits(info.max_bytes, key, value, header_bytes):
            size = len(key or b"") + len(value or b"")
            headers.append(("walbus.value.truncated", str(len(value or b"")).encode()))
            headers.append(("walbus.value.cut", f"source record of {size} bytes is over the dead-letter "
                            f"topic's max.message.bytes={info.max_bytes}".encode()))
            key = key[:1000] if key is not None else None
            room = info.max_bytes - RECORD_OVERHEAD_BYTES - header_bytes - len(key or b"")
            value = (value or b"")[:max(0, room)]
        if key is None and value is None:
            value = b""
        await self._append(OutRecord(dlq, key, value, "", compact=False), headers)
        self._stats[("dead_letter", reason)] += 1
        log.warning(
            "record sent to the dead-letter topic",
            extra={"partition": self.tp.partition, "offset": m.offset, "error": error[:500], "dlq": dlq},
        )

    # -- committing --------------------------------------------------------------

    def due(self, now: float) -> bool:
        if not self.in_txn:
            return False
        return self.txn_records >= self.config.txn_max_records or (
            now - self.txn_started) * 1000 >= self.config.txn_max_ms

    def time_left(self, now: float) -> float:
        """Seconds until the open transaction is due (inf without one)."""
        if not self.in_txn:
            return float("inf")
        return max(0.0, self.txn_started + self.config.txn_max_ms / 1000 - now)

    async def commit(self) -> None:
        """Send the last batches, the consumed offset, commit; then the store follows."""
        producer, store = self.producer, self.store
        assert producer is not None and store is not None
        if not self.in_txn:
            return
        await self.send_batches()
        self._end_txn_records()  # from here on the transaction may be committed
        futures, self._futures = self._futures, []
        started = time.monotonic()
        if futures:
            await asyncio.gather(*(f for f, _ in futures))  # a failed batch must fail the commit
        if self.next_offset is not None:
            await producer.send_offsets_to_transaction({self.tp: self.next_offset}, self.group)
        await producer.commit_transaction()
        self.in_txn = False
        self.metrics.txn_commit_seconds.observe(time.monotonic() - started)
        self.metrics.transactions.labels("committed").inc()
        # Kafka first, the store second: the store may lag behind (then it is rebuilt
        # on the next open) but never run ahead of what readers can see.
        store.commit(checkpoint_text(self.group, self.tp, self.next_offset))
        written = self._written
        for fut, count in futures:
            md = fut.result()
            slot = (md.topic, md.partition)
            written[slot] = max(written.get(slot, 0), md.offset + count)
        self._flush_stats()

    def _flush_stats(self) -> None:
        m = self.metrics
        m.consumed.labels(self._partition_label).inc(self.txn_records)
        if self._replayed:
            m.replayed.inc(self._replayed)
            log.warning("skipped replayed source events (position not after the last one processed)",
                        extra={"partition": self.tp.partition, "count": self._replayed})
            self._replayed = 0
        for table, n in self._produced.items():
            m.produced.labels(table).inc(n)
        for table, n in self._tombstones.items():
            m.tombstones.labels(table).inc(n)
        self._produced.clear()
        self._tombstones.clear()
        for (kind, *labels), n in self._stats.items():
            if kind == "dead_letter":
                m.dead_letters.labels(*labels).inc(n)
            elif kind == "no_pk":
                m.no_pk_events.labels(*labels).inc(n)
            elif kind == "unfilled":
                m.unfilled_columns.labels(*labels).inc(n)
            elif kind == "unwritten":
                m.unwritten_outputs.labels(*labels).inc(n)
        self._stats.clear()
        self.txn_records = 0

    # -- closing -----------------------------------------------------------------

    async def close(self, *, commit: bool) -> None:
        """Commit (graceful) or abort the open transaction, then release everything."""
        self.ready = False
        producer, store = self.producer, self.store
        try:
            if producer is not None and self.in_txn:
                if commit:
                    try:
                        await self.commit()
                    except Exception as e:
                        log.warning("commit on close failed; the transaction is aborted",
                                    extra={"partition": self.tp.partition, "error": repr(e)})
                        await self._abort()
                else:
                    await self._abort()
        finally:
            self._discard()
            if producer is not None:
                with contextlib.suppress(Exception):
                    await producer.stop()
            if store is not None:
                store.close()
            self.producer = None
            self.store = None

    async def _abort(self) -> None:
        producer = self.producer
        self.in_txn = False
        if producer is None:
            return
        try:
            if not _fatal(producer):  # fenced: nothing to abort on our side
                await asyncio.wait_for(producer.abort_transaction(), timeout=30)
            self.metrics.transactions.labels("aborted").inc()
        except Exception as e:
            # The broker aborts it anyway: on the next InitProducerId or at the timeout.
            log.warning("abort failed", extra={"partition": self.tp.partition, "error": repr(e)})

    def _discard(self) -> None:
        self._end_txn_records()
        self._batches.clear()
        self._futures.clear()
        self._stats.clear()
        self._produced.clear()
        self._tombstones.clear()
        self._replayed = 0
        self.txn_records = 0
        if self.store is not None:
            self.store.rollback()


class _KeysView:
    """The store, except that one untracked table's keys come from its topic (truncate)."""

    def __init__(self, store: StateStore, table: str, keys: set[bytes]) -> None:
        self._store, self._table, self._keys = store, table, keys

    def get(self, table: str, key: bytes) -> dict[str, Any] | None:
        return self._store.get(table, key)

    def keys(self, table: str) -> Iterable[bytes]:
        return self._keys if table == self._table else self._store.keys(table)


def _fatal(producer: AIOKafkaProducer) -> bool:
    """True when the producer is fenced or broken (aiokafka keeps this state private)."""
    txn = producer._txn_manager
    if txn is None or not txn.is_fatal_error():
        return False
    # aiokafka parks the fatal error on the transaction waiter; nobody else awaits it.
    _retrieve(txn.wait_for_transaction_end())
    return True


def _retrieve(fut: asyncio.Future[Any]) -> None:
    """Mark a batch's failure as seen: it is handled through the transaction, not here."""
    if not fut.cancelled():
        fut.exception()


def _new_batch(info: TopicInfo) -> Any:
    """An empty record batch for a topic: within its max.message.bytes (a first record always fits)."""
    return new_batch(min(BATCH_BYTES, info.max_bytes - RECORD_OVERHEAD_BYTES))


def _at_position(key: bytes, value: bytes | None) -> bool:
    """Whether a record is a valid event whose key is its own position."""
    try:
        if value is None:
            return False
        check_key(key, decode_event(value))
        return True
    except ContractError:
        return False
