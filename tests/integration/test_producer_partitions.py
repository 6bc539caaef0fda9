"""A multi-partition database topic: each table's events go where any Kafka client's default
partitioner puts the key ``schema.table`` (walbus.kafka.partition_for)."""

from __future__ import annotations

import orjson
import psycopg
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.partitioner import DefaultPartitioner

from tests.support.kafka import read_topic
from tests.support.pipeline import running_producer

pytestmark = pytest.mark.integration

PARTITIONS = 4


async def _tables_by_partition(bootstrap: str, topic: str, partitions: int = PARTITIONS) -> dict[str, set[int]]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        seen: dict[str, set[int]] = {}
        for tp in tps:
            while await consumer.position(tp) < ends[tp]:
                for m in (await consumer.getmany(tp, timeout_ms=1000)).get(tp, []):
                    assert m.value is not None
                    seen.setdefault(orjson.loads(m.value)["table"], set()).add(tp.partition)
        return seen
    finally:
        await consumer.stop()


async def test_table_partition_is_kafkas_default_for_the_table_name(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    tables = [f"t{i}" for i in range(8)]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for t in tables:
            conn.execute(f"CREATE TABLE {t} (id int PRIMARY KEY)")
    async with running_producer(pg_dsn, kafka_bootstrap, topic=unique_name, partitions=PARTITIONS):
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            for t in tables:
                conn.execute(f"INSERT INTO {t} VALUES (1), (2)")
                conn.execute(f"UPDATE {t} SET id = 3 WHERE id = 2")
        await read_topic(kafka_bootstrap, unique_name, min_count=3 * len(tables))
    seen = await _tables_by_partition(kafka_bootstrap, unique_name)
    java_default = DefaultPartitioner()
    everything = list(range(PARTITIONS))
    expected = {f"public.{t}": {java_default(f"public.{t}".encode(), everything, everything)} for t in tables}
    assert seen == expected
    assert len(set().union(*seen.values())) > 1  # the tables are spread, not all in one partition


def _kafkas_partition(table: str, partitions: int) -> int:
    everything = list(range(partitions))
    return int(DefaultPartitioner()(table.encode(), everything, everything))


async def test_partitions_added_later_are_used_only_when_asked(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    # With partitions added, a restarted producer moved most tables to another partition: the
    # demux read a table's new events before its last old ones (a delete applied before an older
    # insert brought the row back; a fuzz). The count recorded at the first start is kept.
    from aiokafka.admin import AIOKafkaAdminClient, NewPartitions

    tables = [f"t{i}" for i in range(8)]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for t in tables:
            conn.execute(f"CREATE TABLE {t} (id int PRIMARY KEY)")

    async def write_each(n: int, **options: object) -> None:
        async with running_producer(pg_dsn, kafka_bootstrap, topic=unique_name, slot=unique_name, **options):
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                for t in tables:
                    conn.execute(f"INSERT INTO {t} VALUES ({n})")
            await read_topic(kafka_bootstrap, unique_name, min_count=n * len(tables))

    await write_each(1, partitions=2)
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        await admin.create_partitions({unique_name: NewPartitions(total_count=4)})
    finally:
        await admin.close()
    await write_each(2)
    at_first = {f"public.{t}": {_kafkas_partition(f"public.{t}", 2)} for t in tables}
    assert await _tables_by_partition(kafka_bootstrap, unique_name, 4) == at_first

    await write_each(3, repartition=True)
    now = {f"public.{t}": at_first[f"public.{t}"] | {_kafkas_partition(f"public.{t}", 4)} for t in tables}
    assert await _tables_by_partition(kafka_bootstrap, unique_name, 4) == now
    assert any(len(parts) == 2 for parts in now.values())  # some table did move


async def test_repartition_while_another_slot_streams_is_refused(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    # The other slot went on writing with the old count, so every moved table was in two
    # partitions at once (a re-fuzz). Its producer must be stopped first.
    from aiokafka.admin import AIOKafkaAdminClient, NewPartitions

    from walbus.config import ConfigError

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
    async with running_producer(pg_dsn, kafka_bootstrap, topic=unique_name, slot=f"{unique_name}_a", partitions=2):
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        await admin.start()
        try:
            await admin.create_partitions({unique_name: NewPartitions(total_count=4)})
        finally:
            await admin.close()
        with pytest.raises(ConfigError, match=f"--repartition while other slots of topic {unique_name} stream \\({unique_name}_a\\)"):
            async with running_producer(pg_dsn, kafka_bootstrap, topic=unique_name, slot=f"{unique_name}_b", repartition=True):
                pass
    # Stopped, it no longer stands in the way.
    async with running_producer(pg_dsn, kafka_bootstrap, topic=unique_name, slot=f"{unique_name}_b", repartition=True):
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO t VALUES (1)")
        await read_topic(kafka_bootstrap, unique_name, min_count=1)


async def test_a_count_decided_by_another_slot_while_reconnecting_stops_this_producer(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str
) -> None:
    # Another slot's --repartition ran while this producer was reconnecting (its slot inactive,
    # so the check for streaming slots passed): this one came back with the old count, and new
    # rows of moved tables went into two partitions (a re-fuzz). It now stops, exit 2.
    import asyncio

    from aiokafka import AIOKafkaProducer

    from producer.config import ProducerConfig
    from producer.offsets import progress_topic
    from producer.service import Producer
    from walbus.config import ConfigError

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
    slot = f"{unique_name}_a"
    producer = Producer(ProducerConfig(pg_dsn=pg_dsn, kafka_bootstrap=kafka_bootstrap, topic=unique_name, slot=slot,
                                       partitions=2, heartbeat_interval=1.0))
    task = asyncio.create_task(producer.run())
    try:
        async with asyncio.timeout(60):
            await producer.ready.wait()
        assert producer.offsets is not None
        theirs = {**producer.offsets.doc, "slot": f"{unique_name}_b", "partitions": 4, "partitions_since": 1}
        raw = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
        await raw.start()
        try:
            await raw.send_and_wait(progress_topic(unique_name), key=f"{unique_name}_b".encode(), value=orjson.dumps(theirs))
        finally:
            await raw.stop()
        with psycopg.connect(pg_dsn, autocommit=True) as conn:  # the stream breaks: it reconnects
            conn.execute("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = %s", (slot,))
        with pytest.raises(ConfigError, match=f"slot '{unique_name}_b' changed the partition count of topic {unique_name}"):
            await asyncio.wait_for(asyncio.shield(task), 60)
    finally:
        producer.stop()
        await asyncio.gather(task, return_exceptions=True)
