"""A load's slice fetched by the decoding workers (warehouse.fetch) against Spark's Kafka
source: the same records, the same tables; a split that cannot be read whole fails."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete
from aiokafka.errors import OffsetOutOfRangeError

from tests.support.kafka import create_topic, produce
from tests.support.warehouse import Txn, kafka_options, produce_events, produce_records, table_paths
from warehouse import fetch
from warehouse.fetch import FetchError, Split, slice_splits, split_batches
from warehouse.job import LoadSpec, run_load
from warehouse.read import read_slice, topic_bounds

pytestmark = [pytest.mark.spark, pytest.mark.integration]

TX = "public.transactions"
TX_PK = ["transaction_id"]


def _row(tid: int, amount: int) -> dict[str, tuple[str, Any]]:
    return {"transaction_id": ("int4", tid), "amount": ("int4", amount)}


def _fetched(bootstrap: str, topic: str, splits: list[Split]) -> list[tuple[int, int, bytes | None, bytes | None]]:
    loop = asyncio.new_event_loop()
    try:
        out = []
        for split in splits:
            for batch in split_batches(loop, kafka_options(bootstrap), topic, split):
                out += list(zip(*(batch.column(c).to_pylist() for c in ("partition", "offset", "key", "value")), strict=True))
        return out
    finally:
        loop.close()


async def _transactions(bootstrap: str, topic: str) -> None:
    """A committed transaction, an aborted one and one left open's records, gzip batches
    among them, then plain records: markers and aborted data in the offsets."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, transactional_id=f"{topic}-tx", compression_type="gzip")
    await producer.start()
    try:
        for n, commit in enumerate((True, False, True)):
            async with producer.transaction() if commit else _aborting(producer):
                for p in (0, 1):
                    for i in range(3):
                        await producer.send_and_wait(topic, key=b"k%d" % i, value=b"txn %d %d" % (n, i), partition=p)
    finally:
        await producer.stop()
    await produce(bootstrap, topic, [(b"k", b"plain %d" % i) for i in range(5)], partition=1)


class _aborting:
    def __init__(self, producer: AIOKafkaProducer) -> None:
        self.producer = producer

    async def __aenter__(self) -> None:
        await self.producer.begin_transaction()

    async def __aexit__(self, *exc: object) -> None:
        await self.producer.abort_transaction()


def test_the_workers_fetch_the_records_sparks_source_reads(spark: Any, kafka_bootstrap: str, unique_name: str) -> None:
    asyncio.run(create_topic(kafka_bootstrap, unique_name, partitions=2))
    asyncio.run(_transactions(kafka_bootstrap, unique_name))
    bounds = topic_bounds(kafka_options(kafka_bootstrap), unique_name)
    for start in (dict(bounds.earliest), {0: 2, 1: 5}):  # a whole topic, and a slice of it
        theirs = read_slice(spark, kafka_options(kafka_bootstrap), unique_name, start, dict(bounds.latest))
        expected = sorted(
            (r["partition"], r["offset"], r["key"], r["value"])
            for r in theirs.select("partition", "offset", "key", "value").collect()
        )
        for parallelism in (1, 3, 40):  # more splits than records, too
            got = _fetched(kafka_bootstrap, unique_name, slice_splits(start, dict(bounds.latest), parallelism))
            assert got == expected
        # aborted data is read by both (Spark's source reads uncommitted), markers by neither
        assert any(v == b"txn 1 0" for *_, v in expected)
        assert len({o for p, o, *_ in expected if p == 0}) == len([1 for p, *_ in expected if p == 0])


def test_a_load_through_the_workers_writes_the_tables_sparks_source_writes(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    events = []
    for i in range(30):
        events += Txn(0x1000 + i * 0x100, xid=700 + i).insert(TX, TX_PK, _row(i, i)).events
    events += Txn(0x4000).update(TX, TX_PK, _row(3, 33)).delete(TX, TX_PK, {"transaction_id": ("int4", 4)}).events
    produce_events(kafka_bootstrap, unique_name, events + events[:7])  # a re-sent piece
    produce_records(kafka_bootstrap, unique_name, [(b"x", b"not an event")])
    later = Txn(0x5000).update(TX, TX_PK, _row(5, 55)).insert(TX, TX_PK, _row(99, 9)).events

    def tables(reader: str) -> Any:
        warehouse = tmp_path / reader
        spec = LoadSpec(kafka_options(kafka_bootstrap), unique_name, str(warehouse), skip_invalid=True, slice_reader=reader)
        results = [run_load(spark, spec)]
        if reader == "workers":
            produce_events(kafka_bootstrap, unique_name, later)
        results.append(run_load(spark, spec))  # a second load from where the first stopped
        paths = table_paths(warehouse, unique_name, TX)
        history = spark.read.format("delta").load(paths.history).orderBy("pg_commit_lsn", "pg_seq")
        current = spark.read.format("delta").load(paths.current).orderBy("transaction_id")
        return [r.events for r in results], [r.quarantined for r in results], history.collect(), current.collect()

    ours, theirs = tables("workers"), tables("spark")  # theirs: one load of it all, and one of nothing
    assert ours[0] == [len(events) + 7, len(later)] and ours[1] == [1, 0]
    assert theirs[0] == [len(events) + 7 + len(later), 0] and theirs[1] == [1, 0]
    assert ours[2:] == theirs[2:]
    assert len(ours[2]) == len(events) + len(later)  # the re-sent events once
    assert {r["transaction_id"]: r["amount"] for r in ours[3] if not r["_walbus_deleted"]}[5] == 55


def test_a_split_whose_records_were_deleted_fails(kafka_bootstrap: str, unique_name: str) -> None:
    asyncio.run(create_topic(kafka_bootstrap, unique_name))
    asyncio.run(produce(kafka_bootstrap, unique_name, [(b"k", b"v%d" % i) for i in range(10)], partition=0))

    async def delete_first(n: int) -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        await admin.start()
        try:
            await admin.delete_records({TopicPartition(unique_name, 0): RecordsToDelete(n)})
        finally:
            await admin.close()

    asyncio.run(delete_first(4))  # after the load planned 0..10: retention got there first
    with pytest.raises(OffsetOutOfRangeError):
        _fetched(kafka_bootstrap, unique_name, [Split(0, 0, 10)])
    assert [o for _, o, *_ in _fetched(kafka_bootstrap, unique_name, [Split(0, 4, 10)])] == list(range(4, 10))


def test_a_split_whose_records_stop_coming_fails(
    kafka_bootstrap: str, unique_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    asyncio.run(create_topic(kafka_bootstrap, unique_name))
    asyncio.run(produce(kafka_bootstrap, unique_name, [(b"k", b"v%d" % i) for i in range(3)], partition=0))
    monkeypatch.setattr(fetch, "STALL_S", 2.0)
    with pytest.raises(FetchError, match="no records past offset 3 for 2 s"):
        _fetched(kafka_bootstrap, unique_name, [Split(0, 0, 5)])
