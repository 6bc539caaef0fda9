"""One source partition's Kafka transaction: its transactional producer, fencing, the open batches.

The transactional id is stable per source partition, so starting the producer
(InitProducerId) fences whoever processed the partition before: see demux.service.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError, KafkaTimeoutError

from demux.metrics import DemuxMetrics
from walbus.aiokafka_shortcuts import OutputBatch, drop_pending, fenced
from walbus.kafka import DEFAULT_MAX_MESSAGE_BYTES, RECORD_OVERHEAD_BYTES

log = logging.getLogger("walbus.demux")

# A record batch holds at most this much (less when its topic's max.message.bytes is
# smaller); a larger record, if its topic takes it, gets a batch of its own.
BATCH_BYTES = 1_000_000
STOP_S = 30.0  # a transactional producer's stop; then it is left behind (a new one fences it)

Slot = tuple[str, int]  # (topic, partition)


def transactional_id(group: str, topic: str, partition: int) -> str:
    """Stable per source partition: whoever processes the partition next fences the last owner."""
    return f"{group}.{topic}.{partition}"


class PartitionTransaction:
    """begin / append / send / commit or abort, on the partition's own transactional producer."""

    def __init__(self, *, group: str, tp: TopicPartition, client_kwargs: dict[str, Any],
                 transaction_timeout_ms: int, metrics: DemuxMetrics) -> None:
        self.group = group
        self.tp = tp
        self.txn_id = transactional_id(group, tp.topic, tp.partition)
        self._client_kwargs = client_kwargs
        self._timeout_ms = transaction_timeout_ms
        self._metrics = metrics
        self.producer: AIOKafkaProducer | None = None
        self.is_open = False
        self.started = 0.0
        # Open batches per output partition (the fast path appends to them directly).
        self.batches: dict[Slot, OutputBatch] = {}
        self._futures: list[tuple[asyncio.Future[Any], int]] = []
        # (topic, partition) -> offset after the last record we committed there.
        self.written: dict[Slot, int] = {}
        # Bumped when a transaction ends: acknowledgements of an ended one no longer count.
        self._serial = 0
        self._open_records = metrics.open_transaction_records.labels(str(tp.partition))

    async def start(self) -> None:
        """Start the producer: from here on no earlier owner can commit for this partition.

        InitProducerId makes the broker bump the epoch of the transactional id, abort
        a transaction the previous owner left open and, if that one was already
        committing, finish it before answering.
        """
        producer = AIOKafkaProducer(
            **self._client_kwargs,
            transactional_id=self.txn_id,
            transaction_timeout_ms=self._timeout_ms,
            max_batch_size=BATCH_BYTES,
            # Only send() checks it (the demux sends batches); the limit of walbus's topics.
            max_request_size=DEFAULT_MAX_MESSAGE_BYTES,
            linger_ms=0,
            request_timeout_ms=30000,
        )
        self.producer = producer
        await producer.start()

    async def begin(self) -> None:
        if not self.is_open:
            assert self.producer is not None
            await self.producer.begin_transaction()
            self.is_open = True
            self.started = time.monotonic()

    def time_left(self, now: float, max_ms: int) -> float:
        """Seconds until the open transaction is max_ms old (inf without one)."""
        if not self.is_open:
            return float("inf")
        return max(0.0, self.started + max_ms / 1000 - now)

    def new_batch(self, slot: Slot, max_bytes: int) -> OutputBatch:
        """An empty batch for a topic of that max.message.bytes (a first record always fits)."""
        batch = self.batches[slot] = OutputBatch(min(BATCH_BYTES, max_bytes - RECORD_OVERHEAD_BYTES))
        return batch

    async def append(self, slot: Slot, max_bytes: int, key: bytes | None, value: bytes | None,
                     headers: list[tuple[str, bytes]]) -> None:
        """Into the slot's open batch; a full one is sent and a new one started."""
        batch = self.batches.get(slot) or self.new_batch(slot, max_bytes)
        if not batch.append(key, value, headers):
            await self._send(slot, batch)
            # An empty batch takes any record (the topic's limit is checked before).
            self.new_batch(slot, max_bytes).append(key, value, headers)

    async def _send(self, slot: Slot, batch: OutputBatch) -> None:
        assert self.producer is not None
        count = batch.count
        fut = await self.producer.send_batch(batch.for_send(), slot[0], partition=slot[1])
        fut.add_done_callback(_retrieve)
        fut.add_done_callback(functools.partial(self._acknowledged, self._serial, count))
        self._futures.append((fut, count))

    async def send_batches(self) -> None:
        """Ship the batches built so far; the transaction stays open.

        Called after each fetched run of records: the broker gets the data while
        the demux works on the next run, so a commit only waits for the tail.
        """
        for slot, batch in list(self.batches.items()):
            await self._send(slot, batch)
        self.batches.clear()

    def _acknowledged(self, serial: int, count: int, fut: asyncio.Future[Any]) -> None:
        if serial == self._serial and not fut.cancelled() and fut.exception() is None:
            self._open_records.inc(count)

    def _ended(self) -> None:
        """The open transaction's records no longer count as open (it commits or aborts)."""
        self._serial += 1
        self._open_records.set(0)

    async def commit(self, next_offset: int | None, metadata: str = "") -> None:
        """Send the last batches and the consumed offset (with its metadata), then commit."""
        producer = self.producer
        assert producer is not None and self.is_open
        await self.send_batches()
        self._ended()  # from here on the transaction may be committed
        futures, self._futures = self._futures, []
        started = time.monotonic()
        if futures:
            # A failed batch must fail the commit, and so must one never acknowledged: a batch
            # for a topic deleted meanwhile waited forever, and with it every table of the
            # partition (a fuzz). Past the transaction timeout the broker aborts it anyway.
            acks = asyncio.gather(*(f for f, _ in futures))
            try:
                await asyncio.wait_for(acks, self._timeout_ms / 1000)
            except TimeoutError:
                raise KafkaTimeoutError(
                    f"records of the transaction not acknowledged in {self._timeout_ms} ms (an output topic deleted?)"
                ) from None
        if next_offset is not None:
            await producer.send_offsets_to_transaction({self.tp: (next_offset, metadata)}, self.group)
        await producer.commit_transaction()
        self.is_open = False
        self._metrics.txn_commit_seconds.observe(time.monotonic() - started)
        self._metrics.transactions.labels("committed").inc()
        for fut, count in futures:
            md = fut.result()
            slot = (md.topic, md.partition)
            self.written[slot] = max(self.written.get(slot, 0), md.offset + count)

    def written_to(self, topic: str) -> dict[int, int]:
        """Partition -> offset after our last committed record there."""
        return {p: off for (t, p), off in self.written.items() if t == topic}

    async def abort(self) -> None:
        producer = self.producer
        self.is_open = False
        if producer is None:
            return
        try:
            if not fenced(producer):  # fenced: nothing to abort on our side
                await asyncio.wait_for(producer.abort_transaction(), timeout=30)
            self._metrics.transactions.labels("aborted").inc()
        except Exception as e:
            # The broker aborts it anyway: on the next InitProducerId or at the timeout.
            log.warning("abort failed", extra={"partition": self.tp.partition, "error": repr(e)})

    def discard(self) -> None:
        """Forget the open transaction's batches and acknowledgements (after an abort or a failure)."""
        self._ended()
        self.batches.clear()
        self._futures.clear()

    async def stop(self) -> None:
        """Release the producer. What it has not delivered was aborted or failed with the
        transaction (a commit waits for every batch): dropped, so that stop() cannot wait on it."""
        self.discard()
        producer, self.producer = self.producer, None
        if producer is not None:
            drop_pending(producer, KafkaError("the partition's transaction ended without these records"))
            try:
                await asyncio.wait_for(producer.stop(), STOP_S)
            except Exception as e:
                log.warning("transactional producer did not stop cleanly", extra={"partition": self.tp.partition, "error": repr(e)})


def _retrieve(fut: asyncio.Future[Any]) -> None:
    """Mark a batch's failure as seen: it is handled through the transaction, not here."""
    if not fut.cancelled():
        fut.exception()
