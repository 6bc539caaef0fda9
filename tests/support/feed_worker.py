"""A Feed consumer process for the kill -9 test: exactly-once effects through ``PgPositions``.

Each handled event is stored in PostgreSQL in one transaction with its position; on start,
the feed resumes after the last stored position. Run: python -m tests.support.feed_worker TOPIC GROUP DSN BOOTSTRAP
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import psycopg

from walbus.client import Feed, FeedEvent, PgPositions

TABLES = ["public.transactions", "public.users"]


async def record_handled(conn: psycopg.AsyncConnection[Any], event: FeedEvent) -> None:
    await conn.execute(
        "INSERT INTO handled (commit_lsn, seq, tbl, op) VALUES (%s, %s, %s, %s)",
        (event.commit_lsn, event.seq, event.table, event.operation),
    )


async def main(topic: str, group: str, dsn: str, bootstrap: str, until_end: bool) -> None:
    positions = PgPositions(dsn, consumer=group)
    await positions.create_table()
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS handled (id bigserial PRIMARY KEY, commit_lsn bigint, seq int,"
            " tbl text, op text, pid int DEFAULT pg_backend_pid())"
        )
        await conn.commit()
        feed = Feed(
            topic,
            start="earliest",
            group_id=group,
            bootstrap_servers=bootstrap,
            tables=TABLES,
            resume_after=positions.resume_after,
            commit_interval=0.2,
            until_end=until_end,
            consumer_options={"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000},
        )
        async with feed:
            print("started", flush=True)
            async for event in feed:
                if not await positions.apply(conn, event, record_handled):
                    print(f"already applied {event.commit_lsn}/{event.seq}", flush=True)
                await asyncio.sleep(0.002)  # a handler that takes a little time
        print(f"done {feed.stats}", flush=True)


if __name__ == "__main__":
    topic, group, dsn, bootstrap = sys.argv[1:5]
    asyncio.run(main(topic, group, dsn, bootstrap, until_end="--until-end" in sys.argv))
