"""The soak's `Feed` consumer: applies every event exactly once into a PostgreSQL table.

    python -m bench.soak_feed TOPIC GROUP EFFECTS_DSN BOOTSTRAP PARTITIONS

Each event is stored (the effect) in one database transaction with its position, through
``walbus.client.PgPositions``; the feed resumes after the stored position of each partition.
The effect row names the event's partition, which the soak's checks compare with the
producer's choice (``walbus.kafka.partition_for`` over the table name).
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import psycopg

from walbus.client import Feed, FeedEvent, PgPositions

EFFECTS_DSN_ENV = "WALBUS_SOAK_EFFECTS_DSN"  # where the feed records its effects

EFFECTS_DDL = (
    "CREATE TABLE IF NOT EXISTS soak_effects (id bigserial PRIMARY KEY, part int NOT NULL,"
    " commit_lsn bigint NOT NULL, seq int NOT NULL, tbl text NOT NULL, op text NOT NULL,"
    " pid int DEFAULT pg_backend_pid())"
)


async def record_effect(conn: psycopg.AsyncConnection[Any], event: FeedEvent) -> None:
    await conn.execute(
        "INSERT INTO soak_effects (part, commit_lsn, seq, tbl, op) VALUES (%s, %s, %s, %s, %s)",
        (event.partition, event.commit_lsn, event.seq, event.table, event.operation),
    )


async def main(topic: str, group: str, dsn: str, bootstrap: str) -> None:
    positions = PgPositions(dsn, consumer=group)
    await positions.create_table()
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        await conn.execute(EFFECTS_DDL)
        await conn.commit()
        feed = Feed(
            topic,
            start="earliest",
            group_id=group,
            bootstrap_servers=bootstrap,
            resume_after=positions.resume_after,
            commit_interval=0.5,
            consumer_options={"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000},
        )
        async with feed:
            async for event in feed:
                await positions.apply(conn, event, record_effect)


if __name__ == "__main__":
    topic, group, bootstrap = sys.argv[1:4]  # the effects database's DSN: in the environment, not argv
    asyncio.run(main(topic, group, os.environ[EFFECTS_DSN_ENV], bootstrap))
