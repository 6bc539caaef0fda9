"""Feed across a rebalance that gives the partition back to the same member.

Another member joins the group while an event is in this member's hands and leaves again: the
partition is revoked and assigned back. Whatever this member had not finished when it lost the
partition (events run() had taken but not started, an event waiting for its retry) must come
again: it was not committed, and nobody else handled it. Both cases were lost for good before
(a randomized Feed test found them): the run's duplicate mark covered every event delivered.
And run() started events queued in a lane after their partition was revoked (a second fuzz).
"""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient

from tests.support.cdc_data import Change
from tests.support.kafka import create_topic, produce
from walbus.client import Feed, FeedEvent, RetryPolicy

pytestmark = pytest.mark.integration

EVENTS = 60
SLOW = 3  # the event in this member's hands while the other member comes and goes


async def _join_and_leave(bootstrap: str, topic: str, group: str, started: asyncio.Event, left: asyncio.Event) -> int:
    """A second member joins ``group`` once ``started`` is set, stays until the group has
    both members, leaves, and sets ``left``; the most members the group had."""
    await started.wait()
    other = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False,
                             session_timeout_ms=6000, heartbeat_interval_ms=500)
    other.subscribe([topic])
    await other.start()
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    most = 0
    try:
        async with asyncio.timeout(60):
            while most < 2:
                await other.getmany(timeout_ms=200)  # its part of the join
                response = (await admin.describe_consumer_groups([group]))[0]
                members = response.groups[0][5]  # (error, group, state, protocol type, protocol, members, …)
                most = max(most, len(members))
    finally:
        await admin.close()
        await other.stop()  # leaves the group: the partition comes back to the first member
        left.set()
    return most


@pytest.mark.parametrize("mode", ["run", "nack"])
async def test_what_was_not_finished_comes_again_when_the_partition_comes_back(
    kafka_bootstrap: str, unique_name: str, mode: Literal["run", "nack"]
) -> None:
    # Updates of one key: under run(concurrency=2) they queue in one lane behind the slow one,
    # and the dispatcher holds the next ones taken from the buffer.
    changes = [Change(0x1000_0000 + 0x100 * i, 0, 700 + i, "public.t", "update", {"id": 1, "n": i}) for i in range(EVENTS)]
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in changes])
    group = unique_name + "-g"
    started, left = asyncio.Event(), asyncio.Event()
    handled: list[int] = []

    started_after_revoke: list[int] = []

    async def handler(event: FeedEvent) -> None:
        n = event.new.as_dict()["n"]  # type: ignore[union-attr]
        if event._settler.state.revoked:  # type: ignore[union-attr]
            started_after_revoke.append(n)  # a lane started it after its partition was taken away
        if n == SLOW and not started.is_set():
            started.set()
            async with asyncio.timeout(60):
                await left.wait()  # in this member's hands through both rebalances
            if mode == "nack":
                event.nack(retry_in=0.5, error="not now")  # its retry is due after the revoke
                return
        handled.append(n)

    other = asyncio.create_task(_join_and_leave(kafka_bootstrap, unique_name, group, started, left))
    async with Feed(unique_name, group_id=group, start="earliest", bootstrap_servers=kafka_bootstrap,
                    retry=RetryPolicy(attempts=3, initial=0.5, maximum=0.5, jitter=0),
                    consumer_options={"session_timeout_ms": 6000, "heartbeat_interval_ms": 500}) as feed:

        async def consume() -> None:
            if mode == "run":
                await feed.run(handler, concurrency=2)
                return
            async for event in feed:
                await handler(event)

        reading = asyncio.create_task(consume())
        try:
            async with asyncio.timeout(120):
                while set(handled) != set(range(EVENTS)):
                    assert not reading.done(), reading.exception()
                    await asyncio.sleep(0.2)
                await feed.commit()
        except TimeoutError:
            pytest.fail(f"never handled: {sorted(set(range(EVENTS)) - set(handled))}")
        finally:
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
    assert await other == 2  # the other member was really in the group: two rebalances
    # run(): events queued in a lane when their partition was revoked are not started (their
    # new owner has them): they were, side by side with the new owner's handlers.
    assert started_after_revoke == []

    # Each key's events in order, a re-delivery only repeating a stretch already seen.
    first_seen = list(dict.fromkeys(handled))
    assert first_seen == sorted(first_seen)
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        committed = await admin.list_consumer_group_offsets(group)
    finally:
        await admin.close()
    assert [o.offset for o in committed.values()] == [EVENTS]
