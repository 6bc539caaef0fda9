"""What wal2json sends that pgoutput does not: the producer passes on what pgoutput would.

What others write to the WAL does not stop a wal2json slot: wal2json escapes a logical
message's every byte (a control character as six), and PostgreSQL keeps no string of more
than 1 GB: anybody's ``pg_logical_emit_message`` of 180 MB failed the walsender at that record
("out of memory … in the message callback") on every reconnect, and no later change reached
Kafka. The producer asks wal2json for walbus's own messages only.
"""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from tests.support.pipeline import running_producer
from walbus.client import Feed

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("prefix", ["junk", "walbus-watermark"])
async def test_a_huge_logical_message_does_not_stop_the_slot(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str, prefix: str
) -> None:
    # 180 MB of \x01: over 1 GB as wal2json's JSON (\u0001 each), past PostgreSQL's string
    # limit, so the walsender failed at that record on every reconnect. The producer asks
    # wal2json for its own watermarks only, and their prefix ends with a token of the producer
    # process's own: under the prefix walbus used to document ('walbus-watermark'), the same
    # junk stopped the slot too.
    topic = f"walbus.{unique_name}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE acct (id int PRIMARY KEY, v text)")
    async with running_producer(
        pg_dsn, kafka_bootstrap, topic=topic, plugin="wal2json", snapshot_mode="never", retry_max_delay=1.0,
    ) as producer:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_logical_emit_message(false, %s, repeat(chr(1), 180 * 1024 * 1024))", (prefix,))
            conn.execute("INSERT INTO acct VALUES (1, 'after')")
        async with asyncio.timeout(90), Feed(topic, bootstrap_servers=kafka_bootstrap, start="earliest") as feed:
            event = await anext(aiter(feed))
        assert event.row() == {"id": 1, "v": "after"}
        assert producer.metrics.reconnects._value.get() == 0


@pytest.mark.parametrize("plugin", ["pgoutput", "wal2json"])
async def test_a_truncate_of_a_partitioned_table_names_its_leaves_only(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str, plugin: str
) -> None:
    # wal2json also sent a truncate of the partitioned tables themselves (the root and a
    # sub-partitioned partition), which pgoutput leaves out: every later seq of the
    # transaction named another event with the other plugin.
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE pt (id int, region int, PRIMARY KEY (id, region)) PARTITION BY LIST (region)")
        conn.execute("CREATE TABLE p1 PARTITION OF pt FOR VALUES IN (1)")
        conn.execute("CREATE TABLE p2 PARTITION OF pt FOR VALUES IN (2) PARTITION BY RANGE (id)")
        conn.execute("CREATE TABLE p2a PARTITION OF p2 FOR VALUES FROM (MINVALUE) TO (MAXVALUE)")
        conn.execute("CREATE TABLE other (id int PRIMARY KEY)")
    topic = f"walbus.{unique_name}"
    async with running_producer(pg_dsn, kafka_bootstrap, topic=topic, plugin=plugin, snapshot_mode="never"):
        with psycopg.connect(pg_dsn, autocommit=True) as conn, conn.transaction():
            conn.execute("TRUNCATE pt")
            conn.execute("INSERT INTO other VALUES (1)")
        async with asyncio.timeout(60), Feed(topic, bootstrap_servers=kafka_bootstrap, start="earliest") as feed:
            got = []
            async for event in feed:
                got.append((event.seq, event.operation, event.table))
                if event.table == "public.other":
                    break
    assert got == [(0, "truncate", "public.p1"), (1, "truncate", "public.p2a"), (2, "insert", "public.other")]
