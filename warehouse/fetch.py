"""A load's slice fetched from Kafka by the decoding Python workers themselves.

Through Spark's Kafka source every record crosses the JVM twice: its consumer makes a row of
it, and the row goes on to the decoding Python worker over Arrow. Here each task is handed a
split of the slice (a piece of one partition's offset range), reads it with aiokafka (walbus'
record-runs shortcut, as the demux reads) and decodes it as
:func:`warehouse.decode.decoded_records` does; only the decoded events reach the JVM. A new
driver JVM, which a nightly ``walbus warehouse load`` starts, also never compiles Kafka's
client. Measured in fresh processes (docs/warehouse.md, "Stop 47"): a new JVM's first load of
100,000 events 4-5% faster, a warm load of a 16-column table ~10%.

Used when every executor runs on the driver's host (``--slice-reader auto``): walbus' Kafka
settings (its TLS files) are read where they are. Any other master keeps Spark's Kafka source
(:func:`warehouse.read.read_slice`), and so does ``walbus warehouse stream``, whose offsets
are Spark's checkpoint.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

from pyspark.sql import DataFrame, SparkSession

from walbus.kafka import KafkaOptions, retry_retriable
from warehouse.decode import SliceTally, decode_batches, event_schemas
from warehouse.read import Offsets

# records one fetch hands the decoder at once (Spark's own Arrow batches to Python: 10,000)
CHUNK_RECORDS: Final = 10_000
# a split whose records stop coming for this long fails the load (a broker gone for good), as
# Spark's source does after its poll timeout (kafkaConsumer.pollTimeoutMs, 120 s)
STALL_S: Final = 120.0
# what one partition's fetch may bring at once (Kafka returns at least one batch, however large)
FETCH_PARTITION_BYTES: Final = 16 << 20
_SPLIT_SCHEMA: Final = "partition int, start bigint, end bigint"


class FetchError(RuntimeError):
    """A split of the slice could not be read whole."""


@dataclass(frozen=True)
class Split:
    """The records ``start <= offset < end`` of one Kafka partition: one task's share."""

    partition: int
    start: int
    end: int


def slice_splits(start: Offsets, end: Offsets, parallelism: int) -> list[Split]:
    """Each partition's range ``start[p] <= offset < end[p]`` cut into pieces, about
    ``parallelism`` in all and in proportion to the partitions' sizes (as the ``minPartitions``
    of Spark's source): one Kafka partition is not read and decoded by a single task. Together
    the splits cover every range once, in offset order."""
    sizes = {p: end[p] - start.get(p, 0) for p in sorted(end) if end[p] > start.get(p, 0)}
    total = sum(sizes.values())
    splits: list[Split] = []
    for p, size in sizes.items():
        pieces = min(size, max(1, math.ceil(max(parallelism, 1) * size / total)))
        lo = start.get(p, 0)
        for i in range(pieces):
            splits.append(Split(p, lo + size * i // pieces, lo + size * (i + 1) // pieces))
    return splits


def fetched_records(
    spark: SparkSession, options: KafkaOptions, topic: str, splits: Sequence[Split], tally: SliceTally | None = None
) -> DataFrame:
    """The slice's records decoded (:data:`warehouse.decode.EVENT_SCHEMA`, as
    :func:`warehouse.decode.decoded_records` gives them), each split fetched and decoded by a
    task of its own."""
    schema, arrow_schema = event_schemas()
    rows = [(s.partition, s.start, s.end) for s in splits]
    frame = spark.createDataFrame(spark.sparkContext.parallelize(rows, max(len(rows), 1)), _SPLIT_SCHEMA)
    fetch = functools.partial(_fetch_and_decode, arrow_schema, options, topic, None if tally is None else tally.handle)
    return frame.mapInArrow(fetch, schema)



def _fetch_and_decode(arrow_schema: Any, options: KafkaOptions, topic: str, tally: Any, batches: Iterator[Any]) -> Iterator[Any]:
    """mapInArrow's function: a task's splits -> their records, decoded."""
    yield from decode_batches(arrow_schema, tally, _kafka_batches(options, topic, batches))


def _kafka_batches(options: KafkaOptions, topic: str, splits: Iterator[Any]) -> Iterator[Any]:
    """Arrow batches (key, value, partition, offset) of each split's records, in offset order."""
    loop = asyncio.new_event_loop()
    try:
        for batch in splits:
            columns = (batch.column(c).to_pylist() for c in ("partition", "start", "end"))
            for partition, start, end in zip(*columns, strict=True):
                yield from split_batches(loop, options, topic, Split(partition, start, end))
    finally:
        loop.close()


def split_batches(loop: asyncio.AbstractEventLoop, options: KafkaOptions, topic: str, split: Split) -> Iterator[Any]:
    """One split's records as Arrow batches (key, value, partition, offset) of up to
    CHUNK_RECORDS, read with ``loop``. Records Kafka no longer holds fail it (the load checked
    for a gap first: see :func:`warehouse.read.check_no_gap`), as do records that stop coming
    for STALL_S; a transaction's markers and compacted records are stepped over."""
    import pyarrow as pa
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from walbus.aiokafka_shortcuts import flatten, read_in_runs

    tp = TopicPartition(topic, split.partition)

    async def started() -> AIOKafkaConsumer:
        # aiokafka makes its objects in the loop that runs them; a new client each try, so a
        # broker that is not ready yet is a transient fault (retry_retriable)
        consumer = AIOKafkaConsumer(
            **options.kafka_client_kwargs(),
            group_id=None,
            enable_auto_commit=False,
            # Spark's source reads uncommitted records too: both readers give the same slice
            isolation_level="read_uncommitted",
            auto_offset_reset="none",
            max_partition_fetch_bytes=FETCH_PARTITION_BYTES,
            fetch_max_bytes=4 * FETCH_PARTITION_BYTES,
        )
        try:
            await consumer.start()
        except BaseException:
            await consumer.stop()
            raise
        read_in_runs(consumer)
        consumer.assign([tp])
        consumer.seek(tp, split.start)
        return consumer

    consumer = loop.run_until_complete(retry_retriable(started, f"connecting to read {topic} partition {split.partition}"))
    try:
        position, progress = split.start, time.monotonic()
        while position < split.end:
            got = loop.run_until_complete(consumer.getmany(tp, timeout_ms=1000, max_records=CHUNK_RECORDS))
            keys: list[bytes | None] = []
            values: list[bytes | None] = []
            offsets: list[int] = []
            for record in flatten(got.get(tp, [])):
                if record.offset >= split.end:
                    break
                keys.append(record.key)
                values.append(record.value)
                offsets.append(record.offset)
            # the next offset to read: past a transaction's markers and compacted records too
            moved = loop.run_until_complete(consumer.position(tp))
            if moved > position:
                position, progress = moved, time.monotonic()
            elif time.monotonic() - progress > STALL_S:
                raise FetchError(
                    f"{topic} partition {split.partition}: no records past offset {position} for {STALL_S:.0f} s "
                    f"(this load reads up to offset {split.end})"
                )
            if offsets:
                yield pa.RecordBatch.from_arrays(
                    [
                        pa.array(keys, pa.binary()),
                        pa.array(values, pa.binary()),
                        pa.array([split.partition] * len(offsets), pa.int32()),
                        pa.array(offsets, pa.int64()),
                    ],
                    names=["key", "value", "partition", "offset"],
                )
    finally:
        loop.run_until_complete(consumer.stop())
