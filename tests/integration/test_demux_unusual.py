"""The demux on legal but unusual input (issue 13): table names that are not topic-safe, keys that
are not the event's position, rows larger than Kafka's default limit. Real broker, no mocks."""

from __future__ import annotations

import asyncio
import random
import string
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaProducer, TopicPartition

from demux.config import parse_config
from demux.service import Demux
from tests.support.demux import (
    DemuxProc,
    _reap_demux_processes,  # noqa: F401
    demux_args,
    ev,
)
from tests.support.kafka import (
    commit_offset,
    create_topic,
    end_offsets,
    list_topics,
    produce,
    read_ktable,
    read_records,
    topic_config,
    wait_caught_up,
)
from walbus.contract import demux_group, qualify_table, table_topic
from walbus.kafka import DEFAULT_MAX_MESSAGE_BYTES, KafkaAdmin

pytestmark = pytest.mark.integration

INTS = {"id": "int4", "n": "int4"}


def _rows(records: list[Any]) -> list[tuple[bytes | None, dict[str, Any] | None]]:
    """(key, row without metadata) of each record."""
    return [(r.key, None if r.value is None else
             {k: v for k, v in orjson.loads(r.value).items() if not k.startswith("__")}) for r in records]


async def _run_demux(bootstrap: str, source: str, tmp_path: Path, name: str) -> tuple[dict[str, float], DemuxProc]:
    """One demux until it committed the whole source topic; its metrics and process (stopped)."""
    proc = DemuxProc(demux_args(bootstrap, source, tmp_path / "state"), tmp_path / f"{name}.log").start()
    try:
        await wait_caught_up(bootstrap, demux_group(source), source, procs=[proc])
        metrics = proc.settled_metrics(sum((await end_offsets(bootstrap, source)).values()))
    finally:
        assert proc.stop() == 0, proc.log_tail()
    return metrics, proc


async def test_table_names_that_are_not_topic_safe(kafka_bootstrap: str, unique_name: str, tmp_path: Path) -> None:
    """Every table gets a topic: escaped names, hashed ones when too long or colliding; nothing stalls."""
    source = f"walbus.{unique_name}"
    database = unique_name
    await create_topic(kafka_bootstrap, source)
    tables = [
        ("public", "Order Items"), ("public", "ö"), ("public", 'a"b'), ("public", "a.b"), ("public", "a_b"),
        ("public", "n" * 63), ("s" * 63, "t" * 63 + "ü" * 20),  # > 249 characters once escaped
        ("public_c", "d"), ("public", "c_d"),  # one topic name to Kafka ('.' = '_'): the second is hashed
    ]
    events = [ev(0x100 * (i + 1), 0, "insert", qualify_table(schema, table), ["id"], new={"id": i, "n": i},
                 types=INTS) for i, (schema, table) in enumerate(tables)]
    # Second events, for the path that knows the topics already.
    events += [ev(0x10000 + 0x100 * i, 0, "update", qualify_table(schema, table), ["id"],
                  new={"id": i, "n": -i}, types=INTS) for i, (schema, table) in enumerate(tables)]
    # A topic that cannot take its table's records (keyless rows, compacted topic): DLQ, the rest goes on.
    await create_topic(kafka_bootstrap, f"{source}.public.nopk", configs={"cleanup.policy": "compact"})
    unusable = ev(0x380, 0, "insert", "public.nopk", [], new={"msg": "m"})
    await produce(kafka_bootstrap, source, [*events[:3], unusable, *events[3:]], partition=0)
    metrics, proc = await _run_demux(kafka_bootstrap, source, tmp_path, "demux")

    topics = await list_topics(kafka_bootstrap)
    assert [(r.key, r.value) for r in await read_records(kafka_bootstrap, f"{source}.dlq")] == [unusable]
    assert metrics["walbus_demux_dead_letters_total{reason=topic}"] == 1
    assert metrics["walbus_demux_unwritten_outputs_total{reason=topic,table=public.nopk}"] == 1
    for i, (schema, table) in enumerate(tables):
        topic = table_topic("walbus", database, schema, table, hashed=(schema, table) == ("public", "c_d"))
        assert len(topic) <= 249
        assert topic in topics, (schema, table, topic)
        assert _rows(await read_records(kafka_bootstrap, topic)) == [
            (b'{"id":%d}' % i, {"id": i, "n": i}), (b'{"id":%d}' % i, {"id": i, "n": -i})]
    assert table_topic("walbus", database, "public", "Order Items") == f"{source}.public.Order-20Items"
    hashed = [line for line in proc.log_lines() if line.get("msg", "").startswith("table's topic name collides")]
    assert [(line["table"], line["topic"]) for line in hashed] == [
        ("public.c_d", table_topic("walbus", database, "public", "c_d", hashed=True))]
    assert metrics["walbus_demux_records_produced_total{table=public.c_d}"] == 2


@pytest.mark.parametrize("old_group", [False, True])
async def test_a_record_with_a_high_key_moves_no_position(kafka_bootstrap: str, unique_name: str,
                                                          tmp_path: Path, old_group: bool) -> None:
    """A record keyed FFFF… that is not the event at that position must not make later events replays."""
    source = f"walbus.{unique_name}"
    await create_topic(kafka_bootstrap, source)
    good = [ev(0xAB00 + 0x100 * i, 0, "insert", "public.nums", ["id"], new={"id": i, "n": i}, types=INTS)
            for i in range(6)]
    high = b"FFFFFFFFFFFFFFFF-FFFFFFFF"
    bad = [
        (high, b"garbage"),
        (high, good[2][1]),  # a valid event under another position's key
        (good[2][0].lower(), good[2][1]),  # its own position, not in the contract's form
        (None, good[2][1]),
    ]
    await produce(kafka_bootstrap, source, [good[0], good[1], *bad, good[2], good[3]], partition=0)
    metrics, _ = await _run_demux(kafka_bootstrap, source, tmp_path, "demux")
    keys = [r.key for r in await read_records(kafka_bootstrap, f"{source}.public.nums")]
    assert keys == [b'{"id":%d}' % i for i in range(4)]
    dlq = await read_records(kafka_bootstrap, f"{source}.dlq")
    assert [(r.key, r.value) for r in dlq] == [(k, v) for k, v in bad]
    assert metrics["walbus_demux_dead_letters_total{reason=contract}"] == 4
    assert "walbus_demux_replayed_skipped_total" not in metrics or metrics["walbus_demux_replayed_skipped_total"] == 0

    # After a restart the committed position is good[3]'s; a group committed without it (an
    # older demux) looks back before the committed offset and reads the bad records again:
    # they must not teach it a position either.
    if old_group:
        await commit_offset(kafka_bootstrap, demux_group(source), TopicPartition(source, 0), 8)
    await produce(kafka_bootstrap, source, good[4:], partition=0)
    await _run_demux(kafka_bootstrap, source, tmp_path, "demux2")
    keys = [r.key for r in await read_records(kafka_bootstrap, f"{source}.public.nums")]
    assert keys == [b'{"id":%d}' % i for i in range(6)]


async def test_a_table_created_again_without_key_sends_its_rows_to_the_dlq(kafka_bootstrap: str, unique_name: str,
                                                                           tmp_path: Path) -> None:
    """Its keyed namesake made the topic compacted. The running demux had cached that topic as
    writable: the broker refused the keyless rows and the worker reopened on them forever, every
    table of the partition stalled (a fuzz). Created again with a key, it is written again."""
    source = f"walbus.{unique_name}"
    await create_topic(kafka_bootstrap, source)
    await produce(kafka_bootstrap, source, [ev(0x100, 0, "insert", "public.re", ["id"], new={"id": 1, "n": 1}, types=INTS)],
                  partition=0)
    proc = DemuxProc(demux_args(kafka_bootstrap, source, tmp_path / "state"), tmp_path / "demux.log").start()
    try:
        await wait_caught_up(kafka_bootstrap, demux_group(source), source, procs=[proc])
        keyless = ev(0x200, 0, "insert", "public.re", [], new={"id": 2, "n": 2}, types=INTS)
        later = [ev(0x200, 1, "insert", "public.other", ["id"], new={"id": 3, "n": 3}, types=INTS),
                 ev(0x300, 0, "insert", "public.re", ["id"], new={"id": 4, "n": 4}, types=INTS)]
        await produce(kafka_bootstrap, source, [keyless, *later], partition=0)
        await wait_caught_up(kafka_bootstrap, demux_group(source), source, within=60, procs=[proc])
    finally:
        assert proc.stop() == 0, proc.log_tail()
    assert [(r.key, r.value) for r in await read_records(kafka_bootstrap, f"{source}.dlq")] == [keyless]
    assert [r.key for r in await read_records(kafka_bootstrap, f"{source}.public.re")] == [b'{"id":1}', b'{"id":4}']
    assert [r.key for r in await read_records(kafka_bootstrap, f"{source}.public.other")] == [b'{"id":3}']


async def test_a_table_topic_deleted_while_running_is_created_again(kafka_bootstrap: str, unique_name: str,
                                                                    tmp_path: Path) -> None:
    """Its batch could never be acknowledged: the commit waited for it forever, and every table of
    the partition with it, SIGTERM unanswered (a fuzz). Now the commit fails after the
    transaction timeout and the reopened worker creates the topic again."""
    source = f"walbus.{unique_name}"
    await create_topic(kafka_bootstrap, source)
    row = {"id": 1, "n": 1}
    await produce(kafka_bootstrap, source, [ev(0x100, 0, "insert", "public.a", ["id"], new=row, types=INTS),
                                            ev(0x100, 1, "insert", "public.b", ["id"], new=row, types=INTS)], partition=0)
    args = demux_args(kafka_bootstrap, source, tmp_path / "state", "--transaction-timeout-ms", "8000")
    proc = DemuxProc(args, tmp_path / "demux.log").start()
    try:
        await wait_caught_up(kafka_bootstrap, demux_group(source), source, procs=[proc])
        async with KafkaAdmin(client_kwargs={"bootstrap_servers": kafka_bootstrap}) as admin:
            await admin.delete_topics([f"{source}.public.a"])
        row = {"id": 2, "n": 2}
        await produce(kafka_bootstrap, source, [ev(0x200, 0, "insert", "public.a", ["id"], new=row, types=INTS),
                                                ev(0x200, 1, "insert", "public.b", ["id"], new=row, types=INTS)],
                      partition=0)
        await wait_caught_up(kafka_bootstrap, demux_group(source), source, within=90, procs=[proc])
    finally:
        assert proc.stop() == 0, proc.log_tail()
    assert [r.key for r in await read_records(kafka_bootstrap, f"{source}.public.a")] == [b'{"id":2}']
    assert [r.key for r in await read_records(kafka_bootstrap, f"{source}.public.b")] == [b'{"id":1}', b'{"id":2}']
    assert "never retrieved" not in proc.log_tail(200_000)


async def test_a_table_topic_deleted_while_it_is_loaded_reads_as_empty(kafka_bootstrap: str, unique_name: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The last-row store's load of a topic deleted after its partitions were looked up waited
    for the consumer's 40 s request timeout, twice, and a SIGTERM with it (a re-fuzz)."""
    import time

    import demux.ktable as ktable

    topic = f"{unique_name}.public.t"
    await create_topic(kafka_bootstrap, topic)
    await produce(kafka_bootstrap, topic, [(b'{"id":1}', b'{"id":1}')])
    looked_up = ktable.topic_partitions

    async def then_deleted(*args: Any, **kwargs: Any) -> Any:
        partitions = await looked_up(*args, **kwargs)
        async with KafkaAdmin(client_kwargs={"bootstrap_servers": kafka_bootstrap}) as admin:
            await admin.delete_topics([topic])
        monkeypatch.setattr(ktable, "topic_partitions", looked_up)
        return partitions

    monkeypatch.setattr(ktable, "topic_partitions", then_deleted)
    started = time.monotonic()
    assert await ktable.read_ktable_raw(client_kwargs={"bootstrap_servers": kafka_bootstrap}, topic=topic) == {}
    assert time.monotonic() - started < 2 * ktable.END_OFFSETS_S + 5


def _text(size: int, seed: int) -> str:
    """Incompressible text of ``size`` characters."""
    rnd = random.Random(seed)
    return "".join(rnd.choices(string.ascii_letters + string.digits, k=size))


async def test_large_rows(kafka_bootstrap: str, unique_name: str, tmp_path: Path) -> None:
    """A 2 MB row reaches its topic whole; a row over its topic's limit goes to the DLQ, whole and loudly,
    and a later update that leaves that row's TOAST value unchanged does not publish the old value."""
    source = f"walbus.{unique_name}"
    limit = str(DEFAULT_MAX_MESSAGE_BYTES)
    await create_topic(kafka_bootstrap, source, configs={"max.message.bytes": limit})
    # An existing per-table topic with a smaller limit than the row will need.
    small = f"{source}.public.small"
    await create_topic(kafka_bootstrap, small, configs={"cleanup.policy": "compact", "max.message.bytes": "300000"})
    body2m, body100k, body400k = _text(2_000_000, 1), _text(100_000, 2), _text(400_000, 3)
    events = [
        ev(0x100, 0, "insert", "public.big", ["id"], new={"id": 1, "body": body2m, "n": 0}, types=INTS),
        ev(0x100, 1, "insert", "public.big", ["id"], new={"id": 2, "body": "b", "n": 0}, types=INTS),
        ev(0x200, 0, "insert", "public.small", ["id"], new={"id": 1, "body": body100k, "n": 0}, types=INTS),
        ev(0x300, 0, "update", "public.small", ["id"], new={"id": 1, "body": body400k, "n": 1}, types=INTS),
        ev(0x400, 0, "update", "public.small", ["id"], new={"id": 1, "n": 2}, unchanged=["body"], types=INTS),
        ev(0x500, 0, "update", "public.big", ["id"], new={"id": 1, "n": 3}, unchanged=["body"], types=INTS),
        ev(0x600, 0, "update", "public.small", ["id"], new={"id": 1, "body": "new", "n": 4}, types=INTS),
        ev(0x700, 0, "update", "public.small", ["id"], new={"id": 1, "n": 5}, unchanged=["body"], types=INTS),
    ]
    await produce(kafka_bootstrap, source, events, partition=0)
    metrics, proc = await _run_demux(kafka_bootstrap, source, tmp_path, "demux")

    big = _rows(await read_records(kafka_bootstrap, f"{source}.public.big"))
    assert big == [(b'{"id":1}', {"id": 1, "body": body2m, "n": 0}), (b'{"id":2}', {"id": 2, "body": "b", "n": 0}),
                   (b'{"id":1}', {"id": 1, "body": body2m, "n": 3})]
    assert (await topic_config(kafka_bootstrap, f"{source}.public.big"))["max.message.bytes"] == limit
    assert (await topic_config(kafka_bootstrap, f"{source}.dlq"))["max.message.bytes"] == limit
    # The too-large update and the unchanged-TOAST update after it: DLQ, never the 100k body as current.
    assert _rows(await read_records(kafka_bootstrap, small)) == [
        (b'{"id":1}', {"id": 1, "body": body100k, "n": 0}), (b'{"id":1}', {"id": 1, "body": "new", "n": 4}),
        (b'{"id":1}', {"id": 1, "body": "new", "n": 5})]
    dlq = await read_records(kafka_bootstrap, f"{source}.dlq")
    assert [(r.key, r.value) for r in dlq] == [events[3], events[4]]  # whole source records
    errors = [dict(r.headers)["walbus.error"].decode() for r in dlq]
    assert "does not fit topic" in errors[0] and "max.message.bytes=300000" in errors[0]
    assert "unknown" in errors[1] and "does not fit" in errors[1]
    assert all("walbus.value.truncated" not in dict(r.headers) for r in dlq)
    assert metrics["walbus_demux_dead_letters_total{reason=size}"] == 1
    assert metrics["walbus_demux_dead_letters_total{reason=contract}"] == 1
    assert metrics["walbus_demux_unwritten_outputs_total{reason=size,table=public.small}"] == 1
    logged = [line for line in proc.log_lines() if line.get("msg", "").startswith("event's output cannot be written")]
    assert [(line["level"], line["table"], line["keys"]) for line in logged] == [
        ("error", "public.small", ['{"id":1}'])]


async def test_dead_letter_cut_to_its_topic_says_so(kafka_bootstrap: str, unique_name: str, tmp_path: Path) -> None:
    """A source record larger than an existing DLQ topic takes: cut to fit, with headers saying why."""
    source = f"walbus.{unique_name}"
    await create_topic(kafka_bootstrap, source, configs={"max.message.bytes": str(DEFAULT_MAX_MESSAGE_BYTES)})
    await create_topic(kafka_bootstrap, f"{source}.dlq", configs={"max.message.bytes": "100000"})
    junk = b"x" * 300_000
    after = ev(0x100, 0, "insert", "public.nums", ["id"], new={"id": 1, "n": 1}, types=INTS)
    await produce(kafka_bootstrap, source, [(b"junk", junk), after], partition=0)
    await _run_demux(kafka_bootstrap, source, tmp_path, "demux")
    dlq = await read_records(kafka_bootstrap, f"{source}.dlq")
    assert len(dlq) == 1 and dlq[0].key == b"junk" and junk.startswith(dlq[0].value) and len(dlq[0].value) > 90_000
    headers = dict(dlq[0].headers)
    assert headers["walbus.value.truncated"] == b"300000"
    assert b"max.message.bytes=100000" in headers["walbus.value.cut"] and b"not JSON" in headers["walbus.error"]
    assert [r.key for r in await read_records(kafka_bootstrap, f"{source}.public.nums")] == [b'{"id":1}']


async def test_postgres_tables_with_names_that_are_not_topic_safe(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    """The same from a real database through the producer (names without a dot or quote: the
    producer's own quoting of those is not the demux's; the test above covers them)."""
    import psycopg
    from psycopg import sql

    from tests.support.kafka import read_topic
    from tests.support.pipeline import running_producer

    tables = [
        ("public", "Order Items"), ("public", "ö"), ("public", "a_b"), ("public", "n" * 63),
        ("s" * 63, "ü" * 31),  # 63 + 62 bytes: > 249 characters once escaped
        ("public_c", "d"), ("public", "c_d"),  # one topic name to Kafka: the second is hashed
    ]
    source = f"walbus.{unique_name}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for schema, table in tables:
            conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
            conn.execute(sql.SQL("CREATE TABLE {} (id int4 PRIMARY KEY, note text)").format(
                sql.Identifier(schema, table)))
    async with running_producer(pg_dsn, kafka_bootstrap, topic=source):
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            for i, (schema, table) in enumerate(tables):
                name = sql.Identifier(schema, table)
                conn.execute(sql.SQL("INSERT INTO {} VALUES (%s, %s)").format(name), (i, f"row {i}"))
                conn.execute(sql.SQL("UPDATE {} SET note = %s WHERE id = %s").format(name), (f"new {i}", i))
        await read_topic(kafka_bootstrap, source, min_count=2 * len(tables))
    await _run_demux(kafka_bootstrap, source, tmp_path, "demux")
    for i, (schema, table) in enumerate(tables):
        topic = table_topic("walbus", unique_name, schema, table, hashed=(schema, table) == ("public", "c_d"))
        assert _rows(await read_records(kafka_bootstrap, topic)) == [
            (b'{"id":%d}' % i, {"id": i, "note": f"row {i}"}), (b'{"id":%d}' % i, {"id": i, "note": f"new {i}"})]
    assert f"{source}.dlq" not in await list_topics(kafka_bootstrap)


async def test_a_limit_lowered_while_running_sends_what_no_longer_fits_to_the_dlq(
    kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    """The demux reads a topic's limit once; when an operator lowers it, the broker's refusal must
    not make the worker reopen forever: the limit is read again and the record dead-lettered."""
    source = f"walbus.{unique_name}"
    await create_topic(kafka_bootstrap, source, configs={"max.message.bytes": str(DEFAULT_MAX_MESSAGE_BYTES)})
    first = ev(0x100, 0, "insert", "public.nums", ["id"], new={"id": 1, "n": 1}, types=INTS)
    await produce(kafka_bootstrap, source, [first], partition=0)
    proc = DemuxProc(demux_args(kafka_bootstrap, source, tmp_path / "state"), tmp_path / "demux.log").start()
    try:
        await wait_caught_up(kafka_bootstrap, demux_group(source), source, procs=[proc])
        async with KafkaAdmin(client_kwargs={"bootstrap_servers": kafka_bootstrap}) as admin:
            await admin.alter_topic_config(f"{source}.public.nums", {"max.message.bytes": "50000"})
        big = ev(0x200, 0, "insert", "public.nums", ["id"], new={"id": 2, "n": 2, "body": _text(100_000, 4)},
                 types={**INTS, "body": "text"})
        after = ev(0x300, 0, "insert", "public.nums", ["id"], new={"id": 3, "n": 3}, types=INTS)
        await produce(kafka_bootstrap, source, [big, after], partition=0)
        await wait_caught_up(kafka_bootstrap, demux_group(source), source, procs=[proc])
    finally:
        assert proc.stop() == 0, proc.log_tail()
    assert [r.key for r in await read_records(kafka_bootstrap, f"{source}.public.nums")] == [b'{"id":1}', b'{"id":3}']
    assert [(r.key, r.value) for r in await read_records(kafka_bootstrap, f"{source}.dlq")] == [big]


async def test_a_limit_raised_while_running_takes_the_row_that_did_not_fit(
    kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    """The other way: an operator raises a table topic's limit after a row went to the DLQ for
    it. The demux read the limit once, so until a restart every such row went to the DLQ (an
    operations fuzz); now a row too large for the limit as read makes it read the limit again."""
    from demux.topics import REFRESH_S

    source = f"walbus.{unique_name}"
    await create_topic(kafka_bootstrap, source, configs={"max.message.bytes": str(DEFAULT_MAX_MESSAGE_BYTES)})
    table = f"{source}.public.nums"
    await create_topic(kafka_bootstrap, table, configs={"cleanup.policy": "compact", "max.message.bytes": "50000"})
    types = {**INTS, "body": "text"}
    first = ev(0x100, 0, "insert", "public.nums", ["id"], new={"id": 1, "n": 1, "body": "x"}, types=types)
    too_big = ev(0x200, 0, "insert", "public.nums", ["id"], new={"id": 2, "n": 2, "body": _text(100_000, 4)}, types=types)
    await produce(kafka_bootstrap, source, [first, too_big], partition=0)
    proc = DemuxProc(demux_args(kafka_bootstrap, source, tmp_path / "state"), tmp_path / "demux.log").start()
    try:
        await wait_caught_up(kafka_bootstrap, demux_group(source), source, procs=[proc])
        async with KafkaAdmin(client_kwargs={"bootstrap_servers": kafka_bootstrap}) as admin:
            await admin.alter_topic_config(table, {"max.message.bytes": str(DEFAULT_MAX_MESSAGE_BYTES)})
        await asyncio.sleep(REFRESH_S)  # a limit is read again at most this often
        fits_now = ev(0x300, 0, "insert", "public.nums", ["id"], new={"id": 3, "n": 3, "body": _text(100_000, 5)}, types=types)
        await produce(kafka_bootstrap, source, [fits_now], partition=0)
        await wait_caught_up(kafka_bootstrap, demux_group(source), source, procs=[proc])
    finally:
        assert proc.stop() == 0, proc.log_tail()
    assert [r.key for r in await read_records(kafka_bootstrap, table)] == [b'{"id":1}', b'{"id":3}']
    assert [(r.key, r.value) for r in await read_records(kafka_bootstrap, f"{source}.dlq")] == [too_big]


@pytest.mark.parametrize("columns", ["code int4 NOT NULL, n int4", "code text NOT NULL, n text"])
async def test_a_replica_identity_using_another_index_keeps_the_table(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str, tmp_path: Path, columns: str
) -> None:
    """REPLICA IDENTITY USING INDEX on a unique index that is not the primary key: updates and
    deletes carry the index's columns only. The per-table topic must still end as SELECT *
    (deletes went to the DLQ and a key moved by an update left its old row behind), for a table
    of fixed-width columns (never kept in the store before) and one of text."""
    import psycopg

    from tests.support.pipeline import running_producer

    source = f"walbus.{unique_name}"
    def literal(i: int) -> str:  # a value of the code column
        return str(i) if columns.startswith("code int4") else f"'c{i}'"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE idx_t (id int4 PRIMARY KEY, {columns})")
        conn.execute("CREATE UNIQUE INDEX idx_t_code ON idx_t (code)")
        conn.execute("ALTER TABLE idx_t REPLICA IDENTITY USING INDEX idx_t_code")
        conn.execute("CREATE TABLE done (id int4 PRIMARY KEY)")
    async with running_producer(pg_dsn, kafka_bootstrap, topic=source):
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            for i in range(1, 6):
                conn.execute(f"INSERT INTO idx_t VALUES ({i}, {literal(i)}, NULL)")
            conn.execute("UPDATE idx_t SET id = 10 WHERE id = 1")  # the key moves
            conn.execute("UPDATE idx_t SET n = NULL, code = " + literal(20) + " WHERE id = 2")
            conn.execute("DELETE FROM idx_t WHERE id IN (3, 10)")
            with conn.transaction():  # in one transaction: the row inserted, moved, then deleted
                conn.execute(f"INSERT INTO idx_t VALUES (6, {literal(6)}, NULL)")
                conn.execute("UPDATE idx_t SET id = 7 WHERE id = 6")
                conn.execute("UPDATE idx_t SET id = 8 WHERE id = 4")
                conn.execute("DELETE FROM idx_t WHERE id = 7")
            conn.execute("INSERT INTO done VALUES (1)")
            expected = {b'{"id":%d}' % r[0]: r[0] for r in conn.execute("SELECT id FROM idx_t")}
        await read_records(kafka_bootstrap, source, min_count=14)  # the 14 changes above
    _, proc = await _run_demux(kafka_bootstrap, source, tmp_path, "demux")
    table: dict[bytes | None, int] = {}  # the topic read as a KTable: the last value of each key, tombstones removing it
    for m in await read_records(kafka_bootstrap, table_topic("walbus", unique_name, "public", "idx_t"), "read_committed"):
        if m.value is None:
            table.pop(m.key, None)
        else:
            table[m.key] = orjson.loads(m.value)["id"]
    assert sorted(expected) == [b'{"id":2}', b'{"id":5}', b'{"id":8}']
    assert table == expected, proc.log_tail()
    assert f"{source}.dlq" not in await list_topics(kafka_bootstrap)


async def test_a_timestamptz_key_keeps_its_key_when_the_databases_time_zone_changes(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    """A timestamptz primary key is text in the session's TimeZone: a database (or role, or
    server) whose time zone changes between a row's insert and its delete must not give the
    row another key, or the tombstone misses it and the deleted row stays in the table's topic."""
    import psycopg
    from psycopg import sql

    from tests.support.pipeline import running_producer

    source, slot = f"walbus.{unique_name}", f"{unique_name}_s"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("ALTER DATABASE {} SET timezone = 'UTC'").format(sql.Identifier(unique_name)))
        conn.execute("CREATE TABLE tz (at timestamptz PRIMARY KEY, n int4)")
        conn.execute("CREATE TABLE done (id int4 PRIMARY KEY)")
    options: dict[str, Any] = {"topic": source, "slot": slot, "snapshot_mode": "never"}
    async with running_producer(pg_dsn, kafka_bootstrap, **options):
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO tz VALUES ('2024-01-02 01:04:05.5+00', 1), ('2024-06-01 00:00:00+00', 1)")
        await read_records(kafka_bootstrap, source, min_count=2)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("ALTER DATABASE {} SET timezone = 'Asia/Tokyo'").format(sql.Identifier(unique_name)))
    async with running_producer(pg_dsn, kafka_bootstrap, **options):
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("UPDATE tz SET n = 2 WHERE at = '2024-06-01 00:00:00+00'")
            conn.execute("DELETE FROM tz WHERE at = '2024-01-02 01:04:05.5+00'")
            conn.execute("INSERT INTO done VALUES (1)")
        await read_records(kafka_bootstrap, source, min_count=5)
    _, proc = await _run_demux(kafka_bootstrap, source, tmp_path, "demux")
    table: dict[bytes | None, int] = {}  # the topic read as a KTable
    for m in await read_records(kafka_bootstrap, table_topic("walbus", unique_name, "public", "tz"), "read_committed"):
        if m.value is None:
            table.pop(m.key, None)
        else:
            table[m.key] = orjson.loads(m.value)["n"]
    assert table == {b'{"at":"2024-06-01 00:00:00+00"}': 2}, proc.log_tail()


async def test_a_truncate_of_more_keys_than_a_transaction_takes_is_committed_in_parts(
    kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    """A truncate's tombstones (one per key) go out in Kafka transactions of --txn-max-records:
    in one transaction, a large table's truncate outlived the transaction timeout, the broker
    aborted it and the worker reopened on it and failed again, for good. Each transaction that
    wrote to a partition leaves one marker there (an offset of its own): 200 tombstones in
    parts of 50 are 4 transactions."""
    source = f"walbus.{unique_name}"
    topic = table_topic("walbus", unique_name, "public", "t")
    await create_topic(kafka_bootstrap, source)
    await produce(kafka_bootstrap, source, [ev(0x100, i, "insert", "public.t", ["id"], new={"id": i, "n": i}, types=INTS)
                                            for i in range(200)], partition=0)
    proc = DemuxProc(demux_args(kafka_bootstrap, source, tmp_path / "state", "--txn-max-records", "50"),
                     tmp_path / "demux.log").start()
    try:
        await wait_caught_up(kafka_bootstrap, demux_group(source), source, procs=[proc])
        before = (await end_offsets(kafka_bootstrap, topic))[0]
        await produce(kafka_bootstrap, source, [ev(0x200, 0, "truncate", "public.t", ["id"])], partition=0)
        await wait_caught_up(kafka_bootstrap, demux_group(source), source, procs=[proc])
        records = [r for r in await read_records(kafka_bootstrap, topic) if r.offset >= before]
        markers = 0
        for _ in range(100):  # a commit's markers are written just after it returns
            markers = (await end_offsets(kafka_bootstrap, topic))[0] - before - len(records)
            if markers >= 4:
                break
            await asyncio.sleep(0.1)
    finally:
        assert proc.stop() == 0, proc.log_tail()
    assert sorted(r.key for r in records if r.value is None) == sorted(b'{"id":%d}' % i for i in range(200))
    assert markers == 4, proc.log_tail()


async def _fill_topic(bootstrap: str, topic: str, rows: int, value: bytes = b'{"id":%d,"s":"x"}') -> None:
    """``rows`` records ``{"id":i}`` -> ``value % i`` (``{"id":i,"s":"x"}``) in whole batches (fast)."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, max_batch_size=1_000_000, linger_ms=0)
    await producer.start()
    try:
        futures, i = [], 0
        while i < rows:
            batch = producer.create_batch()
            while i < rows and batch.append(key=b'{"id":%d}' % i, value=value % ((i,) * value.count(b"%d")),
                                            timestamp=None):
                i += 1
            futures.append(await producer.send_batch(batch, topic, partition=0))
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


async def _loop_cpu_while_demux_runs(bootstrap: str, source: str, tmp_path: Path) -> float:
    """Run a demux in this process until it committed the whole source topic: the most CPU
    seconds its event loop's thread spent between two turns of the loop (not wall time: a busy
    host is not the demux' doing)."""
    demux = Demux(parse_config(demux_args(bootstrap, source, tmp_path / "state")))
    worst = 0.0

    async def turns() -> None:
        nonlocal worst
        last = time.thread_time()
        while True:
            await asyncio.sleep(0.01)
            now = time.thread_time()
            worst, last = max(worst, now - last), now

    ticker = asyncio.create_task(turns())
    running = asyncio.create_task(demux.run())
    try:
        await wait_caught_up(bootstrap, demux_group(source), source, within=300)
    finally:
        demux.stop()
        await running
        ticker.cancel()
    return worst


async def test_a_large_table_is_loaded_and_truncated_off_the_event_loop(
    kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    """Loading a table into the last-row store, a truncate's tombstones (one per key) and the
    store's commit after them are work over every key of the table: inline, they held the event
    loop for seconds per 100,000 keys (a 1M-key truncate: 20 s), while the consumer's heartbeats,
    the other partitions' transactions and their commits waited; past --session-timeout-ms the
    broker evicted the member and revoked the partition in the middle of the truncate. The
    event loop's own CPU time between two of its turns is measured."""
    rows = 200_000
    source = f"walbus.{unique_name}"
    topic = table_topic("walbus", unique_name, "public", "big")
    await create_topic(kafka_bootstrap, source)
    await create_topic(kafka_bootstrap, topic, compact=True)
    await _fill_topic(kafka_bootstrap, topic, rows)
    # A text column: the table is kept in the store, loaded from its topic first.
    await produce(kafka_bootstrap, source, [
        ev(0x100, 0, "insert", "public.big", ["id"], new={"id": rows, "s": "y"}, types={"id": "int4"}),
        ev(0x200, 0, "truncate", "public.big", ["id"]),
    ], partition=0)
    worst = await _loop_cpu_while_demux_runs(kafka_bootstrap, source, tmp_path)
    table = await read_ktable(client_kwargs={"bootstrap_servers": kafka_bootstrap}, topic=topic)
    assert table == {}, f"{len(table)} rows left after the truncate"
    assert worst < 0.5, f"the event loop ran {worst:.2f} CPU seconds without a turn"


async def test_a_row_too_large_for_its_topic_stays_findable_by_its_replica_identity_index(
    kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    """Under REPLICA IDENTITY USING INDEX a delete's identity is the index's columns only: the
    store finds the row's key by them. A row whose update was too large for its topic (DLQ) was
    marked unknown without its columns, so it was not findable any more: its delete tombstoned
    nothing (and an update moving its key left the old key), and the topic kept the row before
    the too-large one for good, a row the table no longer had."""
    source = f"walbus.{unique_name}"
    table = f"{source}.public.ri"
    await create_topic(kafka_bootstrap, source)
    await create_topic(kafka_bootstrap, table, configs={"cleanup.policy": "compact", "max.message.bytes": "300000"})
    big = _text(400_000, 4)
    types = {"id": "int4", "code": "int4"}
    events = [
        ev(0x100, 0, "insert", "public.ri", ["id"], new={"id": 1, "code": 10, "body": "a"}, types=types),
        ev(0x100, 1, "insert", "public.ri", ["id"], new={"id": 2, "code": 20, "body": "b"}, types=types),
        ev(0x200, 0, "update", "public.ri", ["id"], new={"id": 1, "code": 10, "body": big}, types=types),
        ev(0x200, 1, "update", "public.ri", ["id"], new={"id": 2, "code": 20, "body": big}, types=types),
        ev(0x300, 0, "delete", "public.ri", ["id"], identity={"code": 10}, types=types),
        ev(0x300, 1, "update", "public.ri", ["id"], new={"id": 3, "code": 20, "body": "c"}, identity={"code": 20},
           types=types),
    ]
    await produce(kafka_bootstrap, source, events, partition=0)
    metrics, proc = await _run_demux(kafka_bootstrap, source, tmp_path, "demux")
    rows: dict[bytes | None, Any] = {}  # the topic as a KTable
    for key, row in _rows(await read_records(kafka_bootstrap, table, "read_committed")):
        if row is None:
            rows.pop(key, None)
        else:
            rows[key] = row
    assert metrics["walbus_demux_dead_letters_total{reason=size}"] == 2
    assert rows == {b'{"id":3}': {"id": 3, "code": 20, "body": "c"}}, proc.log_tail()


async def test_a_table_that_takes_longer_than_the_timeout_to_read_is_read(kafka_bootstrap: str, unique_name: str) -> None:
    """Loading a table from its topic (the last-row store, a truncate's keys) had one deadline for
    the whole read (120 s): a table too large to read in it (~6M rows here) failed the partition
    worker with KTableTimeout, which reopened and read it again, and failed again, for good. The
    timeout is now on a read that stops making progress: 600,000 rows against 1.5 s."""
    from demux.ktable import read_ktable_raw

    topic = f"{unique_name}.public.t"
    rows = 600_000
    await create_topic(kafka_bootstrap, topic, compact=True)
    await _fill_topic(kafka_bootstrap, topic, rows)
    table = await read_ktable_raw(client_kwargs={"bootstrap_servers": kafka_bootstrap}, topic=topic, timeout_s=1.5)
    assert len(table) == rows and table[b'{"id":7}'] == b'{"id":7,"s":"x"}'


async def test_a_large_table_is_indexed_by_its_replica_identity_off_the_event_loop(
    kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    """The first delete by a REPLICA IDENTITY USING INDEX identity indexes the table's rows by the
    index's columns (StateStore.find): inline, 2.3 CPU seconds for 200,000 rows in one step of the
    event loop, as the large truncate above."""
    rows = 200_000
    source = f"walbus.{unique_name}"
    topic = table_topic("walbus", unique_name, "public", "big")
    await create_topic(kafka_bootstrap, source)
    await create_topic(kafka_bootstrap, topic, compact=True)
    await _fill_topic(kafka_bootstrap, topic, rows, b'{"id":%d,"code":%d,"s":"x"}')
    await produce(kafka_bootstrap, source, [
        ev(0x100, 0, "delete", "public.big", ["id"], identity={"code": 7}, types={"code": "int4"}),
    ], partition=0)
    worst = await _loop_cpu_while_demux_runs(kafka_bootstrap, source, tmp_path)
    assert (await read_records(kafka_bootstrap, topic))[-1].key == b'{"id":7}'
    assert worst < 0.5, f"the event loop ran {worst:.2f} CPU seconds without a turn"
