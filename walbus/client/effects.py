"""Exactly-once effects in PostgreSQL: a Feed's position stored with the effect.

No broker commit can be atomic with a write to another system, so the position goes into the
same database transaction as the effect, and the feed resumes after it. ``PgPositions`` is
that pattern, written once::

    positions = PgPositions(dsn, consumer="billing")
    await positions.create_table()
    async with Feed(topic, group_id="billing", resume_after=positions.resume_after) as feed:
        async for event in feed:
            await positions.apply(conn, event, record_invoice)  # False: delivered again, applied already

``apply`` runs ``await effect(conn, event)`` and ``mark`` in one transaction of ``conn``;
``mark`` alone is for a transaction of your own (it raises AlreadyApplied, roll back then).

An event of the group's replay topic (a dead letter sent back) is kept by its offset there
instead, in the row of topic ``<replay topic>:offset``: replayed events are not in position
order (one that failed again comes back after later ones), with the newest record timestamp
applied beside it (a replay topic made again starts over at offset 0).

``mark`` moves the stored position forward or raises, so a member that lost its partition
in a rebalance and still finishes a handler (a zombie) rolls back instead of applying the
effect a second time. Positions grow within a partition only in delivery order: use it with
sequential delivery, not with ``Feed.run(concurrency=N)``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
from psycopg import sql

from walbus.client.event import FeedEvent
from walbus.client.positions import Position

DEFAULT_TABLE = "walbus_feed_positions"
Effect = Callable[["psycopg.AsyncConnection[Any]", FeedEvent], Awaitable[None]]


class AlreadyApplied(RuntimeError):
    """The event's position is not past the stored one: its effect was applied already."""


class PgPositions:
    """Per (consumer, topic, partition): the position of the last event whose effect committed.

    ``dsn``: where the positions table is; ``resume_after`` reads it on its own short
    connection (it runs when partitions are assigned, perhaps while a handler holds the
    caller's connection in a transaction). ``mark`` runs on the caller's connection, inside the
    effect's transaction."""

    def __init__(self, dsn: str, consumer: str, *, table: str = DEFAULT_TABLE, schema: str | None = None) -> None:
        self.dsn = dsn
        self.consumer = consumer
        self.table = sql.Identifier(schema, table) if schema else sql.Identifier(table)

    async def create_table(self) -> None:
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            await conn.execute(
                sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {} (consumer text NOT NULL, topic text NOT NULL, partition int NOT NULL,"
                    " commit_lsn bigint NOT NULL, seq bigint NOT NULL, updated_at timestamptz NOT NULL DEFAULT now(),"
                    " PRIMARY KEY (consumer, topic, partition))"
                ).format(self.table)
            )

    async def resume_after(self, topic: str, partition: int) -> Position | None:
        """For ``Feed(resume_after=…)``: the last position applied on that partition."""
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            cur = await conn.execute(
                sql.SQL("SELECT commit_lsn, seq FROM {} WHERE consumer = %s AND topic = %s AND partition = %s").format(self.table),
                (self.consumer, topic, partition),
            )
            row = await cur.fetchone()
        return (int(row[0]), int(row[1])) if row else None

    async def apply(self, conn: psycopg.AsyncConnection[Any], event: FeedEvent, effect: Effect) -> bool:
        """``await effect(conn, event)`` and the position in one transaction of ``conn``; False
        (and nothing applied) when the event's effect is there already."""
        try:
            async with conn.transaction():
                await self.mark(conn, event)
                await effect(conn, event)
        except AlreadyApplied:
            return False
        return True

    async def mark(self, conn: psycopg.AsyncConnection[Any], event: FeedEvent) -> None:
        """Store ``event``'s position in ``conn``'s open transaction; raises AlreadyApplied (roll
        the transaction back) when the stored position is not behind it."""
        if event.topic is None or event.partition is None or event.offset is None:
            raise ValueError("the event was not delivered by a Feed: no topic and partition to keep its position for")
        topic, position = event.topic, (event.commit_lsn, event.seq)
        # Stored position < the event's: the event is new.
        newer = sql.SQL("(p.commit_lsn, p.seq) < (EXCLUDED.commit_lsn, EXCLUDED.seq)")
        seq = sql.SQL("EXCLUDED.seq")
        if event.replayed:
            # Dead letters come back in the order they died, not by position (one that failed
            # again follows later ones): kept by the replay topic's offset, which grows in
            # delivery order, in a row of its own (':' is in no topic name). By position, the
            # second replay of an event older than one applied was dropped as a repeat.
            # Beside the offset (commit_lsn), seq keeps the newest record timestamp applied:
            # a replay topic deleted and made again starts at offset 0, and by offset alone
            # every event of it up to the old topic's last offset was dropped as a repeat. An
            # event at or below the stored offset is new only if written after every applied
            # one (a record delivered again is never). seq 0: a row kept by offset alone.
            topic, position = replay_row_topic(event.topic), (event.offset, event.record_timestamp_ms or 0)
            newer = sql.SQL("p.commit_lsn < EXCLUDED.commit_lsn OR (p.seq > 0 AND p.seq < EXCLUDED.seq)")
            seq = sql.SQL("GREATEST(p.seq, EXCLUDED.seq)")
        cur = await conn.execute(
            sql.SQL(
                "INSERT INTO {t} AS p (consumer, topic, partition, commit_lsn, seq) VALUES (%s, %s, %s, %s, %s)"
                " ON CONFLICT (consumer, topic, partition) DO UPDATE"
                " SET commit_lsn = EXCLUDED.commit_lsn, seq = {seq}, updated_at = now()"
                " WHERE {newer}"
            ).format(t=self.table, seq=seq, newer=newer),
            (self.consumer, topic, event.partition, *position),
        )
        if cur.rowcount != 1:
            raise AlreadyApplied(
                f"{topic}[{event.partition}] is already past {position[0]}/{position[1]} for consumer {self.consumer!r}"
            )


def replay_row_topic(replay_topic: str) -> str:
    """The ``topic`` of the positions row that keeps a replay topic's offsets (replayed events
    are applied in the replay topic's order, not by position)."""
    return f"{replay_topic}:offset"
