"""The services are real: PostgreSQL with logical decoding, a durable Kafka broker, log compaction."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
import pytest
from aiokafka import AIOKafkaProducer

from tests.support.kafka import read_topic
from tests.support.services import Services
from walbus.app.dev.kafka import KafkaInstance
from walbus.app.dev.processes import free_port, pid_alive
from walbus.kafka import KafkaAdmin, TopicSpec

pytestmark = pytest.mark.integration


def test_postgres_logical_replication_connection(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert conn.execute("SHOW wal_level").fetchone() == ("logical",)
        conn.execute("CREATE TABLE t (id int primary key, v text)")
        conn.execute("INSERT INTO t VALUES (1, 'één')")
        assert conn.execute("SELECT v FROM t WHERE id = 1").fetchone() == ("één",)
    with psycopg.connect(pg_dsn, autocommit=True, replication="database") as repl:
        row = repl.execute("IDENTIFY_SYSTEM").fetchone()
        assert row is not None and "/" in row[2]  # xlogpos


async def test_kafka_produce_and_consume(services: Services, unique_name: str) -> None:
    async with KafkaAdmin(client_kwargs={"bootstrap_servers": services.kafka_bootstrap}) as admin:
        assert await admin.ensure_topic(TopicSpec(unique_name)) is True
        assert await admin.ensure_topic(TopicSpec(unique_name)) is False
    producer = AIOKafkaProducer(bootstrap_servers=services.kafka_bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        for i in range(100):
            await producer.send(unique_name, key=b"k%d" % i, value=b"v%d" % i)
        await producer.flush()
    finally:
        await producer.stop()
    records = await read_topic(services.kafka_bootstrap, unique_name, min_count=100)
    assert records == [(b"k%d" % i, b"v%d" % i) for i in range(100)]


async def test_ensure_topic_returns_once_the_topic_is_described(services: Services, unique_name: str) -> None:
    """Callers ask a new topic's partitions at once; right after CreateTopics the metadata may lag."""
    names = [f"{unique_name}.{i}" for i in range(30)]
    async with KafkaAdmin(client_kwargs={"bootstrap_servers": services.kafka_bootstrap}) as admin:
        for name in names:
            assert await admin.ensure_topic(TopicSpec(name, partitions=3)) is True
            assert await admin.partitions(name) == 3
        await admin.delete_topics(names)


def test_kafka_restart_keeps_data() -> None:
    """A dedicated broker (not the session's): stop it, start it again, read the data back."""
    state = Path(tempfile.mkdtemp(prefix="walbus-durable-"))
    broker = KafkaInstance(state, free_port(), free_port())
    try:
        broker.start()

        async def write() -> None:
            async with KafkaAdmin(client_kwargs={"bootstrap_servers": broker.bootstrap}) as admin:
                await admin.ensure_topic(TopicSpec("durable"))
            producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap, acks="all")
            await producer.start()
            try:
                for i in range(50):
                    await producer.send_and_wait("durable", key=b"%d" % i, value=b"x" * i)
            finally:
                await producer.stop()

        asyncio.run(write())
        pid = broker.pid
        assert pid is not None and broker.stop()
        assert not pid_alive(pid, str(broker.home))
        broker.start()
        assert broker.pid != pid
        records = asyncio.run(read_topic(broker.bootstrap, "durable", min_count=50))
        assert records == [(b"%d" % i, b"x" * i) for i in range(50)]
    finally:
        broker.stop()
        shutil.rmtree(state, ignore_errors=True)


async def test_log_compaction_keeps_latest_value_per_key(services: Services, unique_name: str) -> None:
    configs = (
        ("cleanup.policy", "compact"),
        ("segment.ms", "100"),
        ("min.cleanable.dirty.ratio", "0.01"),
        ("delete.retention.ms", "100"),
        ("min.compaction.lag.ms", "0"),
    )
    async with KafkaAdmin(client_kwargs={"bootstrap_servers": services.kafka_bootstrap}) as admin:
        await admin.ensure_topic(TopicSpec(unique_name, configs=configs))
        assert (await admin.topic_config(unique_name, ["cleanup.policy"]))["cleanup.policy"] == "compact"
    producer = AIOKafkaProducer(bootstrap_servers=services.kafka_bootstrap, acks="all")
    await producer.start()
    try:
        for round_ in range(5):
            for k in range(10):
                await producer.send(unique_name, key=b"key-%d" % k, value=b"round-%d" % round_)
            await producer.flush()
            await asyncio.sleep(0.15)  # let segments roll, so that older ones become cleanable
        for k in range(3):  # tombstones
            await producer.send(unique_name, key=b"key-%d" % k, value=None)
        await producer.flush()
        deadline = time.monotonic() + 120
        expected = {b"key-%d" % k: b"round-4" for k in range(3, 10)}
        while True:
            # Rolling the active segment needs a new record after segment.ms.
            await asyncio.sleep(0.3)
            await producer.send_and_wait(unique_name, key=b"filler", value=b"f")
            records = await read_topic(services.kafka_bootstrap, unique_name)
            live = [(k, v) for k, v in records if k != b"filler"]
            if len(live) == len(expected) and dict(live) == expected:
                break
            assert time.monotonic() < deadline, f"compaction did not converge: {len(live)} records left"
    finally:
        await producer.stop()
    assert sorted(k for k, _ in live) == sorted(expected)


def test_dev_cli_up_status_down_twice() -> None:
    state = Path(tempfile.mkdtemp(prefix="walbus-cli-"))
    walbus = [sys.executable, "-m", "walbus.app.cli", "dev", "--state-dir", str(state)]
    pids: list[str] = []
    for _ in range(2):
        up = subprocess.run([*walbus, "up"], capture_output=True, text=True, timeout=180)
        assert up.returncode == 0, up.stderr
        again = subprocess.run([*walbus, "up"], capture_output=True, text=True, timeout=60)
        assert again.returncode == 0 and "reusing" in again.stdout
        status = subprocess.run([*walbus, "status"], capture_output=True, text=True, timeout=60)
        assert status.returncode == 0 and '"running": true' in status.stdout
        import json

        info = json.loads(status.stdout)
        pids += [str(info["postgres"]["pid"]), str(info["kafka"]["pid"])]
        env = subprocess.run([*walbus, "env"], capture_output=True, text=True, timeout=60)
        assert env.stdout.startswith("export WALBUS_PG_DSN=") and "WALBUS_KAFKA_BOOTSTRAP=127.0.0.1:" in env.stdout
        # `up` shows where PostgreSQL is, not its password (only `env` hands that out)
        password = info["postgres"]["dsn"].split("@")[0].rpartition(":")[2]
        assert len(password) >= 16 and password in env.stdout
        assert password not in up.stdout + again.stdout and ":***@" in up.stdout
        down = subprocess.run([*walbus, "down"], capture_output=True, text=True, timeout=120)
        assert down.returncode == 0 and "postgres" in down.stdout and "kafka" in down.stdout
        status = subprocess.run([*walbus, "status"], capture_output=True, text=True, timeout=60)
        assert status.returncode == 3
    shutil.rmtree(state, ignore_errors=True)
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or not pid_alive(int(pid), str(state))


def test_dev_cli_corrupt_state_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "stack.json").write_text("{not json")
    res = subprocess.run(
        [sys.executable, "-m", "walbus.app.cli", "dev", "--state-dir", str(tmp_path), "up"],
        capture_output=True, text=True, timeout=60,
    )
    assert res.returncode == 2
    assert "corrupt" in res.stderr and "Traceback" not in res.stderr
