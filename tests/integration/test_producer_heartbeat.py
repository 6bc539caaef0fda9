"""Heartbeats and the heartbeat action query (issue 18) against real PostgreSQL and Kafka."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
import psycopg
import pytest

from tests.support.kafka import read_topic, topic_config
from tests.support.pipeline import running_producer, slot_confirmed_lsn
from walbus.contract import Heartbeat, decode_heartbeat, heartbeat_topic
from walbus.metrics import sample

pytestmark = pytest.mark.integration

WINDOW_S = 120.0  # generous: the machine may be loaded; nothing here bounds a speed


def sql(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for s in statements:
            conn.execute(s)  # type: ignore[arg-type]


def changes(records: list[tuple[bytes | None, bytes | None]], table: str) -> list[dict[str, Any]]:
    out = [orjson.loads(v) for _, v in records if v is not None]
    return [m for m in out if m["table"] == table]


async def beats(bootstrap: str, topic: str) -> list[tuple[bytes | None, Heartbeat]]:
    return [(k, decode_heartbeat(v)) for k, v in await read_topic(bootstrap, topic) if v is not None]


async def test_heartbeats_arrive_on_an_idle_database_with_the_position(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY)")
    slot = unique_name
    hb_topic = heartbeat_topic(unique_name)
    async with running_producer(pg_dsn, kafka_bootstrap, topic=unique_name, slot=slot, heartbeat_interval=0.5) as producer:
        sql(pg_dsn, "INSERT INTO t VALUES (1)")
        (change,) = changes(await read_topic(kafka_bootstrap, unique_name, min_count=1), "public.t")
        # From here the database is idle: heartbeats must keep coming, carrying the change's position.
        deadline = time.monotonic() + WINDOW_S
        while True:
            got = await beats(kafka_bootstrap, hb_topic)
            after = [hb for _, hb in got if hb.confirmed_lsn >= change["commit_lsn"]]
            if len(after) >= 2:
                break
            assert time.monotonic() < deadline, f"{len(after)} heartbeats past the change within {WINDOW_S} s: {got}"
            await asyncio.sleep(0.5)
        last_beat = sample(producer.registry, "walbus_producer_last_heartbeat_timestamp_seconds")
    assert {k for k, _ in got} == {slot.encode()}
    assert all(hb.slot == slot and hb.received_lsn >= hb.confirmed_lsn for _, hb in got)
    confirmed = [hb.confirmed_lsn for _, hb in got]
    assert confirmed == sorted(confirmed)  # the position never goes back
    assert last_beat is not None and last_beat >= after[-1].ts_ms / 1000 - 1
    assert (await topic_config(kafka_bootstrap, hb_topic))["cleanup.policy"] == "compact"
    # the change itself went to the database topic only once, heartbeats elsewhere
    assert len(await read_topic(kafka_bootstrap, unique_name)) == 1


async def test_a_beat_follows_each_transaction_once_kafka_acknowledged_it(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str,
) -> None:
    # Table.wait_until learns from a heartbeat that every event of a commit is in the topic
    # (a large one goes over several batches); with beats only each interval it waited up to
    # the interval on an idle database. Now a beat goes out once the transaction is
    # acknowledged and the stream idles: with a 60 s interval, within seconds.
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY)")
    hb_topic = heartbeat_topic(unique_name)
    async with running_producer(pg_dsn, kafka_bootstrap, topic=unique_name, heartbeat_interval=60.0):
        for n in (1, 2):
            sql(pg_dsn, f"INSERT INTO t SELECT g FROM generate_series({n * 10000}, {n * 10000 + 5000}) g")
            events = changes(await read_topic(kafka_bootstrap, unique_name, min_count=5001 * n), "public.t")
            commit_lsn = events[-1]["commit_lsn"]
            deadline = time.monotonic() + 20
            while not any(hb.confirmed_lsn > commit_lsn for _, hb in await beats(kafka_bootstrap, hb_topic)):
                assert time.monotonic() < deadline, f"no heartbeat past commit {commit_lsn} within 20 s"
                await asyncio.sleep(0.2)
        got = await beats(kafka_bootstrap, hb_topic)
    # the first beat at the start, one after each transaction; no beat per event or per batch
    assert 3 <= len(got) <= 5, got


async def test_a_graceful_stop_sends_a_last_beat(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A warehouse load ends after the last commit a heartbeat confirmed: the last transaction a
    # stopped producer wrote waited for its next start (no prompt beat in time here).
    from producer import heartbeat

    monkeypatch.setattr(heartbeat, "PROMPT_QUIET_S", 1e9)
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY)")
    hb_topic = heartbeat_topic(unique_name)
    async with running_producer(pg_dsn, kafka_bootstrap, topic=unique_name, heartbeat_interval=60.0):
        sql(pg_dsn, "INSERT INTO t VALUES (1)")
        (change,) = changes(await read_topic(kafka_bootstrap, unique_name, min_count=1), "public.t")
        assert all(hb.confirmed_lsn <= change["commit_lsn"] for _, hb in await beats(kafka_bootstrap, hb_topic))
    assert max(hb.confirmed_lsn for _, hb in await beats(kafka_bootstrap, hb_topic)) > change["commit_lsn"]


async def test_heartbeats_off_create_no_topic(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    from tests.support.kafka import list_topics

    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY)")
    async with running_producer(pg_dsn, kafka_bootstrap, topic=unique_name, heartbeat_interval=0):
        sql(pg_dsn, "INSERT INTO t VALUES (1)")
        await read_topic(kafka_bootstrap, unique_name, min_count=1)
    assert heartbeat_topic(unique_name) not in await list_topics(kafka_bootstrap)


async def test_action_query_rows_arrive_and_the_slot_advances(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    sql(pg_dsn, "CREATE TABLE hb (id int PRIMARY KEY, beats int NOT NULL)", "INSERT INTO hb VALUES (1, 0)")
    slot = unique_name
    async with running_producer(
        pg_dsn, kafka_bootstrap, topic=unique_name, slot=slot, heartbeat_interval=0.5,
        heartbeat_action_query="UPDATE hb SET beats = beats + 1 WHERE id = 1",
    ) as producer:
        start = slot_confirmed_lsn(pg_dsn, slot)
        deadline = time.monotonic() + WINDOW_S
        while True:
            updates = changes(await read_topic(kafka_bootstrap, unique_name), "public.hb")
            updates = [m for m in updates if m["operation"] == "update"]
            confirmed = slot_confirmed_lsn(pg_dsn, slot)
            if len(updates) >= 2 and confirmed >= updates[1]["commit_lsn"]:
                break
            assert time.monotonic() < deadline, f"{len(updates)} updates, slot at {confirmed} within {WINDOW_S} s"
            await asyncio.sleep(0.5)
        succeeded = sample(producer.registry, "walbus_producer_heartbeat_actions_total")
    assert confirmed > start
    assert [m["values"][1] for m in updates[:2]] == [1, 2]  # the query's own rows, in order
    assert succeeded is not None and succeeded >= 2


async def test_a_failing_action_query_is_counted_and_never_stops_the_stream(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str, caplog: pytest.LogCaptureFixture,
) -> None:
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY)")
    async with running_producer(
        pg_dsn, kafka_bootstrap, topic=unique_name, heartbeat_interval=0.5, heartbeat_action_query="INSERT INTO no_such_table VALUES (1)",
    ) as producer:
        deadline = time.monotonic() + WINDOW_S
        while (sample(producer.registry, "walbus_producer_heartbeat_action_failures_total") or 0) < 2:
            assert time.monotonic() < deadline, "the failing action query was not counted twice"
            await asyncio.sleep(0.5)
        sql(pg_dsn, "INSERT INTO t VALUES (1)")
        (change,) = changes(await read_topic(kafka_bootstrap, unique_name, min_count=1), "public.t")
        assert sample(producer.registry, "walbus_producer_connected") == 1
    assert change["operation"] == "insert"
    failures = [r for r in caplog.records if r.getMessage().startswith("heartbeat action query failed")]
    # (a beat while the previous query still runs is skipped and logged too: look at them all)
    assert any("no_such_table" in str(r.__dict__.get("error")) for r in failures)
