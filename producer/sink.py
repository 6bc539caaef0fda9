"""The Kafka side: record batches built by hand, acks tracked per partition, backpressure.

Why batches by hand: aiokafka's per-message ``send()`` costs ~15 µs a record on
this kind of machine, while ``create_batch()``/``send_batch()`` moves several
hundred thousand records a second. Idempotence still holds: batches go through
the same accumulator and get producer-id sequence numbers when drained.

Backpressure: we keep at most ``max_in_flight`` unacknowledged batches, so memory
does not grow when Kafka is slower than the database.

Order: a partition's next batch goes to aiokafka only once the one before it was
acknowledged. aiokafka sends one batch per partition at a time anyway, but a batch
queued behind a refused one (a record above a ``max.message.bytes`` lowered while
running) was sent after the refusal: its later positions reached the topic before the
refused batch's re-send, and consumers that skip re-sent positions dropped that one.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from typing import Any

from aiokafka import AIOKafkaProducer, TopicPartition

from producer.codec import ChangeRun, EncodedEvent
from producer.progress import Progress
from walbus.aiokafka_shortcuts import OutputBatch, enqueue_batch, native_batch
from walbus.config import ConfigError
from walbus.kafka import (
    DEFAULT_MAX_MESSAGE_BYTES,
    RECORD_OVERHEAD_BYTES,
    partition_for,
    record_fits,
)

log = logging.getLogger("walbus.producer.sink")
# Partition keys are table names: a handful, each hashed once.
_partition_for = functools.lru_cache(maxsize=4096)(partition_for)


class SinkError(Exception):
    """Kafka refused or lost a batch: the stream must restart from the confirmed position."""


def oversized_error(topic: str, ev: EncodedEvent, limit: int) -> ConfigError:
    """What to say of a record above the topic's limit: which row, how large, what to raise."""
    keys = ev.primary_keys()
    key = dict(zip(ev.relation.pk, keys[0], strict=False)) if keys else None
    size = len(ev.key) + len(ev.value) + RECORD_OVERHEAD_BYTES
    return ConfigError(
        f"a change of {ev.table} (key {key}, event {ev.key.decode()}) is {size} bytes, above the "
        f"{limit} bytes topic {topic} takes: raise the topic's max.message.bytes (and the brokers' replica.fetch.max.bytes "
        f"and the consumers' fetch sizes to match), or keep the row smaller (docs/contract.md, size limits)"
    )


class KafkaSink:
    def __init__(
        self,
        *,
        client_kwargs: dict[str, Any],
        topic: str,
        partitions: int,
        progress: Progress,
        max_batch_bytes: int = 1 << 20,
        max_in_flight: int = 8,
        on_ack: Any = None,
        request_timeout_ms: int = 30000,
        compression: str = "none",
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.topic = topic
        self.partitions = partitions
        self.progress = progress
        self._producer = AIOKafkaProducer(
            **client_kwargs,
            acks="all",
            enable_idempotence=True,
            # A batch the topic takes; one record up to its limit always gets a batch of its own.
            max_batch_size=min(max_batch_bytes, max_message_bytes),
            max_request_size=max(max_batch_bytes * 2, max_message_bytes + RECORD_OVERHEAD_BYTES, 1 << 20),
            linger_ms=0,
            request_timeout_ms=request_timeout_ms,
            compression_type=None if compression == "none" else compression,
            retry_backoff_ms=200,
        )
        self.max_message_bytes = max_message_bytes
        # Below this a value fits whatever its key (event keys are 25 bytes): no exact check.
        self._values_surely_fit = max_message_bytes - RECORD_OVERHEAD_BYTES - 1024
        self._max_in_flight = max_in_flight
        self._open: list[OutputBatch | None] = [None] * partitions  # the open batch per partition
        self._open_count = [0] * partitions
        self._inflight: list[deque[tuple[asyncio.Future[Any], int, float]]] = [deque() for _ in range(partitions)]
        # Batches waiting for the partition's batch in flight to be acknowledged (see the
        # module's docstring), and whether one is being handed to aiokafka.
        self._held: list[deque[tuple[Any, int]]] = [deque() for _ in range(partitions)]
        self._handing = [False] * partitions
        self._hand_tasks: set[asyncio.Task[None]] = set()
        self._tps = [TopicPartition(topic, p) for p in range(partitions)]
        self._sent_to = [False] * partitions  # a batch went through send_batch: the metadata is known
        self._inflight_total = 0  # batches in flight or held
        self._error: BaseException | None = None
        self._on_ack = on_ack  # callback(seconds_since_send, records)
        self._side: list[asyncio.Future[Any]] = []
        self._drained = asyncio.Event()
        self._drained.set()

    async def start(self) -> None:
        await self._producer.start()

    async def stop(self) -> None:
        for task in list(self._hand_tasks):
            task.cancel()
        if self._hand_tasks:
            await asyncio.wait(self._hand_tasks)
        await self._producer.stop()

    def fits(self, ev: EncodedEvent) -> bool:
        """Whether the topic takes ``ev``'s record."""
        return len(ev.value) <= self._values_surely_fit or record_fits(self.max_message_bytes, ev.key, ev.value)

    def append(self, ev: EncodedEvent) -> bool:
        """Append an event to its partition's open batch without waiting: False (nothing
        appended) when that batch is full and must be sent first, which :meth:`put` does.
        The snapshot's loop calls this, and awaits only once a batch."""
        if len(ev.value) > self._values_surely_fit and not record_fits(self.max_message_bytes, ev.key, ev.value):
            raise oversized_error(self.topic, ev, self.max_message_bytes)
        p = 0 if self.partitions == 1 else _partition_for(ev.partition_key, self.partitions)
        batch = self._open[p]
        if batch is None:
            batch = self._new_batch(p)
        if not batch.append(ev.key, ev.value):
            return False
        self._open_count[p] += 1
        self.progress.appended[p] += 1
        return True

    async def put(self, ev: EncodedEvent) -> None:
        """Append an event to its partition's open batch, sending that batch first when it is
        full; a record the topic cannot take is a configuration fault, not something to retry."""
        if self.append(ev):
            return
        p = 0 if self.partitions == 1 else _partition_for(ev.partition_key, self.partitions)
        await self._send(p)
        self._new_batch(p).append(ev.key, ev.value)  # an empty batch takes any record
        self._open_count[p] += 1
        self.progress.appended[p] += 1

    async def put_run(self, run: ChangeRun) -> None:
        """:meth:`put` each record of ``run`` (one partition: one relation), in one loop."""
        p = 0 if self.partitions == 1 else _partition_for(run.partition_key, self.partitions)
        values, keys = run.values, run.keys
        surely_fit = self._values_surely_fit
        if values.max_len() > surely_fit:  # natively: the loop only for a run that may not fit
            for i, value in enumerate(values):
                if len(value) > surely_fit and not record_fits(self.max_message_bytes, keys[i], value):
                    raise oversized_error(self.topic, list(run.events())[i], self.max_message_bytes)
        done = 0
        while done < len(keys):
            batch = self._open[p]
            if batch is None:
                batch = self._new_batch(p)
            taken = batch.extend(keys, values, done)
            if taken == 0 and batch.count == 0:
                raise SinkError("an empty Kafka batch refused a record")  # never: it takes any one
            self._open_count[p] += taken
            self.progress.appended[p] += taken
            done += taken
            if done < len(keys):
                await self._send(p)  # full: counted up to here, so its ack confirms just these

    def _new_batch(self, p: int) -> OutputBatch:
        # aiokafka's batch (size, compression, idempotence as configured), appended to without
        # its per-record wrapper where walbus.aiokafka_shortcuts allows.
        batch = self._open[p] = OutputBatch.around(native_batch(self._producer) or self._producer.create_batch())
        return batch

    async def send_side_record(self, topic: str, key: bytes, value: bytes) -> None:
        """A record of another topic (transaction metadata) that the slot must wait for too:
        it is counted on the extra last slot of :class:`Progress` (``partitions`` index)."""
        idx = self.partitions
        self.progress.appended[idx] += 1
        upto = self.progress.appended[idx]
        fut = await self._producer.send(topic, key=key, value=value)

        def done(f: asyncio.Future[Any]) -> None:
            if f.cancelled() or f.exception() is not None:
                self._error = self._error or SinkError(f"Kafka did not acknowledge a record of {topic}")
                self._drained.set()
            else:
                self.progress.ack(idx, max(self.progress.acked[idx], upto))

        fut.add_done_callback(done)
        self._side.append(fut)
        if len(self._side) > 1000:
            self._side = [f for f in self._side if not f.done()]

    def has_open(self) -> bool:
        return any(self._open_count)

    async def flush_idle(self) -> None:
        """Send the open batches of partitions with nothing in flight (Nagle-like: while a
        batch is in flight the next one keeps filling, so a backlog makes full batches and
        a trickle goes out at once)."""
        for p in range(self.partitions):
            if self._open_count[p] and not self._busy(p):
                await self._send(p)

    def _busy(self, p: int) -> bool:
        """A batch of partition ``p`` is in flight, held, or being handed over."""
        return bool(self._inflight[p] or self._held[p] or self._handing[p])

    async def flush(self) -> None:
        """Send every open batch (it is acknowledged later; see :meth:`wait_acked`)."""
        for p in range(self.partitions):
            if self._open[p] is not None and self._open_count[p]:
                await self._send(p)

    async def _send(self, p: int) -> None:
        self.raise_if_failed()
        batch = self._open[p]
        count = self._open_count[p]
        self._open[p] = None
        self._open_count[p] = 0
        if batch is None or count == 0:
            return
        while self._inflight_total >= self._max_in_flight:
            self._drained.clear()
            await self._drained.wait()
            self.raise_if_failed()
        upto = self.progress.appended[p]
        self._inflight_total += 1
        if self._busy(p):
            self._held[p].append((batch.for_send(), upto))  # sent once the one before is acknowledged
            return
        if not self._enqueue(p, batch.for_send(), upto):
            self._handing[p] = True
            await self._hand(p, batch.for_send(), upto)

    def _enqueue(self, p: int, batch: Any, upto: int) -> bool:
        """Give aiokafka one batch of ``p`` without an await (see enqueue_batch): from the
        acknowledgement of the batch before it, aiokafka's sender finds it queued as it would
        have found it waiting behind that batch. False when the shortcut cannot: then
        :meth:`_hand`."""
        fut = enqueue_batch(self._producer, batch, self._tps[p]) if self._sent_to[p] else None
        if fut is None:
            return False
        self._track(p, fut, upto)
        return True

    async def _hand(self, p: int, batch: Any, upto: int) -> None:
        """Give aiokafka one batch of ``p`` (its caller set ``_handing[p]``)."""
        try:
            fut = await self._producer.send_batch(batch, self.topic, partition=p)
        finally:
            self._handing[p] = False
        self._sent_to[p] = True
        self._track(p, fut, upto)

    def _track(self, p: int, fut: asyncio.Future[Any], upto: int) -> None:
        self._inflight[p].append((fut, upto, time.perf_counter()))
        fut.add_done_callback(functools.partial(self._acked_cb, p))

    def _acked_cb(self, p: int, _fut: asyncio.Future[Any]) -> None:
        self._acked(p)

    async def _hand_held(self, p: int, batch: Any, upto: int) -> None:
        try:
            await self._hand(p, batch, upto)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the stream sees it at its next send or check
            self._error = self._error or SinkError(f"Kafka did not take a batch: {e!r}")
            self._drop_held()
            self._drained.set()

    def _acked(self, p: int) -> None:
        q = self._inflight[p]
        while q and q[0][0].done():
            fut, upto, sent = q.popleft()
            self._inflight_total -= 1
            if fut.cancelled():
                self._error = self._error or SinkError("batch send cancelled")
            elif fut.exception() is not None:
                self._error = self._error or SinkError(f"Kafka did not acknowledge a batch: {fut.exception()!r}")
            else:
                before = self.progress.acked[p]
                self.progress.ack(p, upto)
                if self._on_ack is not None:
                    self._on_ack(time.perf_counter() - sent, upto - before)
        if self._error is not None:
            # Nothing behind a refused batch may reach the topic: the stream restarts from
            # the slot's confirmed position and writes it all again, in order.
            self._drop_held()
        elif not q and self._held[p] and not self._handing[p]:
            batch, upto = self._held[p].popleft()
            if not self._enqueue(p, batch, upto):
                self._handing[p] = True  # before the task runs: a _send meanwhile holds its batch
                task = asyncio.ensure_future(self._hand_held(p, batch, upto))
                self._hand_tasks.add(task)
                task.add_done_callback(self._hand_tasks.discard)
        if self._inflight_total < self._max_in_flight or self._error is not None:
            self._drained.set()

    def _drop_held(self) -> None:
        for held in self._held:
            self._inflight_total -= len(held)
            held.clear()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    async def wait_acked(self, timeout: float | None = None) -> None:
        """Flush and wait until Kafka acknowledged everything appended so far."""
        await self.flush()
        async with asyncio.timeout(timeout):
            while True:
                futs = [f for q in self._inflight for f, _, _ in q] + [f for f in self._side if not f.done()]
                if futs:
                    await asyncio.gather(*futs, return_exceptions=True)
                elif any(self._held) or any(self._handing):
                    await asyncio.sleep(0.001)  # a held batch is being handed over
                for p in range(self.partitions):
                    self._acked(p)
                if self._error is not None or not (futs or any(self._held) or any(self._handing)):
                    break
        self.raise_if_failed()
