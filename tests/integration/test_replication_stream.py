"""The replication stream against a real walsender: reads, and pulls between them."""

from __future__ import annotations

import asyncio
import struct
import time

import psycopg
import pytest

from producer.replication import PULLS_PER_READ, ReplicationStream

pytestmark = pytest.mark.integration


def _inserted_id(payload: bytes) -> int:
    # pgoutput Insert: 'I', relation id, 'N', column count, then 't' + length + text per column
    (size,) = struct.unpack_from(">I", payload, 9)
    return int(payload[13 : 13 + size])


async def test_pulls_between_reads_lose_nothing_and_are_bounded(pg_dsn: str, unique_name: str) -> None:
    """pull() moves what the kernel holds into libpq while the caller works through a read:
    every message still comes once, in order; and it pulls at most PULLS_PER_READ times after
    a read that emptied libpq's buffer, never after one that stopped at its limit (libpq
    holds a backlog then), so what libpq holds stays bounded."""
    rows = 5000
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        conn.execute("CREATE PUBLICATION p FOR TABLE t")
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (unique_name,))
        conn.execute("INSERT INTO t SELECT g, repeat('x', 50) FROM generate_series(1, %s) g", (rows,))
    stream = ReplicationStream.connect(pg_dsn)
    consumed = 0
    consume = stream._consume

    def counted() -> None:
        nonlocal consumed
        consumed += 1
        consume()

    stream._consume = counted  # type: ignore[method-assign]
    try:
        stream.start(unique_name, 0, {"proto_version": "1", "publication_names": '"p"'})
        ids: list[int] = []
        kinds = {"limited": 0, "drained": 0}
        deadline = time.monotonic() + 60
        while len(ids) < rows or not kinds["drained"]:
            assert time.monotonic() < deadline, f"the stream stopped after {len(ids)} of {rows} rows"
            batch = await stream.read(max_messages=300, timeout=5)  # empty after a keepalive alone
            limited = len(batch) == 300
            kinds["limited" if limited else "drained"] += 1
            before = consumed
            for _ in range(3 * PULLS_PER_READ):
                stream.pull()
                await asyncio.sleep(0.005)  # the walsender sends meanwhile: libpq's buffer fills
            assert consumed - before == (0 if limited else PULLS_PER_READ)
            ids += [_inserted_id(p) for _, p in batch if p[:1] == b"I"]
        assert ids == list(range(1, rows + 1))
        assert kinds["limited"] and kinds["drained"], kinds
    finally:
        stream.close()
