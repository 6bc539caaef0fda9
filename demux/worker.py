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
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.partitioner import murmur2
from aiokafka.structs import ConsumerRecord

from demux.config import DemuxConfig
from demux.metrics import DemuxMetrics
from demux.rekey import OutRecord, Rekeyer, RekeyError
from demux.state import StateStore
from demux.topics import TopicManager
from walbus.contract import ContractError, decode_event
from walbus.kafka import KafkaAdmin
from walbus.ktable import read_ktable_raw

log = logging.getLogger("walbus.demux")

# aiokafka's default request limit is 1 MiB; a batch holds at most this much.
MAX_BATCH_BYTES = 1_000_000
# A single record above this cannot be produced with the default broker limits.
MAX_RECORD_BYTES = 1_000_000
DLQ_VALUE_LIMIT = 900_000

# (what, table) already warned about: once per process, not once per partition or transaction.
_WARNED: set[tuple[str, str]] = set()


def transactional_id(group: str, topic: str, partition: int) -> str:
    """Stable per source partition: whoever processes the partition next fences the last owner."""
    return f"{group}.{topic}.{partition}"


def checkpoint_text(group: str, tp: TopicPartition, offset: int | None) -> str:
    return f"{group}|{tp.topic}|{tp.partition}|{-1 if offset is None else offset}"


def partition_for(key: bytes, partitions: int) -> int:
    """Kafka's default partitioner (murmur2, as the Java client): other clients agree."""
    if partitions == 1:
        return 0
    return (int(murmur2(key)) & 0x7FFFFFFF) % partitions


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
        self.group = config.group
        self.client_kwargs = client_kwargs
        self.rekeyer = rekeyer
        self.topics = topics
        self.admin = admin
        self.metrics = metrics
        self.lock = asyncio.Lock()
        self.ready = False
        self.producer: AIOKafkaProducer | None = None
        self.store: StateStore | None = None
        self.next_offset: int | None = None
        self.in_txn = False
        self.txn_started = 0.0
        self.txn_records = 0
        self._batches: dict[tuple[str, int], Any] = {}
        self._futures: list[asyncio.Future[Any]] = []
        self._stats: Counter[tuple[str, str]] = Counter()
        self._partition_label = str(tp.partition)

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
            max_batch_size=MAX_BATCH_BYTES,
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
            await self._rebuild_store(expected, have)
        if committed is None:
            await consumer.seek_to_beginning(self.tp)
        else:
            consumer.seek(self.tp, committed)
        self.next_offset = committed
        self.ready = True
        log.info(
            "partition opened",
            extra={"partition": self.tp.partition, "committed_offset": committed, "transactional_id": self.txn_id},
        )

    async def _rebuild_store(self, expected: str, have: str | None) -> None:
        """Load the store from the demux's own compacted topics (read_committed)."""
        assert self.store is not None
        started = time.monotonic()
        head = f"{self.rekeyer.prefix}.{self.rekeyer.database}."
        rows: list[tuple[str, bytes, bytes]] = []
        topics = sorted(await self.admin.list_topics())
        for topic in topics:
            table = topic[len(head):] if topic.startswith(head) else ""
            # Per-table topics are <head><schema>.<table>; the DLQ and the producer's
            # .transaction topic have no schema part.
            if "." not in table or topic == self.config.dlq:
                continue
            data = await read_ktable_raw(client_kwargs=self.client_kwargs, topic=topic)
            rows.extend((table, k, v) for k, v in data.items())
        count = self.store.replace_all(rows, expected)
        self.metrics.state_rebuilds.inc()
        log.info(
            "last-row store rebuilt from the per-table topics",
            extra={
                "partition": self.tp.partition,
                "reason": "missing" if have is None else "stale",
                "rows": count,
                "seconds": round(time.monotonic() - started, 3),
            },
        )

    # -- processing --------------------------------------------------------------

    async def process(self, messages: list[ConsumerRecord[bytes, bytes]]) -> None:
        """Re-key a run of source records into the open transaction."""
        producer, store = self.producer, self.store
        assert producer is not None and store is not None and self.ready
        if not self.in_txn:
            await producer.begin_transaction()
            self.in_txn = True
            self.txn_started = time.monotonic()
        stats = self._stats
        rekey = self.rekeyer.rekey
        for m in messages:
            if self.next_offset is not None and m.offset < self.next_offset:
                continue  # fetched before a seek back: already processed
            try:
                if m.value is None:
                    raise ContractError("record has no value")
                event = decode_event(m.value)
                out = rekey(event, store)
            except (ContractError, RekeyError) as e:
                await self._dead_letter(m, str(e), "contract")
            except Exception as e:  # a bug must not stall the stream on one record
                log.exception("re-keying failed", extra={"partition": m.partition, "offset": m.offset})
                await self._dead_letter(m, f"internal error: {type(e).__name__}: {e}", "internal")
            else:
                if out.no_pk:
                    info = await self.topics.ensure(out.records[0].topic, compact=False)
                    if info.unusable is not None:
                        await self._dead_letter(m, info.unusable, "topic")
                        self._advance(m.offset)
                        continue
                    stats[("no_pk", event.table)] += 1
                    self._warn_once("no_pk", event.table, m.offset)
                too_big = next((r for r in out.records if _size(r) > MAX_RECORD_BYTES), None)
                if too_big is not None:
                    await self._dead_letter(m, f"output record of {_size(too_big)} bytes is over {MAX_RECORD_BYTES}", "size")
                    self._advance(m.offset)
                    continue
                for rec in out.records:
                    await self._append(rec)
                    if rec.value is None:
                        stats[("tombstone", rec.table)] += 1
                    else:
                        stats[("produced", rec.table)] += 1
                if out.changes:
                    store.apply(out.changes)
                if out.unfilled:
                    stats[("unfilled", event.table)] += len(out.unfilled)
                    self._warn_once("unfilled", event.table, m.offset, out.unfilled)
            self._advance(m.offset)

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
        info = self.topics.cached(rec.topic) or await self.topics.ensure(rec.topic, compact=rec.compact)
        if rec.key is None:
            # Keyless rows of one table stay in one partition, in source order.
            part = self.tp.partition % info.partitions
        else:
            part = partition_for(rec.key, info.partitions)
        slot = (rec.topic, part)
        batch = self._batches.get(slot)
        if batch is None:
            batch = self._batches[slot] = self._new_batch()
        if batch.append(timestamp=None, key=rec.key, value=rec.value, headers=headers or []) is None:
            await self._send(slot, batch)
            batch = self._batches[slot] = self._new_batch()
            # The first record always fits an empty batch (sizes are checked before).
            batch.append(timestamp=None, key=rec.key, value=rec.value, headers=headers or [])

    def _new_batch(self) -> Any:
        assert self.producer is not None
        return self.producer.create_batch()

    async def _send(self, slot: tuple[str, int], batch: Any) -> None:
        assert self.producer is not None
        batch.close()
        fut = await self.producer.send_batch(batch, slot[0], partition=slot[1])
        fut.add_done_callback(_retrieve)
        self._futures.append(fut)

    async def send_batches(self) -> None:
        """Ship the batches built so far; the transaction stays open.

        Called after each fetched run of records: the broker gets the data while
        the demux works on the next run, so a commit only waits for the tail.
        """
        for slot, batch in list(self._batches.items()):
            await self._send(slot, batch)
        self._batches.clear()

    async def _dead_letter(self, m: ConsumerRecord[bytes, bytes], error: str, reason: str) -> None:
        value = m.value
        headers = [
            ("walbus.error", error.encode()[:4000]),
            ("walbus.source.topic", m.topic.encode()),
            ("walbus.source.partition", str(m.partition).encode()),
            ("walbus.source.offset", str(m.offset).encode()),
        ]
        if value is not None and len(value) > DLQ_VALUE_LIMIT:
            headers.append(("walbus.value.truncated", str(len(value)).encode()))
            value = value[:DLQ_VALUE_LIMIT]
        key = m.key[:DLQ_VALUE_LIMIT // 10] if m.key is not None else None
        if key is None and value is None:
            value = b""
        rec = OutRecord(self.config.dlq, key, value, "", compact=False)
        await self._append(rec, headers)
        self._stats[("dead_letter", reason)] += 1
        log.warning(
            "record sent to the dead-letter topic",
            extra={"partition": m.partition, "offset": m.offset, "error": error[:500], "dlq": self.config.dlq},
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
        futures, self._futures = self._futures, []
        started = time.monotonic()
        if futures:
            await asyncio.gather(*futures)  # a failed batch must fail the commit
        if self.next_offset is not None:
            await producer.send_offsets_to_transaction({self.tp: self.next_offset}, self.group)
        await producer.commit_transaction()
        self.in_txn = False
        self.metrics.txn_commit_seconds.observe(time.monotonic() - started)
        self.metrics.transactions.labels("committed").inc()
        # Kafka first, the store second: the store may lag behind (then it is rebuilt
        # on the next open) but never run ahead of what readers can see.
        store.commit(checkpoint_text(self.group, self.tp, self.next_offset))
        self._flush_stats()

    def _flush_stats(self) -> None:
        m = self.metrics
        m.consumed.labels(self._partition_label).inc(self.txn_records)
        for (kind, label), n in self._stats.items():
            if kind == "produced":
                m.produced.labels(label).inc(n)
            elif kind == "tombstone":
                m.tombstones.labels(label).inc(n)
            elif kind == "dead_letter":
                m.dead_letters.labels(label).inc(n)
            elif kind == "no_pk":
                m.no_pk_events.labels(label).inc(n)
            elif kind == "unfilled":
                m.unfilled_columns.labels(label).inc(n)
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
        self._batches.clear()
        self._futures.clear()
        self._stats.clear()
        self.txn_records = 0
        if self.store is not None:
            self.store.rollback()


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


def _size(rec: OutRecord) -> int:
    return (len(rec.key) if rec.key else 0) + (len(rec.value) if rec.value else 0)
