"""A warehouse load fixes its slice from the topic's bounds; a broker that does not answer
while it does so is a transient fault, waited out, not a failed load."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka.errors import NodeNotReadyError, TopicAuthorizationFailedError

from tests.support.kafka import create_topic, produce
from walbus.kafka import KafkaAdmin, KafkaOptions
from warehouse.read import TopicError, topic_bounds

pytestmark = pytest.mark.integration


async def test_bounds_wait_out_a_node_not_ready_while_listing_topics(
    kafka_bootstrap: str, unique_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The soak's load died with NodeNotReadyError from the topic listing (a broker was down):
    only the offsets were retried. The real broker answers; the first two listings fail."""
    topic = f"walbus.{unique_name}"
    await create_topic(kafka_bootstrap, topic, partitions=2)
    await produce(kafka_bootstrap, topic, [(b"k%d" % i, b"v") for i in range(3)], partition=1)
    real = KafkaAdmin.list_topics
    failures = []

    async def flaky(self: KafkaAdmin) -> set[str]:
        if len(failures) < 2:
            failures.append(1)
            raise NodeNotReadyError("node 2 is not ready (the test's fault)")
        return await real(self)

    monkeypatch.setattr(KafkaAdmin, "list_topics", flaky)
    bounds = await asyncio.to_thread(topic_bounds, KafkaOptions(kafka_bootstrap=kafka_bootstrap), topic)
    assert len(failures) == 2
    assert bounds.earliest == {0: 0, 1: 0}
    assert bounds.latest == {0: 0, 1: 3}


async def test_bounds_do_not_retry_a_missing_topic_or_a_fatal_error(
    kafka_bootstrap: str, unique_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = KafkaOptions(kafka_bootstrap=kafka_bootstrap)
    with pytest.raises(TopicError, match="does not exist"):
        await asyncio.to_thread(topic_bounds, options, f"walbus.{unique_name}.missing")
    calls: list[Any] = []

    async def fatal(self: KafkaAdmin) -> set[str]:
        calls.append(1)
        raise TopicAuthorizationFailedError("the test's fault")

    monkeypatch.setattr(KafkaAdmin, "list_topics", fatal)
    with pytest.raises(TopicAuthorizationFailedError):
        await asyncio.to_thread(topic_bounds, options, f"walbus.{unique_name}")
    assert len(calls) == 1


async def test_a_load_is_cut_before_a_transaction_the_producer_is_still_writing(kafka_bootstrap: str, unique_name: str) -> None:
    """A large transaction goes to the topic over several batches: a load planned while it was
    written took its first events, and left the current tables in a state the database never
    had until the next load. The slice now ends after the last commit the producers'
    heartbeats confirmed."""
    import time

    from tests.support.cdc_data import Change
    from walbus.contract import Heartbeat, heartbeat_topic
    from warehouse import read

    topic = f"walbus.{unique_name}"
    beats = heartbeat_topic(topic)
    options = KafkaOptions(kafka_bootstrap=kafka_bootstrap)
    await create_topic(kafka_bootstrap, topic, partitions=2)
    now_ms = int(time.time() * 1000)

    def events(commit: int, n: int) -> list[tuple[bytes | None, bytes | None]]:
        return [Change(commit, seq, 5, "public.t", "insert", {"id": seq}).record() for seq in range(n)]

    await produce(kafka_bootstrap, topic, events(0x100, 3) + events(0x200, 2), partition=0)  # 0x200: 2 of more
    await produce(kafka_bootstrap, topic, events(0x180, 2), partition=1)

    async def cut(start: dict[int, int] | None = None) -> dict[int, int]:
        bounds = await asyncio.to_thread(topic_bounds, options, topic)
        return await asyncio.to_thread(read.commit_cut, options, topic, start or dict(bounds.earliest), bounds)

    assert await cut() == {0: 5, 1: 2}  # no heartbeat topic: the end offsets, as before
    await create_topic(kafka_bootstrap, beats, compact=True)
    await produce(kafka_bootstrap, beats, [(b"s", Heartbeat("s", 0x190, 0x200, now_ms).to_json())])
    assert await cut() == {0: 3, 1: 2}
    assert await cut({0: 3, 1: 2}) == {0: 3, 1: 2}  # nothing confirmed past the last load: no load
    # A confirmed position is where the last acknowledged commit ended, and the next commit may
    # start there: confirmed == 0x200 says nothing of commit 0x200 (it took 2 of its events).
    await produce(kafka_bootstrap, beats, [(b"s", Heartbeat("s", 0x200, 0x200, now_ms).to_json())])
    assert await cut() == {0: 3, 1: 2}
    # A tail longer than one look back (64, 256, ... records), then a record that is no event.
    await produce(kafka_bootstrap, topic, events(0x200, 300), partition=0)
    assert await cut() == {0: 3, 1: 2}
    await produce(kafka_bootstrap, topic, [(b"not a key", b"{}"), *events(0x300, 2)], partition=0)
    assert await cut() == {0: 306, 1: 2}  # the no-event record closes what is before it
    await produce(kafka_bootstrap, beats, [(b"s", Heartbeat("s", 0x400, 0x400, now_ms).to_json())])
    assert await cut() == {0: 308, 1: 2}
    # Heartbeats two minutes older than the newest record: the producers beat no more (turned
    # off, stopped); the load is not cut, or it would wait for ever.
    stale = f"{topic}-stale"
    await create_topic(kafka_bootstrap, stale)
    await create_topic(kafka_bootstrap, heartbeat_topic(stale), compact=True)
    await produce(kafka_bootstrap, heartbeat_topic(stale), [(b"s", Heartbeat("s", 0x90, 0x90, now_ms - 120_000).to_json())])
    await produce(kafka_bootstrap, stale, events(0x100, 3))
    bounds = await asyncio.to_thread(topic_bounds, options, stale)
    assert (bounds.confirmed, bounds.beat_ms) == (0x90, now_ms - 120_000)
    assert await asyncio.to_thread(read.commit_cut, options, stale, dict(bounds.earliest), bounds) == {0: 3}
