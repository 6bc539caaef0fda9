"""A database not encoded in UTF8.

The producer's connections left ``client_encoding`` to the database's (LATIN1), read the text
as UTF-8, and stopped with UnicodeDecodeError on the first non-ASCII value, again at every
restart. They now ask for UTF8, which PostgreSQL converts to for the snapshots and pgoutput;
wal2json writes the database's own encoding whatever the client asks, so it is refused at
start (exit 2), as is a client_encoding forced by the DSN or PGCLIENTENCODING.
"""

from __future__ import annotations

import asyncio

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from tests.support.pipeline import running_producer
from tests.support.services import Services
from walbus.client import Feed
from walbus.config import ConfigError

pytestmark = pytest.mark.integration


@pytest.fixture()
def latin1_dsn(services: Services, pg_dsn: str, unique_name: str) -> str:
    """This test's database (pg_dsn's: dropped after it), made again in LATIN1."""
    with psycopg.connect(services.pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE {}").format(sql.Identifier(unique_name)))
        conn.execute(sql.SQL("CREATE DATABASE {} ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0").format(
            sql.Identifier(unique_name)))
    with psycopg.connect(pg_dsn, autocommit=True, client_encoding="UTF8") as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        conn.execute("INSERT INTO t VALUES (1, 'snap é ü ÿ')")
    return pg_dsn


async def test_a_latin1_database_is_read_as_utf8(latin1_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    topic = f"walbus.{unique_name}"
    async with running_producer(latin1_dsn, kafka_bootstrap, topic=topic, plugin="pgoutput"):
        with psycopg.connect(latin1_dsn, autocommit=True, client_encoding="UTF8") as conn:
            conn.execute("INSERT INTO t VALUES (2, 'stream é ü ÿ')")
        events = []
        async with asyncio.timeout(60), Feed(topic, bootstrap_servers=kafka_bootstrap, start="earliest") as feed:
            async for event in feed:
                events.append(event.row())
                if len(events) == 2:
                    break
    assert events == [{"id": 1, "v": "snap é ü ÿ"}, {"id": 2, "v": "stream é ü ÿ"}]


async def test_wal2json_or_another_client_encoding_is_refused(latin1_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    with pytest.raises(ConfigError, match="the database's encoding is LATIN1"):
        async with running_producer(latin1_dsn, kafka_bootstrap, topic=unique_name, plugin="wal2json"):
            pass
    with pytest.raises(ConfigError, match="client_encoding is LATIN1"):
        dsn = make_conninfo(latin1_dsn, client_encoding="LATIN1")
        async with running_producer(dsn, kafka_bootstrap, topic=unique_name, plugin="pgoutput"):
            pass
