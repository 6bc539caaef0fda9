"""PgPositions: a Feed's positions stored with its effects in the real PostgreSQL, against a
real broker; a second application of the same event (a zombie after a rebalance) rolls back."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest
from aiokafka import TopicPartition
from psycopg import sql

from tests.support.cdc_data import workload
from tests.support.kafka import commit_offset, create_topic, delete_topic, produce
from walbus.client import AlreadyApplied, Feed, FeedEvent, PgPositions

pytestmark = pytest.mark.integration


async def _events(bootstrap: str, topic: str) -> list[FeedEvent]:
    out: list[FeedEvent] = []
    async with asyncio.timeout(60), Feed(topic, start="earliest", bootstrap_servers=bootstrap, until_end=True) as feed:
        async for event in feed:
            out.append(event)
    return out


async def test_marks_move_forward_and_a_second_application_rolls_back(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str
) -> None:
    changes = workload(random.Random(3), 6, ["public.t"])
    await create_topic(kafka_bootstrap, unique_name, partitions=2)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in changes], partition=1)
    events = await _events(kafka_bootstrap, unique_name)
    assert len(events) == len(changes) >= 2
    assert {(e.topic, e.partition) for e in events} == {(unique_name, 1)}

    positions = PgPositions(pg_dsn, consumer="billing")
    await positions.create_table()
    await positions.create_table()  # idempotent
    assert await positions.resume_after(unique_name, 1) is None
    async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
        await conn.execute("CREATE TABLE effects (commit_lsn bigint, seq int)")
        await conn.commit()

        async def effect(conn: psycopg.AsyncConnection[Any], event: FeedEvent) -> None:
            await conn.execute("INSERT INTO effects VALUES (%s, %s)", (event.commit_lsn, event.seq))

        async def apply(event: FeedEvent) -> bool:
            return await positions.apply(conn, event, effect)

        first, second = events[0], events[1]
        assert await apply(first)
        assert await apply(second)
        assert await positions.resume_after(unique_name, 1) == (second.commit_lsn, second.seq)
        # Delivered again (a crash before the broker commit, a rebalance): nothing applied twice.
        assert not await apply(first)
        assert not await apply(second)
        for event in events[2:]:
            assert await apply(event)
        cur = await conn.execute("SELECT count(*), count(DISTINCT (commit_lsn, seq)) FROM effects")
        assert await cur.fetchone() == (len(events), len(events))
        await conn.commit()
    # Another consumer name keeps its own positions.
    assert await PgPositions(pg_dsn, consumer="audit").resume_after(unique_name, 1) is None


async def test_a_zombie_that_commits_second_rolls_back(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    """Two members apply the same event at once (the old owner after a rebalance and the new
    one): the conditional upsert lets one commit; the other waits on the row and then fails."""
    changes = workload(random.Random(4), 2, ["public.t"])
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in changes])
    event = (await _events(kafka_bootstrap, unique_name))[0]
    positions = PgPositions(pg_dsn, consumer="billing", table="positions_zombie")
    await positions.create_table()
    async with (
        await psycopg.AsyncConnection.connect(pg_dsn) as old_owner,
        await psycopg.AsyncConnection.connect(pg_dsn) as new_owner,
    ):
        await positions.mark(old_owner, event)  # the old owner's transaction is open
        blocked = asyncio.create_task(positions.mark(new_owner, event))
        await asyncio.sleep(0.5)
        assert not blocked.done()  # it waits for the old owner's row lock
        await old_owner.commit()
        with pytest.raises(AlreadyApplied):
            await blocked
        await new_owner.rollback()
    assert await positions.resume_after(unique_name, 0) == (event.commit_lsn, event.seq)


def test_an_event_not_from_a_feed_has_no_position_to_keep() -> None:
    from walbus.contract import RowImage

    event = FeedEvent(lsn=1, commit_lsn=2, seq=0, xid=3, operation="insert", table="public.t", timestamp="t",
                      pk=["id"], new=RowImage(["id"], ["int4"], [1]))
    assert event.topic is None and event.partition is None
    with pytest.raises(ValueError, match="not delivered by a Feed"):
        asyncio.run(PgPositions("dbname=unused", consumer="c").mark(None, event))  # type: ignore[arg-type]


async def test_a_dead_letter_replayed_twice_is_applied(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    """Replayed events are not in position order (a letter that failed again comes back after
    later ones): PgPositions kept the replay topic's row by position, so the second replay of
    an event older than one applied from the first replay was taken for a repeat and dropped."""
    from walbus.client import replay_dead_letters
    from walbus.client.deadletters import replay_topic

    changes = workload(random.Random(5), 8, ["public.t"])
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in changes])
    older, newer = changes[2].position, changes[5].position
    group = unique_name + "-g"
    positions = PgPositions(pg_dsn, consumer=group, table="positions_replay")
    await positions.create_table()
    kafka = {"bootstrap_servers": kafka_bootstrap}
    async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
        round_ = await _replay_rounds(conn, positions, "effects_replay", unique_name, group, kafka_bootstrap)

        assert await round_({older, newer}) == [True] * (len(changes) - 2)  # both dead-lettered
        assert len(await replay_dead_letters(kafka, unique_name, group)) == 2
        assert await round_({older}) == [True]  # newer applied; older dead-lettered again
        assert len(await replay_dead_letters(kafka, unique_name, group)) == 1
        assert await round_(set()) == [True]  # older, at last
        cur = await conn.execute("SELECT commit_lsn, seq FROM effects_replay ORDER BY 1, 2")
        assert [tuple(r) for r in await cur.fetchall()] == sorted(c.position for c in changes)
        await conn.commit()
        # Delivered again (a crash before the broker commit): no replayed event is applied twice.
        await commit_offset(kafka_bootstrap, group, TopicPartition(replay_topic(unique_name, group), 0), 0)
        assert await round_(set()) == [False, False, False]
        cur = await conn.execute("SELECT count(*) FROM effects_replay")
        assert await cur.fetchone() == (len(changes),)


async def test_a_dead_letter_replayed_through_a_re_created_replay_topic_is_applied(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str
) -> None:
    """The replay topic deleted (an operator's clean-up) and made again by the next replay
    starts its offsets at 0 again: PgPositions kept replayed events by offset only, so every
    event of the new replay topic up to the old one's last offset was taken for a repeat."""
    from walbus.client import replay_dead_letters
    from walbus.client.deadletters import replay_topic

    changes = workload(random.Random(7), 9, ["public.t"])
    first, middle, later = changes[:3], changes[3:6], changes[6:]
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in first])
    group = unique_name + "-g"
    positions = PgPositions(pg_dsn, consumer=group, table="positions_recreated")
    await positions.create_table()
    kafka = {"bootstrap_servers": kafka_bootstrap}
    async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
        round_ = await _replay_rounds(conn, positions, "effects_recreated", unique_name, group, kafka_bootstrap)

        replay = replay_topic(unique_name, group)
        # A row as PgPositions kept the replay topic before its ':offset' row (by position, far
        # ahead): a database upgraded from then; it is not read for the replay topic.
        await conn.execute(
            "INSERT INTO positions_recreated (consumer, topic, partition, commit_lsn, seq) VALUES (%s, %s, 0, %s, %s)",
            (group, replay, 2**62, 2**40),
        )
        await conn.commit()
        assert await round_({first[0].position, first[1].position}) == [True]
        assert len(await replay_dead_letters(kafka, unique_name, group)) == 2
        assert await round_(set()) == [True, True]  # replay offsets 0 and 1
        # The ':offset' row as the previous version kept it (seq 0, offset only), then both
        # delivered again (a crash before the broker commit): still refused, not applied twice.
        await conn.execute("UPDATE positions_recreated SET seq = 0 WHERE topic = %s", (replay + ":offset",))
        await conn.commit()
        await commit_offset(kafka_bootstrap, group, TopicPartition(replay, 0), 0)
        assert await round_(set()) == [False, False]
        await produce(kafka_bootstrap, unique_name, [c.record() for c in middle])
        assert await round_({middle[0].position}) == [True] * (len(middle) - 1)
        assert len(await replay_dead_letters(kafka, unique_name, group)) == 1
        assert await round_(set()) == [True]  # replay offset 2
        await delete_topic(kafka_bootstrap, replay)
        await produce(kafka_bootstrap, unique_name, [c.record() for c in later])
        assert await round_({later[0].position}) == [True] * (len(later) - 1)
        assert len(await replay_dead_letters(kafka, unique_name, group)) == 1  # a new replay topic, offset 0
        assert await round_(set()) == [True]
        cur = await conn.execute("SELECT commit_lsn, seq FROM effects_recreated ORDER BY 1, 2")
        assert [tuple(r) for r in await cur.fetchall()] == sorted(c.position for c in changes)


async def test_a_group_without_offsets_resumes_after_its_stored_position(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str
) -> None:
    """A group whose committed offsets are gone (expired after the broker's
    offsets.retention.minutes of downtime, a group deleted, a new group id on the same
    positions) started at ``start`` ("latest" by default) although resume_after knew where its
    effects stopped: every event between that position and the topic's end was never applied."""
    changes = workload(random.Random(11), 8, ["public.t"])
    before, after = changes[:4], changes[4:]
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in before])
    positions = PgPositions(pg_dsn, consumer="billing", table="positions_regroup")
    await positions.create_table()
    async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
        await conn.execute("CREATE TABLE effects_regroup (commit_lsn bigint, seq bigint)")
        await conn.commit()

        async def effect(conn: psycopg.AsyncConnection[Any], event: FeedEvent) -> None:
            await conn.execute("INSERT INTO effects_regroup VALUES (%s, %s)", event.position)

        async def round_(group: str | None, **start: Any) -> list[bool]:
            applied: list[bool] = []
            feed = Feed(unique_name, group_id=group, resume_after=positions.resume_after,
                        bootstrap_servers=kafka_bootstrap, until_end=True, **start)
            async with feed, asyncio.timeout(60):
                async for event in feed:
                    applied.append(await positions.apply(conn, event, effect))
            return applied

        assert await round_(unique_name + "-a", start="earliest") == [True] * len(before)
        await produce(kafka_bootstrap, unique_name, [c.record() for c in after])
        # The same consumer's positions under a group with no offsets: from its position on.
        assert await round_(unique_name + "-b") == [True] * len(after)
        cur = await conn.execute("SELECT commit_lsn, seq FROM effects_regroup ORDER BY 1, 2")
        assert [tuple(r) for r in await cur.fetchall()] == sorted(c.position for c in changes)
        await conn.commit()
        # A group-less feed on those positions: the same (it has no offsets at all).
        more = workload(random.Random(12), 3, ["public.t"], start_lsn=changes[-1].commit_lsn + 1)
        await produce(kafka_bootstrap, unique_name, [c.record() for c in more])
        assert await round_(None) == [True] * len(more)
        cur = await conn.execute("SELECT count(*) FROM effects_regroup")
        assert await cur.fetchone() == (len(changes) + len(more),)


async def test_positions_are_refused_with_concurrent_handlers(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    """PgPositions keeps one position per partition, which grows only in delivery order: under
    run(concurrency=N) an event of one key finished after a later event of another key had its
    mark refused, apply() returned False and its effect was never applied. Refused at run()."""
    from tests.support.cdc_data import Change
    from walbus.client.parallel import event_lane
    from walbus.contract import decode_keyed_event_as

    def change(seq: int, rid: int) -> Change:
        return Change(0x2000_0000, seq, 900, "public.t", "insert", {"id": rid, "v": 0})

    def lane(c: Change) -> int | None:
        return event_lane(decode_keyed_event_as(*c.record(), FeedEvent), 2)

    # Two keys in different lanes (a key's lane is its hash's: it differs between processes).
    other = next(rid for rid in range(2, 100) if lane(change(1, rid)) != lane(change(0, 1)))
    changes = [change(0, 1), change(1, other)]
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in changes])
    positions = PgPositions(pg_dsn, consumer=unique_name, table="positions_concurrent")
    await positions.create_table()
    applied: dict[tuple[int, int], bool] = {}
    later_done = asyncio.Event()
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as first_conn, \
            await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as later_conn:

        async def effect(conn: psycopg.AsyncConnection[Any], event: FeedEvent) -> None:
            pass

        async def handler(event: FeedEvent) -> None:
            if event.seq == 0:  # finishes after the next event (another key, another lane)
                await later_done.wait()
                applied[event.position] = await positions.apply(first_conn, event, effect)
            else:
                applied[event.position] = await positions.apply(later_conn, event, effect)
                later_done.set()

        feed = Feed(unique_name, group_id=unique_name, start="earliest", resume_after=positions.resume_after,
                    bootstrap_servers=kafka_bootstrap, until_end=True)
        async with feed, asyncio.timeout(60):
            with pytest.raises(ValueError, match="concurrency=1"):
                await feed.run(handler, concurrency=2)
            later_done.set()  # one after the other: the first event waits for nothing
            await feed.run(handler)
    assert applied == {c.position: True for c in changes}


async def _replay_rounds(
    conn: psycopg.AsyncConnection[Any], positions: PgPositions, effects: str, topic: str, group: str, bootstrap: str,
) -> Callable[[set[tuple[int, int]]], Awaitable[list[bool]]]:
    """A table ``effects`` and a round: the group's feed read to its end, each event's position
    inserted there through ``positions.apply`` unless the event is one of ``failing`` (then
    dead-lettered after a fast retry); what ``apply`` returned, in delivery order."""
    from walbus.client import RetryPolicy

    fast = RetryPolicy(attempts=2, initial=0.01, maximum=0.02)
    await conn.execute(sql.SQL("CREATE TABLE {} (commit_lsn bigint, seq bigint)").format(sql.Identifier(effects)))
    await conn.commit()
    insert = sql.SQL("INSERT INTO {} VALUES (%s, %s)").format(sql.Identifier(effects))

    async def effect(conn: psycopg.AsyncConnection[Any], event: FeedEvent) -> None:
        await conn.execute(insert, event.position)

    async def round_(failing: set[tuple[int, int]]) -> list[bool]:
        applied: list[bool] = []

        async def handler(event: FeedEvent) -> None:
            if event.position in failing:
                raise RuntimeError("broken")
            applied.append(await positions.apply(conn, event, effect))

        feed = Feed(topic, group_id=group, start="earliest", retry=fast, bootstrap_servers=bootstrap, until_end=True)
        async with feed, asyncio.timeout(60):
            await feed.run(handler)
        return applied

    return round_
