"""Faults: kill -9 of the producer under write load, and the broker going away mid-stream."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
import time
from pathlib import Path

import orjson
import psycopg
import pytest

from tests.support.kafka import read_topic
from tests.support.pipeline import (
    kill9,
    running_producer,
    walbus_process,
)
from walbus.app.dev.kafka import KafkaInstance
from walbus.app.dev.processes import free_port

pytestmark = pytest.mark.integration


class Writer(threading.Thread):
    """Commits small transactions into ``load`` until stopped; remembers what committed."""

    def __init__(self, dsn: str, start_id: int = 0) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.next_id = start_id
        self.stop_flag = threading.Event()
        self.committed = 0

    def run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=False) as conn:
            while not self.stop_flag.is_set():
                ids = list(range(self.next_id, self.next_id + 20))
                conn.execute("INSERT INTO load SELECT g, md5(g::text) FROM unnest(%s::int[]) g", (ids,))
                conn.execute("UPDATE load SET v = 'u' WHERE id = %s", (ids[0],))
                conn.commit()
                self.next_id += 20
                self.committed = self.next_id
                time.sleep(0.002)


async def wait_slot_active(dsn: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with psycopg.connect(dsn, autocommit=True) as conn:
            if conn.execute("SELECT 1 FROM pg_replication_slots WHERE active AND database = current_database()").fetchone():
                return
        await asyncio.sleep(0.2)
    raise AssertionError("the producer's slot did not become active")


def inserted_ids(records: list[tuple[bytes | None, bytes | None]]) -> list[int]:
    out = []
    for _, v in records:
        assert v is not None
        m = orjson.loads(v)
        if m["operation"] == "insert":
            out.append(m["values"][0])
    return out


async def test_kill9_under_write_load_loses_nothing(pg_dsn: str, kafka_bootstrap: str, unique_name: str, tmp_path: Path) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE load (id int PRIMARY KEY, v text)")
    args = ["produce", "--pg-dsn", pg_dsn, "--kafka-bootstrap", kafka_bootstrap, "--topic", unique_name, "--heartbeat-interval", "0.5"]
    log = tmp_path / "producer.log"
    writer = Writer(pg_dsn)
    proc = walbus_process(args, log=log)
    try:
        await wait_slot_active(pg_dsn)  # rows written before the slot exists are not part of the stream
        writer.start()
        for round_ in range(3):
            await asyncio.sleep(1.5 + round_ * 0.3)
            kill9(proc)
            await asyncio.sleep(0.5)
            proc = walbus_process(args, log=log)
        await asyncio.sleep(2)
        writer.stop_flag.set()
        writer.join(10)
        total = writer.committed
        assert total > 500, "the write load did not run"
        with psycopg.connect(pg_dsn) as conn:
            row = conn.execute("SELECT count(*) FROM load").fetchone()
            assert row is not None and row[0] == total
        deadline = time.monotonic() + 90
        while True:
            records = await read_topic(kafka_bootstrap, unique_name)
            ids = inserted_ids(records)
            if set(ids) >= set(range(total)) or time.monotonic() > deadline:
                break
            await asyncio.sleep(1)
    finally:
        writer.stop_flag.set()
        proc.terminate()
        proc.wait(60)
    missing = set(range(total)) - set(ids)
    assert not missing, f"{len(missing)} committed rows missing, e.g. {sorted(missing)[:5]}\n{log.read_text()[-3000:]}"
    # Duplicates are allowed (at-least-once), but only as whole re-sent transactions: keys stay unique per event.
    keys = [k for k, _ in records]
    assert len(ids) >= total
    assert proc.returncode == 0, "graceful stop on SIGTERM exits 0"
    assert len(set(keys)) <= len(keys)


async def test_broker_restart_mid_stream_loses_nothing(pg_dsn: str, unique_name: str) -> None:
    state = Path(tempfile.mkdtemp(prefix="walbus-broker-"))
    broker = KafkaInstance(state, free_port(), free_port())
    await asyncio.to_thread(broker.start)
    try:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE load (id int PRIMARY KEY, v text)")
        async with running_producer(
            pg_dsn, broker.bootstrap, topic=unique_name, retry_max_delay=2.0, kafka_request_timeout_ms=2000
        ) as producer:
            assert producer.progress is not None
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute("INSERT INTO load SELECT g, 'a' FROM generate_series(0, 999) g")
                await read_topic(broker.bootstrap, unique_name, min_count=1000)
                await asyncio.to_thread(broker.stop)
                # Writes go on while Kafka is away; they wait in the slot.
                for i in range(10):
                    conn.execute(f"INSERT INTO load SELECT g, 'b' FROM generate_series({1000 + i * 100}, {1099 + i * 100}) g")
                # Longer than the sink's request timeout; the producer waits (aiokafka keeps the
                # batch until the broker is back) and must lose nothing.
                await asyncio.sleep(6)
                await asyncio.to_thread(broker.start)
                records = await read_topic(broker.bootstrap, unique_name, min_count=2000, timeout=120)
        assert set(inserted_ids(records)) == set(range(2000))
    finally:
        broker.stop()
        shutil.rmtree(state, ignore_errors=True)


async def test_dropped_replication_connection_reconnects_and_loses_nothing(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE load (id int PRIMARY KEY, v text)")
    async with running_producer(pg_dsn, kafka_bootstrap, topic=unique_name, slot=unique_name, retry_max_delay=2.0) as producer:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO load SELECT g, 'a' FROM generate_series(0, 499) g")
            await read_topic(kafka_bootstrap, unique_name, min_count=500)
            killed = conn.execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = %s", (unique_name,)
            ).fetchone()
            assert killed == (True,)
            conn.execute("INSERT INTO load SELECT g, 'b' FROM generate_series(500, 999) g")
            records = await read_topic(kafka_bootstrap, unique_name, min_count=1000, timeout=90)
        assert producer.metrics.reconnects._value.get() >= 1
    assert set(inserted_ids(records)) == set(range(1000))


async def test_a_refused_batch_keeps_the_batches_behind_it_out_of_the_topic(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str,
) -> None:
    # An operator lowered the topic's max.message.bytes while the producer ran: Kafka refused
    # the batch of a large row, and aiokafka then sent the batches queued behind it. Their later
    # positions reached the topic before the refused batch's re-send, which every consumer that
    # skips re-sent positions (demux, Feed, Table) then dropped: a row lost (an ops fuzz).
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    from walbus.contract import decode_event

    async def set_limit(value: int) -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        await admin.start()
        try:
            await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, unique_name, {"max.message.bytes": str(value)})])
        finally:
            await admin.close()

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        conn.execute("INSERT INTO t VALUES (0, 'first')")
    async with running_producer(pg_dsn, kafka_bootstrap, topic=unique_name, retry_max_delay=1.0):
        await read_topic(kafka_bootstrap, unique_name, min_count=1)
        await set_limit(1 << 20)
        await asyncio.sleep(1)  # the brokers apply it

        def write() -> None:
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute("INSERT INTO t VALUES (1, repeat('x', 3000000))")  # refused: above 1 MiB
                for i in range(2, 42):
                    conn.execute("INSERT INTO t VALUES (%s, 'small')", (i,))

        await asyncio.to_thread(write)
        await asyncio.sleep(6)  # the producer fails and retries meanwhile
        await set_limit(16 << 20)
        records = await read_topic(kafka_bootstrap, unique_name, min_count=42)
    events = [decode_event(v or b"") for _, v in records]
    positions = [(e.commit_lsn, e.seq) for e in events]
    seen: set[tuple[int, int]] = set()
    high = (-1, -1)
    for pos in positions:
        # Below the highest position read so far only a re-send (a position read before) may come.
        assert pos > high or pos in seen, "a first event behind a later position: consumers skip it"
        seen.add(pos)
        high = max(high, pos)
    assert {e.new.as_dict()["id"] for e in events if e.new is not None} == set(range(42))
