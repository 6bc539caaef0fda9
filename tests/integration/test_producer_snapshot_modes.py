"""Snapshot modes when_needed and no_data (issue 18) against real PostgreSQL and Kafka."""

from __future__ import annotations

from typing import Any

import orjson
import psycopg
import pytest

from tests.support.kafka import read_topic
from tests.support.pipeline import running_producer

pytestmark = pytest.mark.integration


def sql(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for s in statements:
            conn.execute(s)  # type: ignore[arg-type]


async def events(bootstrap: str, topic: str, min_count: int = 0) -> list[dict[str, Any]]:
    return [orjson.loads(v) for _, v in await read_topic(bootstrap, topic, min_count=min_count) if v is not None]


def reads(evs: list[dict[str, Any]]) -> list[int]:
    return sorted(m["values"][0] for m in evs if m["operation"] == "read")


async def progress_doc(bootstrap: str, topic: str) -> dict[str, Any]:
    docs = [orjson.loads(v) for _, v in await read_topic(bootstrap, f"{topic}.progress") if v is not None]
    return docs[-1] if docs else {}


async def feed_state(bootstrap: str, topic: str) -> tuple[dict[int, int], int]:
    """public.t's rows ({id: v}) as a Feed consumer keeps them (it skips positions at or below
    the highest it delivered), and how many events it skipped so."""
    from walbus.client import Feed

    state: dict[int, int] = {}
    async with Feed(topic, start="earliest", until_end=True, bootstrap_servers=bootstrap) as feed:
        async for event in feed:
            if event.table != "public.t":
                continue
            if event.operation == "delete":
                assert event.identity is not None
                state.pop(event.identity.as_dict()["id"], None)
            else:
                row = event.row()
                assert row is not None
                state[row["id"]] = row["v"]
    return state, feed.stats.duplicates_skipped


async def test_when_needed_snapshots_a_slot_without_a_recorded_snapshot_once(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY)", "INSERT INTO t SELECT generate_series(1, 3)")
    opts: dict[str, Any] = {"topic": unique_name, "slot": unique_name}
    async with running_producer(pg_dsn, kafka_bootstrap, snapshot_mode="never", **opts):
        sql(pg_dsn, "INSERT INTO t VALUES (4)")
        assert [m["operation"] for m in await events(kafka_bootstrap, unique_name, 1)] == ["insert"]
    # The slot exists, no completed snapshot is recorded: when_needed reads every row.
    async with running_producer(pg_dsn, kafka_bootstrap, snapshot_mode="when_needed", **opts):
        sql(pg_dsn, "INSERT INTO t VALUES (5)")
        evs = await events(kafka_bootstrap, unique_name, 1 + 4 + 1)
    assert reads(evs) == [1, 2, 3, 4]
    assert (await progress_doc(kafka_bootstrap, unique_name))["initial"]["status"] == "completed"
    # Recorded now: the next when_needed start streams without reading again.
    async with running_producer(pg_dsn, kafka_bootstrap, snapshot_mode="when_needed", **opts):
        sql(pg_dsn, "INSERT INTO t VALUES (6)")
        evs = await events(kafka_bootstrap, unique_name, 1 + 4 + 1 + 1)
    assert reads(evs) == [1, 2, 3, 4]
    assert [m["values"][0] for m in evs if m["operation"] == "insert"] == [4, 5, 6]


async def test_when_needed_snapshots_a_new_slot(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY)", "INSERT INTO t SELECT generate_series(1, 3)")
    async with running_producer(pg_dsn, kafka_bootstrap, topic=unique_name, snapshot_mode="when_needed"):
        sql(pg_dsn, "INSERT INTO t VALUES (4)")
        evs = await events(kafka_bootstrap, unique_name, 4)
    assert reads(evs) == [1, 2, 3] and [m["operation"] for m in evs][-1] == "insert"
    # Below the new slot's consistent point: a transaction may commit exactly there, outside the
    # snapshot, and the slot sends it; at the point itself its events came at or below the reads
    # and were skipped as re-sends (a re-fuzz).
    point = (await progress_doc(kafka_bootstrap, unique_name))["initial"]["consistent_point"]
    assert {m["commit_lsn"] for m in evs if m["operation"] == "read"} == {point - 1}


async def test_no_data_streams_from_now_and_records_the_snapshot_as_done(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY)", "INSERT INTO t SELECT generate_series(1, 3)")
    opts: dict[str, Any] = {"topic": unique_name, "slot": unique_name}
    async with running_producer(pg_dsn, kafka_bootstrap, snapshot_mode="no_data", **opts):
        sql(pg_dsn, "INSERT INTO t VALUES (4)")
        evs = await events(kafka_bootstrap, unique_name, 1)
    assert [(m["operation"], m["values"][0]) for m in evs] == [("insert", 4)]
    initial = (await progress_doc(kafka_bootstrap, unique_name))["initial"]
    assert initial["status"] == "completed" and initial["mode"] == "no_data"
    # Like Debezium's: a later when_needed start does not read the tables.
    async with running_producer(pg_dsn, kafka_bootstrap, snapshot_mode="when_needed", **opts):
        sql(pg_dsn, "INSERT INTO t VALUES (5)")
        evs = await events(kafka_bootstrap, unique_name, 2)
    assert [(m["operation"], m["values"][0]) for m in evs] == [("insert", 4), ("insert", 5)]


@pytest.mark.parametrize("plugin", ["pgoutput", "wal2json"])
async def test_always_after_changes_made_while_stopped(pg_dsn: str, kafka_bootstrap: str, unique_name: str, plugin: str) -> None:
    # A snapshot from an existing slot is taken at start, but streaming then starts at the
    # slot's confirmed position and sends again what committed while the producer was down.
    # The reads were placed at the snapshot's position, after those changes', so consumers
    # that skip re-sent positions (demux, Feed, Table) skipped the changes: a row deleted
    # while the producer was down stayed live for good. Found by a fuzz.
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, v int)", "INSERT INTO t VALUES (1, 1), (2, 2), (3, 3)")
    opts: dict[str, Any] = {"topic": unique_name, "slot": unique_name, "snapshot_mode": "always", "plugin": plugin}
    async with running_producer(pg_dsn, kafka_bootstrap, **opts):
        await events(kafka_bootstrap, unique_name, 3)
    sql(pg_dsn, "DELETE FROM t WHERE id = 2", "UPDATE t SET v = 33 WHERE id = 3")
    async with running_producer(pg_dsn, kafka_bootstrap, **opts):
        evs = await events(kafka_bootstrap, unique_name, 3 + 2 + 2)
    # When the slot's confirmed position is still the first reads' (the topic's last position),
    # the stream first goes past it, with one or both changes, then the new reads: any order of
    # the second reads and the changes is right, as the state below shows.
    assert sorted(m["operation"] for m in evs) == ["delete"] + ["read"] * 5 + ["update"]
    state, duplicates = await feed_state(kafka_bootstrap, unique_name)
    assert state == {1: 1, 3: 33}
    assert duplicates == 0


def stop_inside_the_next_transaction(producer: Any) -> None:
    """Make ``producer`` stop right after the first change of the next transaction it streams,
    as a producer killed there: that change is in the topic, the rest and the commit are not
    (the slot stays before the transaction)."""
    from producer.codec import ChangeRun, EncodedEvent
    from producer.decoders import TxnBegin

    make = producer._decoder

    def decoder(catalog: Any) -> Any:
        inner = make(catalog)
        decode = inner.decode

        began = False  # across reads: a transaction's first change may come in the next

        def cut(messages: Any) -> Any:
            nonlocal began
            for item in decode(messages):
                yield item
                began = began or isinstance(item, TxnBegin)
                if began and isinstance(item, EncodedEvent | ChangeRun):
                    producer.stop()
                    return

        inner.decode = cut
        return inner

    producer._decoder = decoder


@pytest.mark.parametrize("plugin", ["pgoutput", "wal2json"])
async def test_always_after_a_stop_inside_a_transaction(pg_dsn: str, kafka_bootstrap: str, unique_name: str, plugin: str) -> None:
    # The topic held the first change of a transaction whose delete came later. The slot sends
    # that transaction again, with its own commit LSN, below the restart's reads: every consumer
    # that skips re-sent positions skipped its delete, and row 2 stayed live. Found by a fuzz.
    import asyncio

    from producer.config import ProducerConfig
    from producer.service import Producer

    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, v int)", "CREATE TABLE u (id int PRIMARY KEY)", "INSERT INTO t VALUES (1, 1), (2, 2), (3, 3)")
    opts: dict[str, Any] = {"topic": unique_name, "slot": unique_name, "snapshot_mode": "always", "plugin": plugin}
    cfg = ProducerConfig(pg_dsn=pg_dsn, kafka_bootstrap=kafka_bootstrap, heartbeat_interval=1.0, **opts)
    first = Producer(cfg)
    stop_inside_the_next_transaction(first)
    task = asyncio.create_task(first.run())
    await events(kafka_bootstrap, unique_name, 3)
    await asyncio.wait_for(first.ready.wait(), 60)
    sql(pg_dsn, "BEGIN; INSERT INTO u VALUES (1); DELETE FROM t WHERE id = 2; COMMIT")
    await asyncio.wait_for(task, 90)
    assert [m["operation"] for m in await events(kafka_bootstrap, unique_name, 4)] == ["read"] * 3 + ["insert"]

    async with running_producer(pg_dsn, kafka_bootstrap, **opts):
        evs = await events(kafka_bootstrap, unique_name, 4 + 2 + 3)
    # The transaction completed from the slot, then the reads (after it in position order too).
    assert [(m["operation"], m["table"]) for m in evs[3:]] == [("insert", "public.u"), ("insert", "public.u"), ("delete", "public.t")] + [("read", "public.t")] * 2 + [("read", "public.u")]
    state, _ = await feed_state(kafka_bootstrap, unique_name)
    assert state == {1: 1, 3: 3}
