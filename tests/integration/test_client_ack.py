"""Acknowledgement, retries, dead letters and replay against a real broker."""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys

import pytest

from tests.support.cdc_data import Change, workload
from tests.support.kafka import create_topic, delete_topic, produce
from tests.support.pipeline import ROOT
from walbus.client import (
    Feed,
    FeedEvent,
    RetryPolicy,
    dead_letter_topic,
    list_dead_letters,
    replay_dead_letters,
)

pytestmark = pytest.mark.integration

TABLES = ["public.transactions", "public.users"]
FAST = RetryPolicy(attempts=3, initial=0.01, maximum=0.05)


async def _setup(kafka_bootstrap: str, topic: str, seed: int, n: int = 10) -> list[Change]:
    changes = workload(random.Random(seed), n, TABLES)
    await create_topic(kafka_bootstrap, topic)
    await produce(kafka_bootstrap, topic, [c.record() for c in changes])
    return changes


async def test_offsets_commit_up_to_the_highest_contiguous_ack(kafka_bootstrap: str, unique_name: str) -> None:
    changes = await _setup(kafka_bootstrap, unique_name, 21)
    group = unique_name + "-g"
    kept: list[FeedEvent] = []
    async with Feed(unique_name, group_id=group, start="earliest", auto_ack=False, bootstrap_servers=kafka_bootstrap) as feed:
        async with asyncio.timeout(30):
            async for event in feed:
                kept.append(event)
                if len(kept) == 6:
                    break
        for i in (0, 1, 2, 4, 5):  # 3 is never acked
            kept[i].ack()
        assert not kept[3].settled and kept[4].settled
    async with Feed(unique_name, group_id=group, bootstrap_servers=kafka_bootstrap, until_end=True) as feed:
        again = [e.position async for e in feed]
    assert again == [c.position for c in changes[3:]]


async def test_unacked_events_are_not_committed_without_auto_ack(kafka_bootstrap: str, unique_name: str) -> None:
    changes = await _setup(kafka_bootstrap, unique_name, 22)
    group = unique_name + "-g"
    async with Feed(unique_name, group_id=group, start="earliest", auto_ack=False, bootstrap_servers=kafka_bootstrap, until_end=True) as feed:
        first = [e.position async for e in feed]
    async with Feed(unique_name, group_id=group, bootstrap_servers=kafka_bootstrap, until_end=True) as feed:
        second = [e.position async for e in feed]
    assert first == second == [c.position for c in changes]


async def test_nack_redelivers_then_dead_letters_and_the_feed_goes_on(kafka_bootstrap: str, unique_name: str) -> None:
    changes = await _setup(kafka_bootstrap, unique_name, 23)
    poison = changes[4].position
    group = unique_name + "-g"
    seen: list[tuple[tuple[int, int], int]] = []
    async with Feed(unique_name, group_id=group, start="earliest", retry=FAST, bootstrap_servers=kafka_bootstrap, until_end=True) as feed:
        async for event in feed:
            seen.append((event.position, event.attempt))
            if event.position == poison:
                event.nack(retry_in=0.01 if event.attempt == 1 else None, error=ValueError(f"bad row {event.attempt}"))
    assert [p for p, a in seen if p != poison] == [c.position for c in changes if c.position != poison]
    assert [a for p, a in seen if p == poison] == [1, 2, 3]
    assert feed.stats.dead_letters == 1 and feed.stats.retries == 2
    letters = await list_dead_letters({"bootstrap_servers": kafka_bootstrap}, unique_name, group)
    assert len(letters) == 1
    letter = letters[0]
    assert letter.key == changes[4].record()[0] and letter.value == changes[4].record()[1]
    assert letter.error == "ValueError: bad row 3" and letter.attempts == 3
    assert letter.origin is not None and (letter.origin.topic, letter.origin.partition, letter.origin.offset) == (unique_name, 0, 4)
    # Everything was settled and committed: the group has nothing left.
    async with Feed(unique_name, group_id=group, bootstrap_servers=kafka_bootstrap, until_end=True) as feed:
        assert [e async for e in feed] == []


async def test_a_poison_event_never_stops_run_and_replay_brings_it_back(kafka_bootstrap: str, unique_name: str) -> None:
    changes = await _setup(kafka_bootstrap, unique_name, 24)
    poison = changes[2].position
    group = unique_name + "-g"
    handled: list[tuple[int, int]] = []
    attempts: list[int] = []

    async def handler(event: FeedEvent) -> None:
        if event.position == poison:
            attempts.append(event.attempt)
            raise RuntimeError("cannot handle this one")
        handled.append(event.position)

    feed = Feed(unique_name, group_id=group, start="earliest", retry=FAST, bootstrap_servers=kafka_bootstrap, until_end=True)
    async with feed, asyncio.timeout(60):
        await feed.run(handler)
    assert handled == [c.position for c in changes if c.position != poison]
    assert attempts == [1, 2, 3]
    assert dead_letter_topic(unique_name, group) == f"{unique_name}.group--{group}.dlq"

    # The CLI lists it, replays it once, and a second replay has nothing left.
    env = {"WALBUS_KAFKA_BOOTSTRAP": kafka_bootstrap}
    listed = await _walbus("dead-letters", "list", "--topic", unique_name, "--group-id", group, env=env)
    assert len(listed.splitlines()) == 1 and '"attempts":3' in listed and "cannot handle this one" in listed
    replayed = await _walbus("dead-letters", "replay", "--topic", unique_name, "--group-id", group, env=env)
    assert len(replayed.splitlines()) == 1
    assert await replay_dead_letters({"bootstrap_servers": kafka_bootstrap}, unique_name, group) == []

    # The group's next run gets the replayed event (and only it), and now handles it.
    handled.clear()
    async with Feed(unique_name, group_id=group, retry=FAST, bootstrap_servers=kafka_bootstrap, until_end=True) as feed:
        async with asyncio.timeout(60):
            await feed.run(lambda e: _record(e, handled))
    assert handled == [poison]
    assert feed.stats.dead_letters == 0


async def _record(event: FeedEvent, into: list[tuple[int, int]]) -> None:
    into.append(event.position)


async def _walbus(*args: str, env: dict[str, str]) -> str:
    import os

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "walbus.app.cli", *args, cwd=ROOT, env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()[-2000:]
    return out.decode()


async def test_a_large_event_is_dead_lettered_whole_and_a_long_group_is_refused(kafka_bootstrap: str, unique_name: str) -> None:
    # The group's dead letters went through aiokafka's 1 MB request limit: a larger event (the
    # database topic takes 16 MiB) was refused, retried forever, and the feed never got past it.
    # A dead-letter topic name Kafka refuses was retried forever as well (an operations fuzz).
    from walbus.kafka import DEFAULT_MAX_MESSAGE_BYTES

    await create_topic(kafka_bootstrap, unique_name, configs={"max.message.bytes": str(DEFAULT_MAX_MESSAGE_BYTES)})
    big = Change(0x100, 0, 1, "public.transactions", "insert", {"id": 1, "v": 7})
    key, value = big.record()
    assert value is not None
    value = value.replace(b'"values":[1,7]', b'"values":[1,7]' + b" " * 3_000_000)  # 3 MB of JSON whitespace
    await produce(kafka_bootstrap, unique_name, [(key, value), Change(0x200, 0, 2, "public.transactions", "insert", {"id": 2, "v": 8}).record()])
    group = unique_name + "-g"
    seen: list[tuple[int, int]] = []
    async with Feed(unique_name, group_id=group, start="earliest", retry=FAST, bootstrap_servers=kafka_bootstrap, until_end=True) as feed:
        async with asyncio.timeout(60):
            async for event in feed:
                seen.append(event.position)
                if event.position == (0x100, 0):
                    event.nack(error=ValueError("too big to handle"))
    assert seen.count((0x100, 0)) == FAST.attempts and (0x200, 0) in seen and feed.stats.dead_letters == 1
    (letter,) = await list_dead_letters({"bootstrap_servers": kafka_bootstrap}, unique_name, group)
    assert letter.value == value
    assert [d.value for d in await replay_dead_letters({"bootstrap_servers": kafka_bootstrap}, unique_name, group)] == [value]
    with pytest.raises(ValueError, match="shorter group_id"):
        Feed(unique_name, group_id="g" * 250, bootstrap_servers=kafka_bootstrap)


async def test_a_replay_the_replay_topic_refuses_fails_and_marks_nothing_replayed(kafka_bootstrap: str, unique_name: str) -> None:
    # replay_dead_letters sent the copies without looking at the sends' results: a copy the
    # broker refused (here a replay topic made earlier with a 100 kB limit, for a 300 kB event)
    # was dropped, the letter counted as replayed, and the group never saw the event again.
    from walbus.client import DeadLetterError
    from walbus.client.deadletters import replay_topic

    await create_topic(kafka_bootstrap, unique_name)
    big = Change(0x100, 0, 1, "public.transactions", "insert", {"id": 1, "v": "x" * 300_000})
    await produce(kafka_bootstrap, unique_name, [big.record()])
    group = unique_name + "-g"
    await create_topic(kafka_bootstrap, replay_topic(unique_name, group), configs={"max.message.bytes": "100000"})
    async with Feed(unique_name, group_id=group, start="earliest", retry=RetryPolicy(attempts=1), bootstrap_servers=kafka_bootstrap,
                    until_end=True) as feed, asyncio.timeout(60):
        async for event in feed:
            event.nack(error="poison")
    assert feed.stats.dead_letters == 1
    kafka = {"bootstrap_servers": kafka_bootstrap}
    for _ in range(2):  # refused again: it was not marked replayed
        with pytest.raises(DeadLetterError, match="replay"):
            await replay_dead_letters(kafka, unique_name, group)
    assert len(await list_dead_letters(kafka, unique_name, group)) == 1


async def test_a_feed_with_a_request_timeout_in_its_client_kwargs_dead_letters(kafka_bootstrap: str, unique_name: str) -> None:
    # request_timeout_ms is a connection option of every aiokafka client (client_kwargs takes
    # any), but KafkaAdmin passed its own besides: the first dead letter raised
    # KeyError('request_timeout_ms') out of run().
    changes = await _setup(kafka_bootstrap, unique_name, 33, n=3)
    group = unique_name + "-g"
    kwargs = {"bootstrap_servers": kafka_bootstrap, "request_timeout_ms": 15000}

    async def handler(event: FeedEvent) -> None:
        if event.position == changes[0].position:
            raise RuntimeError("poison")

    async with Feed(unique_name, group_id=group, start="earliest", retry=FAST, client_kwargs=kwargs, until_end=True) as feed:
        await asyncio.wait_for(feed.run(handler), 60)
        assert feed.stats.dead_letters == 1
    letters = await list_dead_letters(kwargs, unique_name, group)
    assert [letter.key for letter in letters] == [changes[0].record()[0]]


async def test_a_dead_letter_topic_deleted_under_a_running_feed_is_made_again(kafka_bootstrap: str, unique_name: str) -> None:
    # The dead-letter topic was made on first use and then taken for granted: deleted under a
    # running feed (an operator's clean-up), each later dead letter was retried forever against
    # a topic nobody made again, and the feed handled nothing more.
    changes = workload(random.Random(31), 8, TABLES)
    first, later = changes[:4], changes[4:]
    poison = {first[0].position, later[0].position}
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in first])
    group = unique_name + "-g"
    handled: set[tuple[int, int]] = set()
    # One lane: an event after a poison one is handled only once that one is dead-lettered.
    through_first, through_later = asyncio.Event(), asyncio.Event()

    async def handler(event: FeedEvent) -> None:
        if event.position in poison:
            raise RuntimeError("poison")
        handled.add(event.position)
        if event.position == first[-1].position:
            through_first.set()
        if event.position == later[-1].position:
            through_later.set()

    # A short request timeout: a send to a deleted topic fails after it (40 s by default).
    kwargs = {"bootstrap_servers": kafka_bootstrap, "request_timeout_ms": 12000}
    dlq = dead_letter_topic(unique_name, group)
    async with Feed(unique_name, group_id=group, start="earliest", retry=FAST, client_kwargs=kwargs) as feed:
        task = asyncio.create_task(feed.run(handler))
        try:
            await asyncio.wait_for(through_first.wait(), 60)
            assert feed.stats.dead_letters == 1
            await delete_topic(kafka_bootstrap, dlq)
            await produce(kafka_bootstrap, unique_name, [c.record() for c in later])
            await asyncio.wait_for(through_later.wait(), 90)
            assert feed.stats.dead_letters == 2
            assert handled == {c.position for c in changes} - poison
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    letters = await list_dead_letters({"bootstrap_servers": kafka_bootstrap}, unique_name, group)
    assert [letter.key for letter in letters] == [later[0].record()[0]]  # the first went with its topic
