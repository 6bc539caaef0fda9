"""A consumer group's dead-letter and replay topics are never a table's topic, and what a group
left in the earlier names (``<topic>.<group>.dlq`` / ``.replay``) is listed and moved."""

from __future__ import annotations

import asyncio
import random

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from tests.integration.test_client_ack import FAST, TABLES
from tests.support.cdc_data import workload
from tests.support.kafka import create_topic, produce, read_records
from walbus.client import Feed, FeedEvent, list_dead_letters, replay_dead_letters
from walbus.client.deadletters import (
    Origin,
    dead_letter_headers,
    earlier_group_topics,
    replay_topic,
)

pytestmark = pytest.mark.integration

ROW = (b'{"id":1}', orjson.dumps({"id": 1, "v": "a table's row", "__op": "c"}))


async def _send(bootstrap: str, topic: str, records: list[tuple[bytes, bytes, list[tuple[str, bytes]]]],
                partitions: list[int] | None = None) -> None:
    await create_topic(bootstrap, topic, partitions=1 + max(partitions or [0]))
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        for (key, value, headers), partition in zip(records, partitions or [0] * len(records), strict=True):
            await producer.send_and_wait(topic, key=key, value=value, headers=headers, partition=partition)
    finally:
        await producer.stop()


async def test_a_groups_topics_are_not_the_table_topics_of_its_namesake_schema(kafka_bootstrap: str, unique_name: str) -> None:
    # Group G's topics were <topic>.G.dlq and <topic>.G.replay: the table topics of tables
    # "dlq" and "replay" in a schema G. A dead letter went among the table's rows, and the
    # feed subscribed to the table "replay"'s rows as replayed events.
    changes = workload(random.Random(31), 8, TABLES)
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in changes])
    group = unique_name + "_s"
    tables = earlier_group_topics(unique_name, group)
    for name in tables:
        await create_topic(kafka_bootstrap, name, compact=True)
        await produce(kafka_bootstrap, name, [ROW])
    poison = changes[3].position
    handled: list[tuple[int, int]] = []

    async def handler(event: FeedEvent) -> None:
        if event.position == poison:
            raise RuntimeError("poison")
        handled.append(event.position)

    feed = Feed(unique_name, group_id=group, start="earliest", retry=FAST, bootstrap_servers=kafka_bootstrap, until_end=True)
    async with feed, asyncio.timeout(60):
        await feed.run(handler)
    assert sorted(handled) == sorted(c.position for c in changes if c.position != poison)
    assert feed.stats.dead_letters == 1
    for name in tables:  # the tables' topics hold their row only
        assert [(r.key, r.value) for r in await read_records(kafka_bootstrap, name)] == [ROW]
    (letter,) = await list_dead_letters({"bootstrap_servers": kafka_bootstrap}, unique_name, group)
    assert letter.topic == f"{unique_name}.group--{group}.dlq" and letter.error == "RuntimeError: poison"
    assert [d.value for d in await replay_dead_letters({"bootstrap_servers": kafka_bootstrap}, unique_name, group)] == [
        changes[3].record()[1]]
    assert [(r.key, r.value) for r in await read_records(kafka_bootstrap, name)] == [ROW]


async def test_what_a_group_left_in_the_earlier_names_is_listed_and_moved(kafka_bootstrap: str, unique_name: str) -> None:
    changes = workload(random.Random(32), 4, TABLES)
    await create_topic(kafka_bootstrap, unique_name)
    group = unique_name + "-g"
    earlier_dlq, earlier_replay = earlier_group_topics(unique_name, group)

    def letter(i: int) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
        key, value = changes[i].record()
        assert key is not None and value is not None
        return key, value, dead_letter_headers(error=f"E{i}", attempts=3, group=group, origin=Origin(unique_name, 0, i))

    # The earlier dead-letter topic, a table's topic of 3 partitions: another group's letter and
    # a table's row beside this group's two letters (the earlier writer spread them by key;
    # reading partition 0 alone missed them, a re-fuzz), one of them replayed already (the
    # replay group's offset, as before).
    other = (*letter(0)[:2], dead_letter_headers(error="X", attempts=1, group="other", origin=Origin(unique_name, 0, 0)))
    await _send(kafka_bootstrap, earlier_dlq, [(*ROW, []), other, letter(1), letter(2)], partitions=[0, 0, 1, 2])
    # The earlier replay topic: two replayed events, the group read the first.
    await _send(kafka_bootstrap, earlier_replay, [letter(1), letter(3)])

    async def commit(grp: str, topic: str, offset: int, partition: int = 0) -> None:
        consumer = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=grp, enable_auto_commit=False)
        await consumer.start()
        try:
            consumer.assign([TopicPartition(topic, partition)])
            await consumer.commit({TopicPartition(topic, partition): offset})
        finally:
            await consumer.stop()

    await commit(f"{group}.dlq-replay", earlier_dlq, 1, partition=1)
    await commit(group, earlier_replay, 1)
    kw = {"bootstrap_servers": kafka_bootstrap}
    listed = await list_dead_letters(kw, unique_name, group)
    assert [(d.topic, d.offset, d.error) for d in listed] == [(earlier_dlq, 0, "E1"), (earlier_dlq, 0, "E2")]

    replayed = await replay_dead_letters(kw, unique_name, group)
    assert [d.error for d in replayed] == ["E2"]
    moved = await read_records(kafka_bootstrap, replay_topic(unique_name, group))
    assert [(m.key, m.value) for m in moved] == [letter(2)[:2], letter(3)[:2]]
    assert await replay_dead_letters(kw, unique_name, group) == []
    assert len(await read_records(kafka_bootstrap, replay_topic(unique_name, group))) == 2

    # The group reads them from the new replay topic.
    got: list[tuple[int, int]] = []
    async with Feed(unique_name, group_id=group, start="earliest", bootstrap_servers=kafka_bootstrap, until_end=True) as feed:
        async with asyncio.timeout(60):
            got = [e.position async for e in feed]
    assert sorted(got) == sorted([changes[2].position, changes[3].position])
