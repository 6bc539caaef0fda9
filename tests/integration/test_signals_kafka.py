"""The Kafka signal channel (--signal-topic) against the real broker: records for this
producer are applied in order and once across a restart, others' are passed over,
malformed ones are counted and skipped."""

from __future__ import annotations

import orjson
import psycopg
import pytest

from producer.config import ProducerConfig
from producer.service import Producer
from tests.integration.test_signals_snapshot import SIGNAL_DDL, events_of, sql, wait_sample
from tests.support.kafka import create_topic, produce
from tests.support.pipeline import running_producer
from tests.support.snapshot import wait_slot_caught_up
from walbus.config import ConfigError

pytestmark = pytest.mark.integration


def execute(*tables: str, **extra: object) -> bytes:
    return orjson.dumps({"type": "execute-snapshot", "data": {"data-collections": list(tables), **extra}})


async def test_signals_from_kafka_once_across_a_restart(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    sql(pg_dsn, "CREATE TABLE orders (id int PRIMARY KEY, v text)", "CREATE TABLE items (id int PRIMARY KEY, v text)",
        "INSERT INTO orders SELECT g, 'o' || g FROM generate_series(1, 500) g",
        "INSERT INTO items SELECT g, 'i' || g FROM generate_series(1, 300) g")
    signals = f"{unique_name}.signals"
    own = unique_name.encode()  # the producer's database topic name
    options = {"topic": unique_name, "slot": unique_name, "snapshot_mode": "never", "signal_topic": signals,
               "incremental_chunk_size": 50, "heartbeat_interval": 0.5}
    async with running_producer(pg_dsn, kafka_bootstrap, **options) as first:
        await produce(kafka_bootstrap, signals, [
            (b"walbus.some_other_db", execute("public.items")),  # another producer's
            (own, b"{not json"),
            (own, orjson.dumps({"type": "execute-snapshot", "data": [1]})),
            (own, execute("public.orders", **{"additional-conditions": [{"data-collection": "public.orders", "filter": "id > 400"}]})),
        ])
        reg = first.registry
        await wait_sample(reg, "walbus_snapshot_completed", {"kind": "incremental"}, 1)
        assert reg.get_sample_value("walbus_snapshot_ignored_signals_total", {"kind": "signal-topic"}) == 2
        await wait_slot_caught_up(pg_dsn, unique_name)
    async with running_producer(pg_dsn, kafka_bootstrap, **options) as second:
        # Data as JSON text (the signal table's column) works too.
        await produce(kafka_bootstrap, signals, [(own, orjson.dumps({"type": "execute-snapshot", "data": '{"data-collections": ["public.items"]}'}))])
        reg = second.registry
        await wait_sample(reg, "walbus_snapshot_completed", {"kind": "incremental"}, 1)
        # Signals apply in order: had the first producer's records been applied again, orders
        # (and the malformed records) would have come before items.
        assert reg.get_sample_value("walbus_snapshot_rows_scanned_total", {"kind": "incremental", "table": "public.orders"}) is None
        assert reg.get_sample_value("walbus_snapshot_ignored_signals_total", {"kind": "signal-topic"}) is None
        await wait_slot_caught_up(pg_dsn, unique_name)
    reads = [(e["table"], e["values"][0]) for e in await events_of(kafka_bootstrap, unique_name) if e["operation"] == "read"]
    assert sorted(reads) == sorted([("public.orders", i) for i in range(401, 501)] + [("public.items", i) for i in range(1, 301)])


async def test_a_signal_topic_with_several_partitions_is_refused(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    signals = f"{unique_name}.signals"
    await create_topic(kafka_bootstrap, signals, partitions=2)
    cfg = ProducerConfig(pg_dsn=pg_dsn, kafka_bootstrap=kafka_bootstrap, topic=unique_name, slot=unique_name,
                         snapshot_mode="never", signal_topic=signals)
    with pytest.raises(ConfigError, match="one partition"):
        await Producer(cfg).run()


async def test_signal_table_and_topic_together(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    """Both channels feed one snapshot: a pause from Kafka holds a snapshot the table started."""
    sql(pg_dsn, SIGNAL_DDL, "CREATE TABLE orders (id int PRIMARY KEY, v text)",
        "INSERT INTO orders SELECT g, 'o' || g FROM generate_series(1, 10000) g")
    signals = f"{unique_name}.signals"
    own = unique_name.encode()
    async with running_producer(
        pg_dsn, kafka_bootstrap, topic=unique_name, slot=unique_name, snapshot_mode="never", signal_topic=signals,
        signal_table="public.walbus_signal", incremental_chunk_size=10, heartbeat_interval=0.5,
    ) as producer:
        reg = producer.registry
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("""INSERT INTO walbus_signal VALUES ('s1', 'execute-snapshot', '{"data-collections": ["public.orders"]}')""")
        await wait_sample(reg, "walbus_snapshot_chunks_total", {"table": "public.orders"}, 2)
        await produce(kafka_bootstrap, signals, [(own, orjson.dumps({"type": "pause-snapshot"}))])
        await wait_sample(reg, "walbus_snapshot_paused", {"kind": "incremental"}, 1)
        await produce(kafka_bootstrap, signals, [(own, orjson.dumps({"type": "resume-snapshot", "data": {}}))])
        await wait_sample(reg, "walbus_snapshot_completed", {"kind": "incremental"}, 1)
        await wait_slot_caught_up(pg_dsn, unique_name)
    reads = sorted(e["values"][0] for e in await events_of(kafka_bootstrap, unique_name) if e["operation"] == "read")
    assert set(reads) == set(range(1, 10001))


async def test_a_signal_of_an_aborted_kafka_transaction_is_not_applied(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    """A record of an aborted transaction was never written, as far as Kafka's readers go:
    the channel read uncommitted, so a signal some tool wrote in a transaction it then aborted
    snapshotted its tables all the same."""
    from aiokafka import AIOKafkaProducer

    sql(pg_dsn, "CREATE TABLE orders (id int PRIMARY KEY)", "CREATE TABLE items (id int PRIMARY KEY)",
        "INSERT INTO orders SELECT generate_series(1, 20)", "INSERT INTO items SELECT generate_series(1, 30)")
    signals = f"{unique_name}.signals"
    own = unique_name.encode()
    await create_topic(kafka_bootstrap, signals)
    tx = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, transactional_id=f"{unique_name}-tx", acks="all", enable_idempotence=True)
    await tx.start()
    try:
        await tx.begin_transaction()
        await (await tx.send(signals, execute("public.items"), key=own, partition=0))
        await tx.abort_transaction()
    finally:
        await tx.stop()
    await produce(kafka_bootstrap, signals, [(own, execute("public.orders"))], partition=0)
    options = {"topic": unique_name, "slot": unique_name, "snapshot_mode": "never", "signal_topic": signals, "heartbeat_interval": 0.5}
    async with running_producer(pg_dsn, kafka_bootstrap, **options) as producer:
        reg = producer.registry
        await wait_sample(reg, "walbus_snapshot_completed", {"kind": "incremental"}, 1)
        assert reg.get_sample_value("walbus_snapshot_rows_scanned_total", {"kind": "incremental", "table": "public.orders"}) == 20
        assert reg.get_sample_value("walbus_snapshot_rows_scanned_total", {"kind": "incremental", "table": "public.items"}) is None
        await wait_slot_caught_up(pg_dsn, unique_name)
