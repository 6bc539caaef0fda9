"""What others write to the WAL does not stop a wal2json slot.

wal2json escapes a logical message's every byte (a control character as six), and PostgreSQL
keeps no string of more than 1 GB: anybody's ``pg_logical_emit_message`` of 180 MB failed the
walsender at that record ("out of memory … in the message callback") on every reconnect, and
no later change reached Kafka. The producer asks wal2json for walbus's own messages only.
"""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from tests.support.pipeline import running_producer
from walbus.client import Feed

pytestmark = pytest.mark.integration


async def test_a_huge_logical_message_of_another_prefix_does_not_stop_the_slot(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str
) -> None:
    topic = f"walbus.{unique_name}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE acct (id int PRIMARY KEY, v text)")
    async with running_producer(
        pg_dsn, kafka_bootstrap, topic=topic, plugin="wal2json", snapshot_mode="never", retry_max_delay=1.0,
    ) as producer:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            # 180 MB of \x01: over 1 GB as wal2json's JSON (\u0001 each)
            conn.execute("SELECT pg_logical_emit_message(false, 'junk', repeat(chr(1), 180 * 1024 * 1024))")
            conn.execute("INSERT INTO acct VALUES (1, 'after')")
        async with asyncio.timeout(90), Feed(topic, bootstrap_servers=kafka_bootstrap, start="earliest") as feed:
            async for event in feed:
                break
        assert event.row() == {"id": 1, "v": "after"}
        assert producer.metrics.reconnects._value.get() == 0
