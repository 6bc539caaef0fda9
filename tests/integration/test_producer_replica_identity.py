"""A change's identity is the one it was written under, whatever the table's replica identity
is when the producer decodes it.

wal2json prints a change's identity (its old key, or its whole old row) as the change's own
catalog version says, but the decoder took the kind of identity from the catalog as it is now
(or as it last read it): after ALTER TABLE … REPLICA IDENTITY, an update's unchanged TOAST
column became null, a full old row was cut to the key, and an identity under USING INDEX was
sent as ``{"id": null}`` (a delete a consumer could not apply). pgoutput is the reference.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import psycopg
import pytest

from tests.support.pipeline import running_producer
from walbus.client import Feed
from walbus.contract import ChangeEvent

pytestmark = pytest.mark.integration


def _identity(event: ChangeEvent) -> dict[str, Any] | None:
    ident = event.identity
    return None if ident is None else dict(zip(ident.columns, ident.values, strict=True))


@pytest.mark.parametrize("plugin", ["pgoutput", "wal2json"])
async def test_each_change_has_the_identity_it_was_written_under(
    pg_dsn: str, kafka_bootstrap: str, unique_name: str, plugin: str
) -> None:
    big = os.urandom(30000).hex()  # stored out of line: unchanged, it is not in an update's new row
    topic = f"walbus.{unique_name}"
    slot = f"{unique_name}_s"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, n int, u int NOT NULL, big text)")
        conn.execute("CREATE UNIQUE INDEX t_u ON t (u)")
        conn.execute("CREATE TABLE done (id int PRIMARY KEY)")
        conn.execute("INSERT INTO t VALUES (1, 0, 100, %s), (2, 0, 200, 'small')", [big])
    async with running_producer(pg_dsn, kafka_bootstrap, topic=topic, plugin=plugin, slot=slot, snapshot_mode="never"):
        pass  # the slot exists from here on
    steps = (
        # written while the producer is stopped: decoded under the catalog's last version
        "UPDATE t SET n = 1 WHERE id = 1",  # DEFAULT
        "ALTER TABLE t REPLICA IDENTITY FULL",
        "UPDATE t SET n = 2 WHERE id = 1",
        "ALTER TABLE t REPLICA IDENTITY USING INDEX t_u",
        "UPDATE t SET n = 3 WHERE id = 1",
        "DELETE FROM t WHERE id = 2",
        "ALTER TABLE t REPLICA IDENTITY DEFAULT",
    )
    later = (
        # written while it runs, after it decoded (and cached) the table under DEFAULT
        "ALTER TABLE t REPLICA IDENTITY FULL",
        "UPDATE t SET n = 4 WHERE id = 1",
        "ALTER TABLE t REPLICA IDENTITY DEFAULT",
        "UPDATE t SET n = 5 WHERE id = 1",
        "INSERT INTO done VALUES (1)",
    )
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for statement in steps:
            conn.execute(statement)
    events: list[ChangeEvent] = []
    async with (running_producer(pg_dsn, kafka_bootstrap, topic=topic, plugin=plugin, slot=slot, snapshot_mode="never"),
                asyncio.timeout(60), Feed(topic, bootstrap_servers=kafka_bootstrap, start="earliest") as feed):
        async for event in feed:
            events.append(event)
            if len(events) == 4:
                with psycopg.connect(pg_dsn, autocommit=True) as conn:
                    for statement in later:
                        conn.execute(statement)
            if event.table == "public.done":
                break
    got = [(e.operation, e.row() if e.new is not None else None, list(e.unchanged), _identity(e)) for e in events[:-1]]
    old_row = {"id": 1, "n": 1, "u": 100, "big": big}
    assert got == [
        ("update", {"id": 1, "n": 1, "u": 100}, ["big"], {"id": 1}),
        ("update", {"id": 1, "n": 2, "u": 100, "big": big}, [], old_row),
        ("update", {"id": 1, "n": 3, "u": 100}, ["big"], {"u": 100}),
        ("delete", None, [], {"u": 200}),
        ("update", {"id": 1, "n": 4, "u": 100, "big": big}, [], {**old_row, "n": 3}),
        ("update", {"id": 1, "n": 5, "u": 100}, ["big"], {"id": 1}),
    ]
