"""Feed against a real broker: order, filters, duplicate skipping, commits, transactions."""

from __future__ import annotations

import asyncio
import random

import pytest

from tests.cdc_data import Change, create_topic, produce, workload
from walbus.client import Feed, Transaction
from walbus.contract import ChangeEvent

pytestmark = pytest.mark.integration

TABLES = ["public.transactions", "public.users", "audit.log"]


async def _collect(feed: Feed, n: int) -> list[ChangeEvent]:
    out: list[ChangeEvent] = []
    async with asyncio.timeout(30):
        async for event in feed:
            out.append(event)
            if len(out) >= n:
                break
    return out


async def test_order_and_filters(kafka_bootstrap: str, unique_name: str) -> None:
    changes = workload(random.Random(1), 60, TABLES)
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in changes])

    async with Feed(unique_name, bootstrap_servers=kafka_bootstrap, until_end=True) as feed:
        every = [e async for e in feed]
    assert [e.position for e in every] == [c.position for c in changes]
    assert feed.stats.delivered == len(changes)

    expected = [c for c in changes if c.table.endswith(".transactions") and c.operation in ("insert", "delete")]
    async with Feed(
        unique_name, bootstrap_servers=kafka_bootstrap, tables=["transactions"], operations=["insert", "delete"], until_end=True
    ) as feed:
        some = [e async for e in feed]
    assert [(e.position, e.table, e.operation) for e in some] == [(c.position, c.table, c.operation) for c in expected]
    assert some[0].row() == expected[0].row

    async with Feed(unique_name, bootstrap_servers=kafka_bootstrap, tables=["audit.*", "public.u*"], until_end=True) as feed:
        tables = {e.table async for e in feed}
    assert tables == {"audit.log", "public.users"}


async def test_group_skips_duplicates_after_restart(kafka_bootstrap: str, unique_name: str) -> None:
    """The producer re-sends after a crash: old keys appear again after the committed offset."""
    changes = workload(random.Random(2), 40, TABLES)
    first, second = changes[:70], changes[70:]
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in first])
    group = unique_name + "-g"
    seen: list[tuple[int, int]] = []
    async with Feed(unique_name, group_id=group, bootstrap_servers=kafka_bootstrap) as feed:
        seen += [e.position for e in await _collect(feed, len(first))]
    # A re-send of the last 25 events (and a duplicate inside the new ones), then new events.
    dup = [c.record() for c in first[-25:]]
    await produce(kafka_bootstrap, unique_name, dup + [c.record() for c in second[:5]] + dup[:3] + [c.record() for c in second[5:]])
    async with Feed(unique_name, group_id=group, bootstrap_servers=kafka_bootstrap, until_end=True) as feed:
        seen += [e.position for e in feed_events] if (feed_events := [e async for e in feed]) else []
    assert seen == [c.position for c in changes]
    assert feed.stats.duplicates_skipped == 28


async def test_handler_exception_means_redelivery(kafka_bootstrap: str, unique_name: str) -> None:
    changes = workload(random.Random(3), 10, TABLES)
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in changes])
    group = unique_name + "-g"
    with pytest.raises(RuntimeError):
        async with Feed(unique_name, group_id=group, bootstrap_servers=kafka_bootstrap) as feed:
            async for event in feed:
                if event.position == changes[5].position:
                    raise RuntimeError("handler failed")
    async with Feed(unique_name, group_id=group, bootstrap_servers=kafka_bootstrap, until_end=True) as feed:
        rest = [e.position async for e in feed]
    assert rest == [c.position for c in changes[5:]]


async def test_transactions(kafka_bootstrap: str, unique_name: str) -> None:
    changes = workload(random.Random(4), 30, TABLES)
    await create_topic(kafka_bootstrap, unique_name)
    # A partial transaction, then the producer's re-send of it (crash mid-transaction).
    records = [c.record() for c in changes]
    cut = next(i for i in range(40, len(changes)) if changes[i].seq > 0)
    start = cut - changes[cut].seq
    records = records[:cut] + records[start - 3 : start] + records[start:]
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, records)
    group = unique_name + "-g"
    txns: list[Transaction] = []
    feed = Feed(unique_name, group_id=group, bootstrap_servers=kafka_bootstrap, tables=["public.*"], transaction_linger=0.3, until_end=True)
    async with feed:
        async for txn in feed.transactions():
            txns.append(txn)
    expected: dict[int, list[Change]] = {}
    for c in changes:
        if c.table.startswith("public."):
            expected.setdefault(c.commit_lsn, []).append(c)
    assert [t.commit_lsn for t in txns] == list(expected)
    for t in txns:
        assert [e.position for e in t.events] == [c.position for c in expected[t.commit_lsn]]
        assert t.tables <= {"public.transactions", "public.users"}
    # Everything is committed: the group has nothing left.
    async with Feed(unique_name, group_id=group, bootstrap_servers=kafka_bootstrap, until_end=True) as feed:
        assert [e async for e in feed] == []
