"""Read a compacted per-table topic as ``{key: value}`` (the demux's restart), tombstones dropped.

Reads every partition from the beginning to the end offset observed at the start
(with ``read_committed`` that is the last stable offset, so open transactions are
neither waited for nor shown). Records without a key cannot be table rows and are
skipped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaTimeoutError

from walbus.kafka import stop_consumer, topic_partitions


class KTableTimeout(TimeoutError):
    """The end offsets were not reached in time."""


# One look-up of offsets (the consumer's own limit is its 40 s request timeout: a topic deleted
# after its partitions were looked up held the load, and a SIGTERM, that long; a re-fuzz).
END_OFFSETS_S = 10.0
# Records taken per getmany, with a turn of the event loop after each: a getmany served from
# what is already fetched (8 MiB: 200,000 small records) never suspends, so the whole fetch
# was read in one step of the loop (0.85 CPU seconds for 200,000 records here), while the
# demux' heartbeats and its other partitions' transactions waited.
READ_RECORDS = 5000


class _Gone(Exception):
    """The topic was deleted while it was being read."""


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
    ``timeout_s``: for that wait, then for each stretch of the read without progress.
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
        deadline = time.monotonic() + timeout_s

        async def offsets(lookup: Callable[..., Awaitable[dict[Any, int]]]) -> dict[Any, int]:
            """One look-up of the partitions' first or end offsets, at most END_OFFSETS_S.
            Not wait_for: aiokafka's look-up finishes its own wait before it takes a cancel."""
            task = asyncio.ensure_future(lookup(tps))
            try:
                done, _ = await asyncio.wait({task}, timeout=END_OFFSETS_S)
                if done:
                    return task.result()
            except KafkaTimeoutError:
                pass
            finally:
                if not task.done():
                    task.cancel()
                    task.add_done_callback(lambda f: f.cancelled() or f.exception())
            try:
                await topic_partitions(client_kwargs, topic, wait=False)
            except LookupError:
                raise _Gone from None
            raise KTableTimeout(f"reading {topic}: no offsets in {END_OFFSETS_S} s")

        try:
            for tp, first in (await offsets(consumer.beginning_offsets)).items():
                consumer.seek(tp, first)
            end = await offsets(consumer.end_offsets)
            while any(end[tp] < (min_end_offsets or {}).get(tp.partition, 0) for tp in tps):
                if time.monotonic() > deadline:
                    raise KTableTimeout(f"reading {topic}: end offsets {end} did not reach {min_end_offsets}")
                await asyncio.sleep(0.02)
                end = await offsets(consumer.end_offsets)
        except _Gone:
            return {}  # deleted meanwhile: as when there was no topic
        todo = {tp for tp in tps if end[tp] > 0}
        table: dict[bytes, bytes] = {}
        # From here on the timeout is on a read that stops moving: with one deadline for the
        # whole read, a table too large to read in it (~6M rows in 120 s) failed the worker,
        # which read it again from the start, and failed again, for good.
        at: dict[Any, int] = {}
        moved = time.monotonic()
        while todo:
            if time.monotonic() - moved > timeout_s:
                raise KTableTimeout(f"reading {topic}: no progress in {timeout_s}s (at {at}, end offsets {end})")
            batch = await consumer.getmany(*todo, timeout_ms=500, max_records=READ_RECORDS)
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
                position = await consumer.position(tp)
                if position != at.get(tp):
                    at[tp], moved = position, time.monotonic()
                if position >= end[tp]:
                    todo.discard(tp)
                    consumer.pause(tp)
            await asyncio.sleep(0)  # see READ_RECORDS
        return table
    finally:
        await asyncio.shield(stop_consumer(consumer))
