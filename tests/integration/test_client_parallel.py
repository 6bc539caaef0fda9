"""concurrency=N keeps each key's order; several members share a group over partitions."""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import random
from collections import defaultdict
from collections.abc import Awaitable
from typing import Any

import pytest

from tests.support.cdc_data import Change, workload
from tests.support.kafka import create_topic, produce
from walbus.client import Feed, FeedEvent, RetryPolicy
from walbus.client.parallel import order_key

pytestmark = pytest.mark.integration

TABLES = ["public.transactions", "public.users", "public.items"]


async def test_concurrency_keeps_per_key_order_and_truncate_is_a_barrier(kafka_bootstrap: str, unique_name: str) -> None:
    changes = workload(random.Random(31), 60, TABLES)
    cut = len(changes) // 2
    truncate = Change(changes[cut - 1].commit_lsn + 1, 0, 999, "public.users", "truncate", None)
    rest = [Change(c.commit_lsn + 2, c.seq, c.xid, c.table, c.operation, c.row, c.old_key) for c in changes[cut:]]
    changes = [*changes[:cut], truncate, *rest]
    poison = next(c for c in changes[5:] if c.operation == "insert").position
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in changes])

    clock = itertools.count()
    spans: dict[tuple[int, int], tuple[int, int]] = {}
    by_key: dict[object, list[tuple[int, int]]] = defaultdict(list)
    running = 0
    most = 0
    rng = random.Random(7)

    async def handler(event: FeedEvent) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        begin = next(clock)
        try:
            await asyncio.sleep(rng.random() * 0.004)
            if event.position == poison and event.attempt < 3:
                raise RuntimeError("flaky")
        finally:
            running -= 1
        spans[event.position] = (begin, next(clock))
        by_key[order_key(event)].append(event.position)

    group = unique_name + "-g"
    feed = Feed(unique_name, group_id=group, start="earliest", bootstrap_servers=kafka_bootstrap, until_end=True,
                retry=RetryPolicy(attempts=3, initial=0.01, maximum=0.02))
    async with feed, asyncio.timeout(60):
        await feed.run(handler, concurrency=8)

    assert sorted(spans) == [c.position for c in changes]  # each event once
    assert most > 1  # handlers did run side by side
    for positions in by_key.values():
        assert positions == sorted(positions)  # each key in commit order, the retried one too
    t_begin, t_end = spans[truncate.position]
    for position, (begin, end) in spans.items():
        if position < truncate.position:
            assert end < t_begin
        elif position > truncate.position:
            assert begin > t_end
    assert feed.stats.retries == 2 and feed.stats.dead_letters == 0
    # All acked, so all committed.
    async with Feed(unique_name, group_id=group, bootstrap_servers=kafka_bootstrap, until_end=True) as again:
        assert [e async for e in again] == []


async def test_handlers_that_return_at_once_and_that_await_mix_in_key_order(kafka_bootstrap: str, unique_name: str) -> None:
    """The dispatcher starts a handler on an idle lane itself: one that returns without
    awaiting is done there, one that awaits goes on in the lane's task before the lane's later
    events; a handler failing before its first await is retried by the lane like any other."""
    changes = workload(random.Random(5), 80, TABLES)
    inserts = [c.position for c in changes if c.operation == "insert"]
    poison_now, poison_later = inserts[3], inserts[7]
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in changes])
    rng = random.Random(11)
    by_key: dict[object, list[tuple[int, int]]] = defaultdict(list)
    attempts: dict[tuple[int, int], int] = defaultdict(int)
    running = most = 0
    lane_var: contextvars.ContextVar[int] = contextvars.ContextVar("lane_var", default=0)

    async def handler(event: FeedEvent) -> None:
        nonlocal running, most
        attempts[event.position] += 1
        lane_var.set(lane_var.get() + 1)  # a handler's context is its lane's, never the dispatcher's
        if event.position == poison_now and event.attempt < 3:
            raise RuntimeError("fails before any await")
        if event.position == poison_later or rng.random() < 0.5:
            running += 1
            most = max(most, running)
            try:
                await asyncio.sleep(rng.random() * 0.003)
            finally:
                running -= 1
            if event.position == poison_later and event.attempt < 2:
                raise RuntimeError("fails after an await")
        by_key[order_key(event)].append(event.position)

    feed = Feed(unique_name, group_id=unique_name + "-g", start="earliest", bootstrap_servers=kafka_bootstrap,
                until_end=True, retry=RetryPolicy(attempts=3, initial=0.01, maximum=0.02))
    async with feed, asyncio.timeout(60):
        await feed.run(handler, concurrency=8)

    assert sorted(p for ps in by_key.values() for p in ps) == [c.position for c in changes]  # each once
    for positions in by_key.values():
        assert positions == sorted(positions)
    assert attempts[poison_now] == 3 and attempts[poison_later] == 2
    assert most > 1
    assert lane_var.get() == 0
    assert feed.stats.dead_letters == 0


async def test_a_handlers_timeout_and_task_group_are_its_own(kafka_bootstrap: str, unique_name: str) -> None:
    """A handler the dispatcher starts on an idle lane runs its first step as the lane's task:
    an ``asyncio.timeout`` (or a TaskGroup) taken there bound the dispatcher's task, and its
    expiry cancelled run() itself (a client fuzz). Also a timeout that expires at once, before
    the lane's task took the handler over, and a TaskGroup whose child fails."""
    changes = workload(random.Random(9), 60, TABLES)
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in changes])
    handled: list[tuple[int, int]] = []
    outcomes: dict[str, int] = defaultdict(int)

    async def failing_child() -> None:
        raise ValueError("child")

    async def handler(event: FeedEvent) -> None:
        first = asyncio.current_task()
        kind = event.seq % 4
        try:
            if kind == 0:
                async with asyncio.timeout(0.02):
                    await asyncio.sleep(0.2)
            elif kind == 1:
                async with asyncio.timeout(0):
                    await asyncio.sleep(0.2)
            elif kind == 2:
                async with asyncio.TaskGroup() as group:
                    group.create_task(failing_child())
                    await asyncio.sleep(0.2)
            else:
                await asyncio.sleep(0)
                outcomes["plain"] += 1
        except TimeoutError:
            outcomes["timeout"] += 1
        except ExceptionGroup:
            outcomes["group"] += 1
        assert asyncio.current_task() is first  # one task throughout
        handled.append(event.position)

    feed = Feed(unique_name, group_id=unique_name + "-g", start="earliest", bootstrap_servers=kafka_bootstrap,
                until_end=True)
    async with feed, asyncio.timeout(60):
        await feed.run(handler, concurrency=8)
    assert sorted(handled) == [c.position for c in changes]
    kinds = [c.seq % 4 for c in changes]
    assert outcomes == {"timeout": kinds.count(0) + kinds.count(1), "group": kinds.count(2), "plain": kinds.count(3)}
    assert feed.stats.dead_letters == 0


async def test_a_handler_may_return_any_awaitable(kafka_bootstrap: str, unique_name: str) -> None:
    """A handler returning a gather (not a coroutine): started by hand on an idle lane, send()
    on it failed the event, which was retried while its work had run already (a client fuzz)."""
    changes = workload(random.Random(13), 40, TABLES)
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in changes])
    done: list[tuple[int, int]] = []

    async def work(event: FeedEvent) -> None:
        await asyncio.sleep(0.001)
        done.append(event.position)

    def handler(event: FeedEvent) -> Awaitable[None]:
        return asyncio.gather(work(event))  # type: ignore[return-value]

    feed = Feed(unique_name, group_id=unique_name + "-g", start="earliest", bootstrap_servers=kafka_bootstrap,
                until_end=True, retry=RetryPolicy(attempts=1))
    async with feed, asyncio.timeout(60):
        await feed.run(handler, concurrency=4)
    assert sorted(done) == [c.position for c in changes]  # each once
    assert feed.stats.retries == 0 and feed.stats.dead_letters == 0


async def test_a_nack_at_the_tail_is_retried_and_dead_lettered_without_a_next_record(
    kafka_bootstrap: str, unique_name: str
) -> None:
    """A lane's handler that awaited, then nacked, while the dispatcher waited for records: the
    retry (and the dead letter after the last attempt) waited for the next record to arrive,
    forever at the tail of a quiet topic (a client fuzz)."""
    changes = workload(random.Random(17), 1, TABLES)[:1]
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in changes])
    attempts: list[int] = []
    dead = asyncio.Event()

    async def handler(event: FeedEvent) -> None:
        attempts.append(event.attempt)
        await asyncio.sleep(0.05)  # some I/O first: the dispatcher is back waiting for records
        if event.attempt < 3:
            event.nack(retry_in=0.1, error="try again")
        else:
            dead.set()
            raise RuntimeError("poison")

    feed = Feed(unique_name, group_id=unique_name + "-g", start="earliest", bootstrap_servers=kafka_bootstrap,
                retry=RetryPolicy(attempts=3, initial=0.1, maximum=0.1))
    async with feed:
        task = asyncio.create_task(feed.run(handler, concurrency=4))
        try:
            async with asyncio.timeout(20):
                await dead.wait()
                for _ in range(400):  # the dead letter is written once the lane's handler failed
                    if feed.stats.dead_letters:
                        break
                    await asyncio.sleep(0.05)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    assert attempts == [1, 2, 3] and feed.stats.retries == 2 and feed.stats.dead_letters == 1


async def test_lanes_dead_lettering_at_once_share_one_producer(
    kafka_bootstrap: str, unique_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first dead letters of several lanes at once: each lane started a producer of its
    own, and all but one were never stopped (a client fuzz)."""
    import walbus.client.deadletters as deadletters

    started: list[Any] = []

    class Counting(deadletters.AIOKafkaProducer):  # type: ignore[misc]
        async def start(self) -> None:
            started.append(self)
            await super().start()

    monkeypatch.setattr(deadletters, "AIOKafkaProducer", Counting)
    changes = workload(random.Random(19), 8, TABLES)
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in changes])

    async def handler(event: FeedEvent) -> None:
        await asyncio.sleep(0.01)
        raise RuntimeError("poison")

    feed = Feed(unique_name, group_id=unique_name + "-g", start="earliest", bootstrap_servers=kafka_bootstrap,
                until_end=True, retry=RetryPolicy(attempts=1))
    async with feed, asyncio.timeout(60):
        await feed.run(handler, concurrency=4)
    assert feed.stats.dead_letters == len(changes)
    assert len(started) == 1 and started[0]._closed


async def test_a_handler_cancelling_itself_or_raising_at_once(kafka_bootstrap: str, unique_name: str) -> None:
    """With events buffered before run() starts, a handler started as a lane's task that had not
    run yet and cancelling itself killed that task (run() raised CancelledError); a plain
    function raising before it returns an awaitable left run() (a re-fuzz)."""
    changes = workload(random.Random(17), 40, TABLES)
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in changes])
    failing = changes[5].position
    handled: list[tuple[int, int]] = []

    async def cancels_itself(event: FeedEvent) -> None:
        me = asyncio.current_task()
        assert me is not None
        me.cancel()
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            me.uncancel()
        handled.append(event.position)

    def raises_at_once(event: FeedEvent) -> Awaitable[None]:
        if event.position == failing and event.attempt == 1:
            raise RuntimeError("not now")
        return cancels_itself(event)

    feed = Feed(unique_name, group_id=unique_name + "-g", start="earliest", bootstrap_servers=kafka_bootstrap,
                until_end=True, retry=RetryPolicy(attempts=3, initial=0.01, maximum=0.02))
    async with feed, asyncio.timeout(60):
        async for first in feed:  # the feed holds buffered events when run() starts
            handled.append(first.position)
            break
        await feed.run(raises_at_once, concurrency=4)
    assert sorted(handled) == [c.position for c in changes]
    assert feed.stats.retries == 1 and feed.stats.dead_letters == 0


async def test_members_share_a_group_over_a_multi_partition_topic(kafka_bootstrap: str, unique_name: str) -> None:
    changes = workload(random.Random(32), 60, TABLES)
    await create_topic(kafka_bootstrap, unique_name, partitions=3)
    for part, table in enumerate(TABLES):  # as the producer does: one table, one partition
        await produce(kafka_bootstrap, unique_name, [c.record() for c in changes if c.table == table], partition=part)
    group = unique_name + "-g"
    members = [Feed(unique_name, group_id=group, start="earliest", bootstrap_servers=kafka_bootstrap, until_end=True) for _ in range(2)]
    got: list[list[FeedEvent]] = [[], []]
    try:
        for m in members:
            await m.start()

        async def collect(i: int) -> None:
            async def handler(event: FeedEvent) -> None:
                got[i].append(event)

            await members[i].run(handler, concurrency=4)

        async with asyncio.timeout(60):
            await asyncio.gather(collect(0), collect(1))
    finally:
        for m in members:
            await m.stop()
    assert got[0] and got[1]  # both members had work
    assert not {e.position for e in got[0]} & {e.position for e in got[1]}
    assert sorted(e.position for e in got[0] + got[1]) == [c.position for c in changes]
    for events in got:  # a table lives in one partition: one member has all of a key, in order
        keys: dict[object, list[tuple[int, int]]] = defaultdict(list)
        for e in events:
            keys[order_key(e)].append(e.position)
        assert all(positions == sorted(positions) for positions in keys.values())
    tables = [{e.table for e in events} for events in got]
    assert not tables[0] & tables[1]
