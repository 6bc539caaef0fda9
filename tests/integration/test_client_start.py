"""Where a new consumer group (or a group-less feed) starts: latest, earliest, a commit LSN, a time."""

from __future__ import annotations

import asyncio
import random
from datetime import UTC, datetime

import pytest

from tests.support.cdc_data import Change, workload
from tests.support.kafka import create_topic, produce
from walbus.client import Feed, Lsn

pytestmark = pytest.mark.integration

TABLES = ["public.transactions", "public.users"]


def _split(seed: int) -> tuple[list[Change], list[Change]]:
    changes = workload(random.Random(seed), 20, TABLES)
    return changes[: len(changes) // 2], changes[len(changes) // 2 :]


async def _positions(feed: Feed) -> list[tuple[int, int]]:
    async with asyncio.timeout(30):
        return [e.position async for e in feed]


async def test_a_new_group_starts_at_the_latest_event_and_keeps_that_start(kafka_bootstrap: str, unique_name: str) -> None:
    old, new = _split(11)
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in old])
    group = unique_name + "-g"
    # The first deploy reads nothing old, and stops before any new event arrived.
    async with Feed(unique_name, group_id=group, bootstrap_servers=kafka_bootstrap, until_end=True) as feed:
        assert await _positions(feed) == []
    await produce(kafka_bootstrap, unique_name, [c.record() for c in new])
    # The restart takes what happened since the first start: the binding was durable.
    async with Feed(unique_name, group_id=group, bootstrap_servers=kafka_bootstrap, until_end=True) as feed:
        assert await _positions(feed) == [c.position for c in new]


async def test_group_less_latest_reads_only_new_events(kafka_bootstrap: str, unique_name: str) -> None:
    old, new = _split(12)
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in old])
    async with Feed(unique_name, bootstrap_servers=kafka_bootstrap) as feed:
        await produce(kafka_bootstrap, unique_name, [c.record() for c in new])
        got: list[tuple[int, int]] = []
        async with asyncio.timeout(30):
            async for event in feed:
                got.append(event.position)
                if len(got) == len(new):
                    break
    assert got == [c.position for c in new]


async def test_earliest_reads_the_whole_history(kafka_bootstrap: str, unique_name: str) -> None:
    old, new = _split(13)
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in old + new])
    async with Feed(unique_name, group_id=unique_name + "-g", start="earliest", bootstrap_servers=kafka_bootstrap, until_end=True) as feed:
        assert await _positions(feed) == [c.position for c in old + new]


@pytest.mark.parametrize("form", ["lsn", "int", "text"])
async def test_a_commit_lsn_starts_at_that_commit(kafka_bootstrap: str, unique_name: str, form: str) -> None:
    old, new = _split(14)
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in old + new])
    first = new[0].commit_lsn
    start = {"lsn": Lsn(first), "int": first, "text": str(Lsn(first))}[form]
    expected = [c.position for c in old + new if c.commit_lsn >= first]
    group = unique_name + "-g"
    async with Feed(unique_name, group_id=group, start=start, bootstrap_servers=kafka_bootstrap, until_end=True) as feed:
        assert await _positions(feed) == expected
    assert feed.stats.before_start == len(old + new) - len(expected)
    assert feed.stats.duplicates_skipped == 0
    # A group-less feed too.
    async with Feed(unique_name, start=start, bootstrap_servers=kafka_bootstrap, until_end=True) as feed:
        assert await _positions(feed) == expected


async def test_a_group_stopped_before_its_first_event_keeps_its_lsn_start(kafka_bootstrap: str, unique_name: str) -> None:
    old, new = _split(15)
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in old + new])
    group = unique_name + "-g"
    feed = Feed(unique_name, group_id=group, start=new[0].commit_lsn, bootstrap_servers=kafka_bootstrap)
    await feed.start()
    await feed.stop()
    # Restarted with the default start: the group's committed start still holds.
    async with Feed(unique_name, group_id=group, bootstrap_servers=kafka_bootstrap, until_end=True) as feed:
        assert await _positions(feed) == [c.position for c in old + new if c.commit_lsn >= new[0].commit_lsn]


async def test_a_time_starts_at_records_written_since(kafka_bootstrap: str, unique_name: str) -> None:
    old, new = _split(16)
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in old])
    await asyncio.sleep(0.01)  # record timestamps are in milliseconds: keep "since" after the old ones
    since = datetime.now(UTC)
    await asyncio.sleep(0.01)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in new])
    async with Feed(unique_name, group_id=unique_name + "-g", start=since, bootstrap_servers=kafka_bootstrap, until_end=True) as feed:
        assert await _positions(feed) == [c.position for c in new]
    async with Feed(unique_name, start=since.isoformat(), bootstrap_servers=kafka_bootstrap, until_end=True) as feed:
        assert await _positions(feed) == [c.position for c in new]


async def test_a_group_feed_started_before_its_topic_exists(kafka_bootstrap: str, unique_name: str) -> None:
    """A service may start before its source: it waits for the topic, then reads from its start."""
    changes = workload(random.Random(17), 5, TABLES)
    feed = Feed(unique_name, group_id=unique_name + "-g", start="earliest", bootstrap_servers=kafka_bootstrap)
    starting = asyncio.create_task(feed.start())
    await asyncio.sleep(1.5)  # let it look for the topic first
    assert not starting.done()
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in changes])
    try:
        async with asyncio.timeout(60):
            await starting
            got = [(await anext(feed)).position for _ in changes]
    finally:
        await feed.stop()
    assert got == [c.position for c in changes]
