"""walbus' client library: subscribe to a database's changes instead of a message broker.

* :class:`Feed` — the database topic (``walbus.<database>``) as an async iterator of
  :class:`~walbus.contract.ChangeEvent`, for a consumer group: filtered by table and
  operation, in commit order, duplicates skipped by ``(commit_lsn, seq)``, offsets committed
  after your handler returns. ``feed.transactions()`` yields whole transactions.
  A new group starts at ``start="latest"`` (or ``"earliest"``, a commit LSN, a time). Each
  event is a :class:`FeedEvent` with ``ack()``/``nack(retry_in=…)`` and ``typed_row()``; failed
  events are retried (:class:`RetryPolicy`) and then sent to ``<topic>.group--<group>.dlq``;
  ``await feed.run(handler, concurrency=N)`` handles keys in parallel, each key in order.
* :class:`Table` — a compacted per-table topic (``walbus.<database>.<schema>.<table>``) as a
  live read-only mapping from primary key to row, with a change callback and
  ``await table.wait_until(commit_lsn)`` for read-your-writes.

::

    import asyncio
    import os
    from walbus.client import Feed, Table

    async def main() -> None:
        bootstrap = os.environ["WALBUS_KAFKA_BOOTSTRAP"]
        async with Feed("walbus.shop", group_id="notify", bootstrap_servers=bootstrap,
                        tables=["public.transactions"], operations=["insert"]) as feed:
            async for event in feed:
                print(event.table, event.operation, event.row())

    asyncio.run(main())
"""

from walbus.client.deadletters import (
    DeadLetter,
    DeadLetterError,
    dead_letter_topic,
    list_dead_letters,
    replay_dead_letters,
)
from walbus.client.effects import AlreadyApplied, PgPositions
from walbus.client.event import FeedEvent
from walbus.client.feed import Feed, FeedStats, ResumeAfter, Transaction
from walbus.client.filters import EventFilter
from walbus.client.positions import Position
from walbus.client.retrying import RetryPolicy
from walbus.client.start import StartAt
from walbus.client.table import InvalidTableRecord, Row, Table, TableChange, TableError, table_key
from walbus.contract import ChangeEvent, Lsn, RowImage

__all__ = [
    "AlreadyApplied",
    "ChangeEvent",
    "DeadLetter",
    "DeadLetterError",
    "EventFilter",
    "Feed",
    "FeedEvent",
    "FeedStats",
    "InvalidTableRecord",
    "Lsn",
    "PgPositions",
    "Position",
    "ResumeAfter",
    "RetryPolicy",
    "Row",
    "RowImage",
    "StartAt",
    "Table",
    "TableChange",
    "TableError",
    "Transaction",
    "dead_letter_topic",
    "list_dead_letters",
    "replay_dead_letters",
    "table_key",
]
