"""Helpers of the tests that bring up their own Kafka (another version, a 3-node cluster)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import psycopg
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.conn import create_conn

from tests.support.demux import (
    DemuxProc,
    demux_args,
    wait_for_log,
)
from tests.support.kafka import produce, read_ktable, read_records, wait_caught_up
from tests.support.pipeline import running_producer

PRODUCE_API_KEY = 0


async def api_versions(bootstrap: str) -> dict[int, tuple[int, int]]:
    """The first broker's ApiVersions answer: api key -> (min, max) version."""
    host, port = bootstrap.split(",")[0].rsplit(":", 1)
    conn = await create_conn(host, int(port))
    try:
        return dict(conn._versions)
    finally:
        conn.close()


async def transactional_commit_and_abort(bootstrap: str, topic: str) -> list[bytes | None]:
    """Commit one transaction, abort the next, commit a third; what read_committed sees."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, transactional_id=f"{topic}.txn", enable_idempotence=True)
    await producer.start()
    try:
        for n, outcome in enumerate(("commit", "abort", "commit")):
            await producer.begin_transaction()
            for i in range(3):
                await producer.send(topic, key=b"k%d" % i, value=b"%s-%d-%d" % (outcome.encode(), n, i))
            if outcome == "commit":
                await producer.commit_transaction()
            else:
                await producer.abort_transaction()
    finally:
        await producer.stop()
    return [r.value for r in await read_records(bootstrap, topic)]


async def offsets_in_transaction(bootstrap: str, topic: str, group: str) -> dict[int, int]:
    """send_offsets_to_transaction (AddOffsetsToTxn + TxnOffsetCommit), then the group's committed offsets."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, transactional_id=f"{group}.txn", enable_idempotence=True)
    await producer.start()
    try:
        async with producer.transaction():
            await producer.send(topic, key=b"x", value=b"y")
            await producer.send_offsets_to_transaction({TopicPartition(topic, 0): 7}, group)
    finally:
        await producer.stop()
    return await _committed_when_visible(bootstrap, topic, group)


async def _committed_when_visible(bootstrap: str, topic: str, group: str, within: float = 60) -> dict[int, int]:
    """Partition 0's committed offset once there is one ({} if none shows up in time).

    EndTxn is answered once the coordinator has logged PrepareCommit; the commit markers,
    which make transactional offsets visible to OffsetFetch, are written after that. And
    aiokafka's OffsetFetch (v3) cannot ask to wait for them (require_stable is v7+).
    """
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        deadline = time.monotonic() + within
        while True:
            committed = await consumer.committed(tp)
            if committed is not None:
                return {0: committed}
            if time.monotonic() > deadline:
                return {}
            await asyncio.sleep(0.2)
    finally:
        await consumer.stop()


def _select_all(dsn: str) -> dict[int, str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {int(r[0]): str(r[1]) for r in conn.execute("SELECT id, v FROM items").fetchall()}


async def producer_demux_roundtrip(
    pg_dsn: str, bootstrap: str, source: str, tmp_path: Path, *, junk: bool = False, **producer_options: Any
) -> str:
    """PostgreSQL -> `walbus produce` -> `walbus demux` -> per-table topic equal to SELECT *.

    ``bootstrap`` is handed to both services as given (a multi-host list, say). ``junk``: one
    record that is no event goes into the source topic too (to the dead-letter topic, then).
    Returns the per-table topic.
    """
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, v text NOT NULL)")
    table_topic = f"{source}.public.items"
    group = f"walbus-demux.{source}"
    proc = DemuxProc(demux_args(bootstrap, source, tmp_path / "state"), tmp_path / "demux.log")
    async with running_producer(pg_dsn, bootstrap, topic=source, **producer_options):
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            for i in range(50):
                conn.execute("INSERT INTO items VALUES (%s, %s)", (i, f"v{i}"))
            conn.execute("UPDATE items SET v = v || '!' WHERE id % 3 = 0")
            conn.execute("DELETE FROM items WHERE id % 5 = 0")
        if junk:
            await produce(bootstrap, source, [(b"not-a-key", b"{not json")], partition=0)
        proc.start()
        await wait_for_log(proc, "partition opened", within=90)
        expected = _select_all(pg_dsn)
        deadline = time.monotonic() + 90
        while True:
            await wait_caught_up(bootstrap, group, source, procs=[proc], within=90)
            got = await read_ktable(client_kwargs={"bootstrap_servers": bootstrap}, topic=table_topic)
            rows = {int(row["id"]): str(row["v"]) for row in got.values()}
            if rows == expected:
                break
            assert time.monotonic() < deadline, f"per-table topic != SELECT *: {len(rows)} vs {len(expected)} rows"
            await asyncio.sleep(0.5)
    assert proc.stop() == 0, proc.log_tail()
    return table_topic
