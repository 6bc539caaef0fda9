"""Changes of a table renamed or dropped before the producer decodes them.

The decoders ask the catalog for what a change does not carry (pgoutput: the primary key and
nullability; wal2json: the table's columns, key and identity). A producer that lags behind
(stopped, or slow) can decode a change of a table renamed or dropped since: the name lookup
failed and the producer stopped with ``LookupError`` on every restart, publishing nothing while
the slot held WAL. Now pgoutput finds the table by its oid (a rename keeps it) and, for a
dropped table, takes the key from the relation message's identity flags; wal2json describes
the table by the change's own columns (no key: it names none), with a warning.
"""

from __future__ import annotations

import asyncio

import orjson
import psycopg
import pytest

from tests.support.pipeline import running_producer
from walbus.client import Feed

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("plugin", ["pgoutput", "wal2json"])
async def test_changes_of_tables_renamed_or_dropped_since_are_published(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str, plugin: str, caplog: pytest.LogCaptureFixture
) -> None:
    topic, slot = f"walbus.{unique_name}", f"{unique_name}_slot"
    async with running_producer(pg_dsn, kafka_bootstrap, topic=topic, plugin=plugin, slot=slot, snapshot_mode="never"):
        pass  # the slot exists from here on
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE renamed (id int PRIMARY KEY, v text NOT NULL)")
        conn.execute("CREATE TABLE dropped (a int, b int, v text, PRIMARY KEY (b, a))")
        conn.execute("INSERT INTO renamed VALUES (1, 'x')")
        conn.execute("INSERT INTO dropped VALUES (1, 2, 'y')")
        conn.execute("UPDATE dropped SET v = 'z'")
        conn.execute("ALTER TABLE renamed RENAME TO later")
        conn.execute("DROP TABLE dropped")
        with conn.transaction():  # created, filled and renamed in one transaction
            conn.execute("CREATE TABLE young (k text PRIMARY KEY)")
            conn.execute("INSERT INTO young VALUES ('k1')")
            conn.execute("ALTER TABLE young RENAME TO grown")
    producing = running_producer(pg_dsn, kafka_bootstrap, topic=topic, plugin=plugin, slot=slot, snapshot_mode="never")
    feed = Feed(topic, bootstrap_servers=kafka_bootstrap, start="earliest")
    events = []
    async with producing, asyncio.timeout(60), feed:
        async for event in feed:
            events.append(event)
            if len(events) == 4:
                break
    # the names they had when the changes were written
    got = [(e.table, e.operation, e.row()) for e in events]
    assert got == [
        ("public.renamed", "insert", {"id": 1, "v": "x"}),
        ("public.dropped", "insert", {"a": 1, "b": 2, "v": "y"}),
        ("public.dropped", "update", {"a": 1, "b": 2, "v": "z"}),
        ("public.young", "insert", {"k": "k1"}),
    ]
    renamed, inserted, updated, young = events
    if plugin == "pgoutput":
        assert renamed.pk == ("id",) and renamed.not_null == ("id", "v")  # found by its oid
        assert young.pk == ("k",)
        assert inserted.pk == updated.pk == ("a", "b")  # the identity flags, in column order
        assert inserted.not_null == ("a", "b")
    else:
        # wal2json names no key, and the table is not under the change's name any more
        assert renamed.pk == inserted.pk == young.pk == ()
    assert "table not in the catalog" in caplog.text


DROPPED_DDL = (
    "CREATE TABLE t (id int PRIMARY KEY, a text, b int)",
    "CREATE TABLE f (id int PRIMARY KEY, a text, b int)",
    "ALTER TABLE f REPLICA IDENTITY FULL",
    "CREATE TABLE g (id int PRIMARY KEY, a text, big text, b int8)",
)
DROPPED_DML = (
    "INSERT INTO t VALUES (1, 'x', 2)",
    "ALTER TABLE t DROP COLUMN b",
    "UPDATE t SET a = 'y' WHERE id = 1",
    "INSERT INTO f VALUES (1, 'x', 2)",
    "ALTER TABLE f DROP COLUMN b",
    "UPDATE f SET a = 'y' WHERE id = 1",
    # a TOASTed value the update leaves unchanged, beside a dropped fixed-length column
    "INSERT INTO g SELECT 1, 'x', string_agg(md5(i::text), '') , 3 FROM generate_series(1, 400) i",
    "ALTER TABLE g DROP COLUMN b",
    "UPDATE g SET a = 'y' WHERE id = 1",
    "ALTER TABLE g ADD COLUMN c int DEFAULT 5",
    "UPDATE g SET a = 'z' WHERE id = 1",
)


async def test_wal2json_updates_after_a_column_is_dropped_are_pgoutputs(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str
) -> None:
    """wal2json's update names the columns it has: a column of the table's last insert that it
    lacks was taken for an unchanged TOAST value (``"unchanged":["b"]`` for a dropped ``int``
    column, which a consumer then kept from the old row), and under REPLICA IDENTITY FULL sent
    as null in both rows. A column whose type is never TOASTed, or a full old row, now tells."""
    from tests.support.kafka import read_topic

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for statement in DROPPED_DDL:
            conn.execute(statement)
    t_pg, t_wj = f"{unique_name}_pg", f"{unique_name}_wj"
    async with (
        running_producer(pg_dsn, kafka_bootstrap, topic=t_pg, plugin="pgoutput", slot=f"{unique_name}_pg", snapshot_mode="never"),
        running_producer(pg_dsn, kafka_bootstrap, topic=t_wj, plugin="wal2json", slot=f"{unique_name}_wj", snapshot_mode="never"),
    ):
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            for statement in DROPPED_DML:
                conn.execute(statement)
        ours = await read_topic(kafka_bootstrap, t_pg, min_count=7)
        theirs = await read_topic(kafka_bootstrap, t_wj, min_count=7)
    assert len(ours) == len(theirs) == 7
    for (key, a), (_, b) in zip(ours, theirs, strict=True):
        assert a == b, f"{key!r}:\n pgoutput {a!r}\n wal2json {b!r}"
    g_updates = [orjson.loads(v) for _, v in ours if b'"table":"public.g"' in v and b'"update"' in v]
    assert [u.get("unchanged") for u in g_updates] == [["big"], ["big"]]
    assert [u["columns"] for u in g_updates] == [["id", "a"], ["id", "a", "c"]]


def test_a_deferrable_primary_key_is_no_replica_identity(pg_dsn: str) -> None:
    # PostgreSQL never uses a DEFERRABLE primary key as the replica identity: wal2json then
    # decodes no update or delete of the table (a WARNING in the server's log only). The
    # producer's warning at start counted the key as an identity and said nothing.
    from producer import setup

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE deferred_pk (id int PRIMARY KEY DEFERRABLE INITIALLY DEFERRED, n int)")
        conn.execute("CREATE TABLE immediate_pk (id int PRIMARY KEY, n int)")
        tables = [("public", "deferred_pk"), ("public", "immediate_pk")]
        assert setup.tables_without_identity(conn, tables) == [("public", "deferred_pk")]
        assert setup.identity_columns(conn, ("public", "deferred_pk")) == []
        assert setup.identity_columns(conn, ("public", "immediate_pk")) == ["id"]


async def test_a_change_written_before_the_primary_key_changed(pg_dsn: str, kafka_bootstrap: str, unique_name: str) -> None:
    # pgoutput's relation message carries the replica identity of when the change was
    # written; the key came from the catalog of when it was decoded. A delete written before
    # ALTER TABLE … ADD PRIMARY KEY (code) and decoded after it named id in its identity but
    # code as its key: the demux sent it to its dead-letter topic. Found by a key fuzz.
    topic, slot = f"walbus.{unique_name}", f"{unique_name}_slot"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, code text NOT NULL)")
    async with running_producer(pg_dsn, kafka_bootstrap, topic=topic, slot=slot, snapshot_mode="never"):
        pass  # the slot exists from here on
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO t VALUES (1, 'a'), (2, 'b')")
        conn.execute("DELETE FROM t WHERE id = 1")
        conn.execute("ALTER TABLE t DROP CONSTRAINT t_pkey, ADD PRIMARY KEY (code)")
        conn.execute("DELETE FROM t WHERE code = 'b'")
    got = []
    async with (
        running_producer(pg_dsn, kafka_bootstrap, topic=topic, slot=slot, snapshot_mode="never"),
        Feed(topic, start="earliest", bootstrap_servers=kafka_bootstrap) as feed,
        asyncio.timeout(60),
    ):
        async for event in feed:
            got.append((event.operation, event.pk, event.key_values()))
            if len(got) == 4:
                break
    assert got == [
        ("insert", ("id",), {"id": 1}), ("insert", ("id",), {"id": 2}),
        ("delete", ("id",), {"id": 1}), ("delete", ("code",), {"code": "b"}),
    ]
