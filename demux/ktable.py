"""Read a compacted per-table topic as ``{key: value}`` (the demux's restart), tombstones dropped.

Reads every partition from the beginning to the end offset observed at the start
(with ``read_committed`` that is the last stable offset, so open transactions are
neither waited for nor shown). Records without a key cannot be table rows and are
skipped.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiokafka import AIOKafkaConsumer

from walbus.kafka import topic_partitions


class KTableTimeout(TimeoutError):
    """The end offsets were not reached in time."""


async def read_ktable_raw(
    *,
    client_kwargs: dict[str, Any],
    topic: str,
    isolation_level: str = "read_committed",
    timeout_s: float = 120.0,
    min_end_offsets: dict[int, int] | None = None,
) -> dict[bytes, bytes]:
    """``{key bytes: value bytes}`` of the latest non-tombstone record per key ({} if no topic).

    ``min_end_offsets`` (partition -> offset): first wait until the end offsets reach
    these, e.g. until the markers of a transaction just committed are written.
    """
    consumer = AIOKafkaConsumer(
        **client_kwargs,
        group_id=None,
        enable_auto_commit=False,
        isolation_level=isolation_level,
        auto_offset_reset="earliest",
        max_partition_fetch_bytes=8 * 1024 * 1024,
        fetch_max_bytes=64 * 1024 * 1024,
    )
    await consumer.start()
    try:
        try:
            tps = await topic_partitions(client_kwargs, topic, wait=False)
        except LookupError:
            return {}
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        deadline = time.monotonic() + timeout_s
        end = await consumer.end_offsets(tps)
        while any(end[tp] < (min_end_offsets or {}).get(tp.partition, 0) for tp in tps):
            if time.monotonic() > deadline:
                raise KTableTimeout(f"reading {topic}: end offsets {end} did not reach {min_end_offsets}")
            await asyncio.sleep(0.02)
            end = await consumer.end_offsets(tps)
        todo = {tp for tp in tps if end[tp] > 0}
        table: dict[bytes, bytes] = {}
        while todo:
            if time.monotonic() > deadline:
                raise KTableTimeout(f"reading {topic}: end offsets {end} not reached in {timeout_s}s")
            batch = await consumer.getmany(*todo, timeout_ms=500, max_records=50000)
            for tp, messages in batch.items():
                stop = end[tp]
                for m in messages:
                    if m.offset >= stop or m.key is None:
                        continue
                    if m.value is None:
                        table.pop(m.key, None)
                    else:
                        table[m.key] = m.value
            for tp in list(todo):
                if await consumer.position(tp) >= end[tp]:
                    todo.discard(tp)
                    consumer.pause(tp)
        return table
    finally:
        await asyncio.shield(consumer.stop())
