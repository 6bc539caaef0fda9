"""Feed against a real broker: order, filters, duplicate skipping, commits, transactions."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import threading
from collections.abc import Iterator

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from prometheus_client import REGISTRY

from tests.support.cdc_data import (
    Change,
    workload,
)
from tests.support.kafka import create_topic, produce
from walbus.aiokafka_shortcuts import read_in_runs
from walbus.app.dev.kafka import KafkaInstance
from walbus.app.dev.processes import free_port
from walbus.client import Feed, Transaction
from walbus.client.feed import REFILL_RECORDS
from walbus.contract import ChangeEvent, event_key

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

    async with Feed(unique_name, start="earliest", bootstrap_servers=kafka_bootstrap, until_end=True) as feed:
        every = [e async for e in feed]
    assert [e.position for e in every] == [c.position for c in changes]
    assert feed.stats.delivered == len(changes)

    expected = [c for c in changes if c.table.endswith(".transactions") and c.operation in ("insert", "delete")]
    async with Feed(
        unique_name, start="earliest", bootstrap_servers=kafka_bootstrap, tables=["transactions"], operations=["insert", "delete"], until_end=True
    ) as feed:
        some = [e async for e in feed]
    assert [(e.position, e.table, e.operation) for e in some] == [(c.position, c.table, c.operation) for c in expected]
    assert some[0].row() == expected[0].row

    async with Feed(unique_name, start="earliest", bootstrap_servers=kafka_bootstrap, tables=["audit.*", "public.u*"], until_end=True) as feed:
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
    async with Feed(unique_name, start="earliest", group_id=group, bootstrap_servers=kafka_bootstrap) as feed:
        seen += [e.position for e in await _collect(feed, len(first))]
    # A re-send of the last 25 events (and a duplicate inside the new ones), then new events.
    dup = [c.record() for c in first[-25:]]
    await produce(kafka_bootstrap, unique_name, dup + [c.record() for c in second[:5]] + dup[:3] + [c.record() for c in second[5:]])
    async with Feed(unique_name, start="earliest", group_id=group, bootstrap_servers=kafka_bootstrap, until_end=True) as feed:
        seen += [e.position for e in feed_events] if (feed_events := [e async for e in feed]) else []
    assert seen == [c.position for c in changes]
    assert feed.stats.duplicates_skipped == 28


async def test_handler_exception_means_redelivery(kafka_bootstrap: str, unique_name: str) -> None:
    changes = workload(random.Random(3), 10, TABLES)
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in changes])
    group = unique_name + "-g"
    with pytest.raises(RuntimeError):
        async with Feed(unique_name, start="earliest", group_id=group, bootstrap_servers=kafka_bootstrap) as feed:
            async for event in feed:
                if event.position == changes[5].position:
                    raise RuntimeError("handler failed")
    async with Feed(unique_name, start="earliest", group_id=group, bootstrap_servers=kafka_bootstrap, until_end=True) as feed:
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
    feed = Feed(unique_name, start="earliest", group_id=group, bootstrap_servers=kafka_bootstrap, tables=["public.*"], transaction_linger=0.3, until_end=True)
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
    async with Feed(unique_name, start="earliest", group_id=group, bootstrap_servers=kafka_bootstrap, until_end=True) as feed:
        assert [e async for e in feed] == []


async def test_a_short_linger_does_not_split_transactions_already_in_the_topic(kafka_bootstrap: str, unique_name: str) -> None:
    # transaction_linger=0.01 split 30,000-row transactions wholly in the topic into two or three
    # (the linger ran out between two fetches while catching up; a client fuzz).
    sizes = [5_000, 5_000, 1]
    changes = [Change(0x1000_0000 + 100 * t, seq, 900 + t, "public.users", "insert", {"id": 100_000 * t + seq, "a": "x" * 400})
               for t, n in enumerate(sizes) for seq in range(n)]  # ~13 MB each: many fetches
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in changes])
    # Small fetches and a 1 ms linger: every fetch's round trip outlasts the linger.
    small = {"max_partition_fetch_bytes": 16384, "fetch_max_bytes": 16384}
    async with Feed(unique_name, start="earliest", bootstrap_servers=kafka_bootstrap, transaction_linger=0.001,
                    until_end=True, consumer_options=small) as feed:
        got = [len(t.events) async for t in feed.transactions()]
    assert got == sizes


POISON_KEY = b"FFFFFFFFFFFFFFFF-FFFFFFFF"


def _invalid_count(topic: str, reader: str = "feed") -> float:
    return REGISTRY.get_sample_value("walbus_client_invalid_records_total", {"reader": reader, "topic": topic}) or 0.0


def _misaligned(position: tuple[int, int]) -> bytes:
    """An insert whose columns, types and values differ in length (issue 13, defect 6)."""
    value = orjson.loads(Change(position[0], position[1], 1, "public.users", "insert", {"id": 2, "a": "y"}).record()[1] or b"")
    value["values"] = [2, "y", 7]
    return orjson.dumps(value)


async def test_invalid_records_move_no_position(kafka_bootstrap: str, unique_name: str) -> None:
    """A high key with a garbage value (or with another event's value) must not poison the group."""
    changes = workload(random.Random(5), 20, TABLES)
    first, second = changes[:15], changes[15:]
    wrong_key_event = Change(first[-1].commit_lsn + 1, 0, 1, "public.users", "insert", {"id": 9, "v": 9}).record()[1]
    bad = [
        (POISON_KEY, b"garbage"),
        (POISON_KEY, wrong_key_event),  # a valid event, but the key is not its position
        (None, wrong_key_event),
        (b"not-a-key", wrong_key_event),
        (event_key(first[-1].commit_lsn + 2, 0), _misaligned((first[-1].commit_lsn + 2, 0))),
    ]
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in first] + bad + [c.record() for c in second[:5]])
    group = unique_name + "-g"
    async with Feed(unique_name, start="earliest", group_id=group, bootstrap_servers=kafka_bootstrap, until_end=True) as feed:
        got = [e.position async for e in feed]
    assert got == [c.position for c in first + second[:5]]
    assert feed.stats.invalid_skipped == len(bad) and feed.stats.duplicates_skipped == 0
    assert _invalid_count(unique_name) == len(bad)
    # The group's stored position is the last valid event's: a restart is not poisoned either.
    await produce(kafka_bootstrap, unique_name, [c.record() for c in second[5:]])
    async with Feed(unique_name, start="earliest", group_id=group, bootstrap_servers=kafka_bootstrap, until_end=True) as feed:
        assert [e.position async for e in feed] == [c.position for c in second[5:]]
    # transactions() skips them the same way.
    async with Feed(unique_name, start="earliest", bootstrap_servers=kafka_bootstrap, transaction_linger=0.2, until_end=True) as feed:
        txns = [t async for t in feed.transactions()]
    assert [e.position for t in txns for e in t.events] == [c.position for c in changes]
    assert all(e.row() is None or set(e.row() or {}) == {"id", "v"} for t in txns for e in t.events)


async def test_a_poisoned_stored_position_is_ignored(kafka_bootstrap: str, unique_name: str) -> None:
    """Older feeds stored the position of any key: such a group recovers, a sound one keeps its mark."""
    changes = workload(random.Random(6), 20, TABLES)
    first, second = changes[:10], changes[10:]
    resent = [c.record() for c in first[-3:]]
    await create_topic(kafka_bootstrap, unique_name)
    # offsets 0-9: first; 10: the poison; 11-13: a re-send of first[-3:]; then second.
    await produce(kafka_bootstrap, unique_name, [c.record() for c in first] + [(POISON_KEY, b"garbage")] + resent + [c.record() for c in second])
    tp = TopicPartition(unique_name, 0)
    poisoned, sound = unique_name + "-poisoned", unique_name + "-sound"
    for group, offset, key in ((poisoned, 11, POISON_KEY), (sound, 10, event_key(*first[-1].position))):
        committer = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=group, enable_auto_commit=False)
        await committer.start()
        try:
            committer.assign([tp])
            await committer.commit({tp: (offset, "walbus-feed/1:" + key.decode())})
        finally:
            await committer.stop()

    async with Feed(unique_name, start="earliest", group_id=poisoned, bootstrap_servers=kafka_bootstrap, until_end=True) as feed:
        got = [e.position async for e in feed]
    # The mark is gone, so the re-send after the committed offset comes through once.
    assert got == [c.position for c in first[-3:] + second]
    ignored = REGISTRY.get_sample_value("walbus_client_stored_positions_ignored_total", {"topic": unique_name})
    assert ignored == 1

    async with Feed(unique_name, start="earliest", group_id=sound, bootstrap_servers=kafka_bootstrap, until_end=True) as feed:
        got = [e.position async for e in feed]
    assert got == [c.position for c in second]
    assert feed.stats.duplicates_skipped == 3 and feed.stats.invalid_skipped == 1


async def test_fetched_records_are_made_only_as_they_are_reached(kafka_bootstrap: str, unique_name: str) -> None:
    """A fetch of many records does not make them all at once (lazy batches): the buffer holds a
    few, so the garbage collector's young generations never see thousands of live records."""
    changes = workload(random.Random(3), 2_000, TABLES)
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in changes[:1_000]])
    # compressed batches too: each is decompressed when the feed reaches it
    await produce(kafka_bootstrap, unique_name, [c.record() for c in changes[1_000:]], compression="gzip")

    largest = 0
    async with Feed(unique_name, start="earliest", bootstrap_servers=kafka_bootstrap, until_end=True) as feed:
        positions = []
        async for event in feed:
            positions.append(event.position)
            for state in feed._parts.values():
                largest = max(largest, len(state.buffer))
    assert positions == [c.position for c in changes]
    assert feed._runs, "aiokafka's fetcher shortcut is off: the lazy batches are not exercised"
    assert 0 < largest <= REFILL_RECORDS


async def test_a_resume_inside_a_large_batch_reads_on(kafka_bootstrap: str, unique_name: str) -> None:
    """The group's offset lands inside a record batch of hundreds of records: the feed reads on
    from there. The part of the batch after the offset came as a list, which the lazy refill
    re-read from its start for ever (a busy loop that never yielded: the soak's stalled feed)."""
    changes = workload(random.Random(8), 600, TABLES)
    await create_topic(kafka_bootstrap, unique_name)
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", linger_ms=200, max_batch_size=4 << 20)
    await producer.start()
    try:
        await asyncio.gather(*[await producer.send(unique_name, key=k, value=v, partition=0) for k, v in (c.record() for c in changes)])
    finally:
        await producer.stop()
    tp, group, resume_at = TopicPartition(unique_name, 0), unique_name + "-g", 10
    reader = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, enable_auto_commit=False)
    await reader.start()
    try:
        reader.assign([tp])
        reader.seek(tp, resume_at)
        assert read_in_runs(reader)
        first_run = (await reader.getmany(tp, timeout_ms=10_000))[tp][0]
    finally:
        await reader.stop()
    # the precondition: the seek lands inside one batch with more than a refill after it
    assert first_run[0].offset == resume_at and len(first_run) > 2 * REFILL_RECORDS
    committer = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=group, enable_auto_commit=False)
    await committer.start()
    try:
        committer.assign([tp])
        await committer.commit({tp: resume_at})
    finally:
        await committer.stop()

    got: list[tuple[int, int]] = []

    async def read() -> None:
        async with Feed(unique_name, start="earliest", group_id=group, bootstrap_servers=kafka_bootstrap, until_end=True) as feed:
            got.extend([e.position async for e in feed])

    # In a thread of its own: the old busy loop never yielded, so no asyncio timeout could end it.
    reading = threading.Thread(target=asyncio.run, args=(read(),), daemon=True)
    reading.start()
    await asyncio.to_thread(reading.join, 60)
    assert not reading.is_alive(), "the feed never got past the batch it resumed inside"
    assert got == [c.position for c in changes[resume_at:]]


async def test_transactions_waits_for_the_rest_of_a_commit_while_the_producer_beats(
    kafka_bootstrap: str, unique_name: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A producer that stalls in the middle of a large transaction (a slow broker, a leader
    # election) for longer than transaction_linger split it into two Transactions with the
    # same commit_lsn, and the last transaction of a quiet topic waited out the linger. With
    # heartbeats, silence no longer ends a transaction while the producer beats and has not
    # confirmed past it, and a heartbeat confirmed past it ends it at once.
    from walbus.client import beats as beats_module
    from walbus.contract import Heartbeat, heartbeat_topic

    beats = heartbeat_topic(unique_name)
    await create_topic(kafka_bootstrap, unique_name)
    await create_topic(kafka_bootstrap, beats, compact=True)
    await produce(kafka_bootstrap, beats, [(b"s", Heartbeat("s", 0x90, 0x90, 1).to_json())])
    txn = [Change(0x100, seq, 7, "public.users", "insert", {"id": seq, "a": "x"}) for seq in range(6)]
    await produce(kafka_bootstrap, unique_name, [c.record() for c in txn[:3]])
    got: asyncio.Queue[Transaction] = asyncio.Queue()

    async def read(feed: Feed) -> None:
        async for t in feed.transactions():
            got.put_nowait(t)

    async with Feed(unique_name, start="earliest", bootstrap_servers=kafka_bootstrap, transaction_linger=0.2) as feed:
        reader = asyncio.create_task(read(feed))
        await asyncio.sleep(2.0)  # ten lingers of silence, the producer "alive" (its topic found)
        assert got.empty(), f"split at the stall: {len(got.get_nowait().events)} events"
        await produce(kafka_bootstrap, unique_name, [c.record() for c in txn[3:]])
        await produce(kafka_bootstrap, beats, [(b"s", Heartbeat("s", 0x108, 0x108, 2).to_json())])
        first = await asyncio.wait_for(got.get(), 15)
        assert len(first.events) == 6 and got.empty()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader

    # A long linger: the heartbeat past the commit ends the transaction, not the linger.
    more = [Change(0x200, seq, 8, "public.users", "insert", {"id": 10 + seq, "a": "y"}) for seq in range(2)]
    async with Feed(unique_name, start="earliest", bootstrap_servers=kafka_bootstrap, transaction_linger=60) as feed:
        reader = asyncio.create_task(read(feed))
        assert (await asyncio.wait_for(got.get(), 15)).commit_lsn == 0x100  # confirmed: at once
        await produce(kafka_bootstrap, unique_name, [c.record() for c in more])
        await asyncio.sleep(0.5)
        await produce(kafka_bootstrap, beats, [(b"s", Heartbeat("s", 0x208, 0x208, 3).to_json())])
        assert (await asyncio.wait_for(got.get(), 15)).commit_lsn == 0x200  # not the 60 s linger
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader

    # Heartbeats that stopped: silence ends a transaction again (after BEAT_WAIT_S).
    monkeypatch.setattr(beats_module, "BEAT_WAIT_S", 1.0)
    async with Feed(unique_name, start="earliest", bootstrap_servers=kafka_bootstrap, transaction_linger=0.2) as feed:
        reader = asyncio.create_task(read(feed))
        await produce(kafka_bootstrap, unique_name, [Change(0x300, 0, 9, "public.users", "insert", {"id": 99, "a": "z"}).record()])
        lsns = [(await asyncio.wait_for(got.get(), 15)).commit_lsn for _ in range(3)]
        assert lsns == [0x100, 0x200, 0x300]
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader


async def test_a_heartbeat_topic_record_that_is_no_heartbeat_is_logged_and_counted(
    kafka_bootstrap: str, unique_name: str, caplog: pytest.LogCaptureFixture,
) -> None:
    # Junk on the heartbeat topic (another tool's record, a heartbeat of a later version) was
    # passed over in silence: transactions() and wait_until then waited out BEAT_WAIT_S as if
    # the producer did not beat, with nothing saying why. Contained like the feed's records now.
    from prometheus_client import CollectorRegistry

    from walbus.client.beats import HeartbeatWatch
    from walbus.client.metrics import client_metrics
    from walbus.contract import Heartbeat, heartbeat_topic

    beats_topic = heartbeat_topic(unique_name)
    await create_topic(kafka_bootstrap, beats_topic, compact=True)
    await produce(kafka_bootstrap, beats_topic, [(b"s", Heartbeat("s", 0x10, 0x10, 1).to_json())])
    registry = CollectorRegistry()
    watch = HeartbeatWatch({"bootstrap_servers": kafka_bootstrap}, unique_name, metrics=client_metrics(registry))
    await watch.start()
    try:
        async with asyncio.timeout(30):
            while watch.confirmed != 0x10:
                await watch.advanced.wait()
                watch.advanced.clear()
            caplog.clear()
            await produce(kafka_bootstrap, beats_topic, [(b"s", b'{"v":2,"slot":"s"}'), (b"x", b"\xff junk"),
                                                         (b"s", Heartbeat("s", 0x20, 0x20, 2).to_json())])
            while watch.confirmed != 0x20:  # read after the two records before it
                await watch.advanced.wait()
                watch.advanced.clear()
    finally:
        await watch.stop()
    assert registry.get_sample_value("walbus_client_invalid_records_total", {"reader": "heartbeat", "topic": beats_topic}) == 2
    lines = [r for r in caplog.records if r.name == "walbus.client.beats" and r.levelname == "ERROR"]
    assert len(lines) == 2 and all(getattr(r, "topic", None) == beats_topic for r in lines)



@pytest.fixture(scope="module")
def own_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaInstance]:
    """A broker of this module's own, which its tests pause (SIGSTOP) and resume."""
    broker = KafkaInstance(tmp_path_factory.mktemp("kafka"), free_port(), free_port())
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@contextlib.contextmanager
def paused(broker: KafkaInstance) -> Iterator[None]:
    pid = broker.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


async def test_transactions_rides_out_a_broker_that_stops_answering_while_it_checks_a_commit(
    own_broker: KafkaInstance, unique_name: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Once a heartbeat confirmed past a held commit, transactions() looks the topic's end
    # offsets up. A broker that did not answer within the request timeout (a GC pause, a
    # leader election, a restart) raised KafkaTimeoutError out of the caller's loop, where
    # the Feed otherwise waits out such faults: a transient fault ended the subscriber.
    from walbus.client.beats import HeartbeatWatch
    from walbus.contract import Heartbeat, heartbeat_topic

    bootstrap = own_broker.bootstrap
    beats = heartbeat_topic(unique_name)
    await create_topic(bootstrap, unique_name)
    await create_topic(bootstrap, beats, compact=True)
    await produce(bootstrap, beats, [(b"s", Heartbeat("s", 0x108, 0x108, 1).to_json())])
    txn = [Change(0x100, seq, 7, "public.users", "insert", {"id": seq, "a": "x"}) for seq in range(3)]
    await produce(bootstrap, unique_name, [c.record() for c in txn])
    # The heartbeat past the commit counts only once the broker is paused, so that the
    # end-offsets look-up meets the paused broker (the outage is real; only its moment is set).
    asked, gate = asyncio.Event(), asyncio.Event()
    past = HeartbeatWatch.past

    def gated_past(self: HeartbeatWatch, lsn: int) -> bool:
        asked.set()
        return gate.is_set() and past(self, lsn)

    monkeypatch.setattr(HeartbeatWatch, "past", gated_past)
    got: asyncio.Queue[Transaction] = asyncio.Queue()

    async def read(feed: Feed) -> None:
        async for t in feed.transactions():
            got.put_nowait(t)

    async with Feed(unique_name, start="earliest", bootstrap_servers=bootstrap, transaction_linger=0.2,
                    consumer_options={"request_timeout_ms": 2000}) as feed:
        reader = asyncio.create_task(read(feed))
        await asyncio.wait_for(asked.wait(), 60)  # the commit is read and held
        with paused(own_broker):
            gate.set()
            await asyncio.sleep(6)  # three request timeouts
            assert not reader.done(), reader.exception()
            assert got.empty()
        first = await asyncio.wait_for(got.get(), 60)
        assert [e.seq for e in first.events] == [0, 1, 2] and first.commit_lsn == 0x100
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader


async def test_a_consumer_stopped_while_a_fetch_backs_off_stops_without_cancelling_its_caller(
    own_broker: KafkaInstance, unique_name: str,
) -> None:
    # aiokafka sleeps out a failed fetch's retry back-off unguarded: stopped then, the consumer
    # let a CancelledError out of stop() (aiokafka issue #647), and a Feed's or Table's close
    # ended its caller's task as if cancelled, its connections left open.
    from walbus.kafka import stop_consumer

    bootstrap = own_broker.bootstrap
    await create_topic(bootstrap, unique_name)
    raw = AIOKafkaConsumer(bootstrap_servers=bootstrap, request_timeout_ms=1000, retry_backoff_ms=20_000)
    ours = AIOKafkaConsumer(bootstrap_servers=bootstrap, request_timeout_ms=1000, retry_backoff_ms=20_000)
    for consumer in (raw, ours):
        await consumer.start()
        consumer.assign([TopicPartition(unique_name, 0)])
        # its position known (no offset look-up left to fail), its fetches under way
        assert await consumer.position(TopicPartition(unique_name, 0)) == 0
        assert await consumer.getmany(timeout_ms=500) == {}
    with paused(own_broker):
        await asyncio.sleep(4)  # each fetch timed out (1 s) and sleeps its 20 s back-off
        with pytest.raises(asyncio.CancelledError):
            await raw.stop()  # the defect, as aiokafka has it
        started = asyncio.get_running_loop().time()
        await stop_consumer(ours)
        assert asyncio.get_running_loop().time() - started < 10  # not the back-off
    assert ours._client._conns == {}  # its connections closed
    with contextlib.suppress(BaseException):
        await raw._client.close()
