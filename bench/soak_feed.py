"""The soak's `Feed` consumer: applies every event exactly once into a PostgreSQL table.

    python -m bench.soak_feed TOPIC GROUP EFFECTS_DSN BOOTSTRAP PARTITIONS

Each event is stored with its position in one database transaction (the effect); on
start, and on every assignment, the feed resumes after the last position stored for the
partition (``resume_after``). The database topic has several partitions, so positions are
kept per partition: a table's partition is the producer's own choice
(``walbus.kafka.partition_for`` over the event's table name), which the soak's checks
confirm against the topic.
"""

from __future__ import annotations

import asyncio
import sys

import psycopg

from walbus.client import Feed, Position
from walbus.kafka import partition_for

EFFECTS_DDL = (
    "CREATE TABLE IF NOT EXISTS soak_effects (id bigserial PRIMARY KEY, part int NOT NULL,"
    " commit_lsn bigint NOT NULL, seq int NOT NULL, tbl text NOT NULL, op text NOT NULL,"
    " pid int DEFAULT pg_backend_pid())"
)


def table_partition(table: str, partitions: int) -> int:
    """The database topic's partition of ``table`` (the qualified name), as the producer picks it."""
    return partition_for(table.encode(), partitions)


async def main(topic: str, group: str, dsn: str, bootstrap: str, partitions: int) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        await conn.execute(EFFECTS_DDL)
        await conn.commit()

        async def resume_after(_topic: str, partition: int) -> Position | None:
            cur = await conn.execute(
                "SELECT commit_lsn, seq FROM soak_effects WHERE part = %s ORDER BY commit_lsn DESC, seq DESC LIMIT 1",
                (partition,),
            )
            row = await cur.fetchone()
            await conn.commit()
            return (row[0], row[1]) if row else None

        feed = Feed(
            topic,
            start="earliest",
            group_id=group,
            bootstrap_servers=bootstrap,
            resume_after=resume_after,
            commit_interval=0.5,
            consumer_options={"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000},
        )
        async with feed:
            async for event in feed:
                async with conn.transaction():
                    await conn.execute(
                        "INSERT INTO soak_effects (part, commit_lsn, seq, tbl, op) VALUES (%s, %s, %s, %s, %s)",
                        (table_partition(event.table, partitions), event.commit_lsn, event.seq, event.table, event.operation),
                    )


if __name__ == "__main__":
    topic, group, dsn, bootstrap, partitions = sys.argv[1:6]
    asyncio.run(main(topic, group, dsn, bootstrap, int(partitions)))
