"""Table against a real broker: state after a randomized workload, live updates, wait_until."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import orjson
import pytest
from prometheus_client import REGISTRY

from tests.support.cdc_data import (
    ScriptedDemux,
    final_state,
    table_records,
    workload,
)
from tests.support.kafka import create_topic, produce
from walbus.client import Table, TableChange, TableError
from walbus.contract import demux_group
from walbus.kafka import KafkaAdmin

pytestmark = pytest.mark.integration


async def test_state_after_random_workload_with_tombstones(kafka_bootstrap: str, unique_name: str) -> None:
    changes = workload(random.Random(11), 400, ["public.t"])
    assert any(c.operation == "delete" for c in changes)
    records = table_records(changes, "public.t")
    topic = f"walbus.{unique_name}.public.t"
    await create_topic(kafka_bootstrap, topic, compact=True)
    half = len(records) // 2
    await produce(kafka_bootstrap, topic, records[:half])

    store: dict[Any, dict[str, Any]] = {}
    seen: list[TableChange] = []
    expected = final_state(changes, "public.t")
    converged = asyncio.Event()

    def on_change(change: TableChange) -> None:
        seen.append(change)
        if dict(store) == expected:
            converged.set()

    table = Table(topic, bootstrap_servers=kafka_bootstrap, store=store, on_change=on_change)
    async with table:
        loaded = dict(table)
        converged.clear()
        await produce(kafka_bootstrap, topic, records[half:])
        async with asyncio.timeout(30):
            await converged.wait()
        assert store is table.rows and len(table) == len(expected)
        some = next(iter(expected))
        assert table.get(some) == expected[some] == table.get({"id": some})
        assert some in table and {"id": some} in table and -1 not in table
    # State after the first half equals replaying the first half of the changes.
    first_half_changes = [c for c in changes if c.table == "public.t"][:half]
    assert loaded == final_state(first_half_changes, "public.t")
    deletes = [c for c in seen if c.new is None]
    assert deletes and all(c.op == "d" and c.old is not None for c in deletes)
    assert all(c.commit_lsn is not None for c in seen if c.new is not None)


async def test_wait_until_waits_for_the_demux(kafka_bootstrap: str, unique_name: str) -> None:
    source = f"walbus.{unique_name}"
    topic = f"{source}.public.a"
    group = demux_group(source)  # the demux's default group id
    changes = workload(random.Random(12), 30, ["public.a", "public.b"])
    await create_topic(kafka_bootstrap, source)
    await create_topic(kafka_bootstrap, topic, compact=True)
    await produce(kafka_bootstrap, source, [c.record() for c in changes])
    commits = sorted({c.commit_lsn for c in changes})
    demux = ScriptedDemux(kafka_bootstrap, source, group, transactional_id=f"{unique_name}-tx")
    await demux.start()

    async def demux_up_to(index: int) -> None:
        """Process the database topic up to and including commit ``commits[index]``."""
        done = [c for c in changes if c.commit_lsn <= commits[index]]
        already = demux_up_to.done  # type: ignore[attr-defined]
        batch = done[already:]
        await demux.write([(topic, r) for r in table_records(batch, "public.a")], source_offset=len(done))
        demux_up_to.done = len(done)  # type: ignore[attr-defined]

    demux_up_to.done = 0  # type: ignore[attr-defined]
    try:
        await demux_up_to(9)
        async with Table(topic, bootstrap_servers=kafka_bootstrap) as table:
            assert table.source_group == group
            assert dict(table) == final_state([c for c in changes if c.commit_lsn <= commits[9]], "public.a")
            async with asyncio.timeout(10):
                await table.wait_until(commits[9])  # already reflected
                await table.wait_until(commits[3])

            target = commits[20]
            waiter = asyncio.create_task(table.wait_until(target))
            await asyncio.sleep(1.0)
            assert not waiter.done(), "returned although the demux has not processed the commit"
            await demux_up_to(19)
            await asyncio.sleep(0.5)
            assert not waiter.done()
            await demux_up_to(25)
            async with asyncio.timeout(15):
                await waiter
            assert dict(table) == final_state([c for c in changes if c.commit_lsn <= commits[25]], "public.a")

            # A commit that touched only the other table: reflected once the demux is past it.
            b_only = [lsn for lsn in commits[26:] if all(c.table == "public.b" for c in changes if c.commit_lsn == lsn)]
            later = b_only[0] if b_only else commits[-1]
            waiter = asyncio.create_task(table.wait_until(later))
            await asyncio.sleep(0.5)
            assert not waiter.done()
            await demux_up_to(len(commits) - 1)
            async with asyncio.timeout(15):
                await waiter

            # An LSN not in the database topic yet: waits for a commit at or after it.
            future = commits[-1] + 1000
            waiter = asyncio.create_task(table.wait_until(future))
            await asyncio.sleep(0.5)
            assert not waiter.done()
            from tests.support.cdc_data import Change

            extra = [Change(future + 10, 0, 999, "public.a", "insert", {"id": 100000, "v": 1})]
            await produce(kafka_bootstrap, source, [c.record() for c in extra])
            await demux.write([(topic, r) for r in table_records(extra, "public.a")], source_offset=len(changes) + 1)
            async with asyncio.timeout(15):
                await waiter  # every commit <= future is reflected (there is none past commits[-1])
                # The extra row committed *after* `future`: waiting for `future` alone may return
                # before the demux wrote it; waiting for its own commit may not.
                await table.wait_until(future + 10)
            assert table.get(100000) == {"id": 100000, "v": 1}
    finally:
        await demux.stop()


async def test_wait_until_counts_a_commit_fetched_past_the_ends_it_looked_up(
    kafka_bootstrap: str, unique_name: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The commit reached the database topic just after wait_until looked up its end offsets,
    # and the fetch brought it anyway: the demux group's offset reaching those ends (the commit
    # not consumed yet) let wait_until return with the commit nowhere in the table. A client
    # fuzz met it about one wait in 20.
    from tests.support.cdc_data import Change
    from walbus.client import progress

    source = f"walbus.{unique_name}"
    topic = f"{source}.public.a"
    await create_topic(kafka_bootstrap, source)
    await create_topic(kafka_bootstrap, topic, compact=True)
    first = Change(0x100, 0, 1, "public.a", "insert", {"id": 1, "v": 1})
    await produce(kafka_bootstrap, source, [first.record()])
    demux = ScriptedDemux(kafka_bootstrap, source, demux_group(source), transactional_id=f"{unique_name}-tx")
    await demux.start()
    armed = asyncio.Event()
    original = progress.SourceProgress.start

    async def start(self: progress.SourceProgress) -> None:
        await original(self)
        consumer = self._consumer
        assert consumer is not None
        look_up = consumer.end_offsets

        async def end_offsets(tps: Any) -> Any:
            ends = await look_up(tps)
            if armed.is_set():  # the writer commits right after the look-up
                armed.clear()
                await produce(kafka_bootstrap, source, [Change(0x200, 0, 2, "public.a", "update", {"id": 1, "v": 2}).record()])
            return ends

        consumer.end_offsets = end_offsets

    monkeypatch.setattr(progress.SourceProgress, "start", start)
    try:
        await demux.write([(topic, r) for r in table_records([first], "public.a")], source_offset=1)
        async with Table(topic, bootstrap_servers=kafka_bootstrap) as table:
            async with asyncio.timeout(10):
                await table.wait_until(0x100)  # the database topic's cursor is at its end now
            # Two commits of another table: the cursor's consumer fetches the first and keeps it
            # (nobody drains it yet), the second stays unfetched; the demux consumes both.
            await produce(kafka_bootstrap, source, [Change(0x150, 0, 3, "public.b", "insert", {"id": 1}).record()])
            await asyncio.sleep(1)
            await produce(kafka_bootstrap, source, [Change(0x160, 0, 4, "public.b", "insert", {"id": 2}).record()])
            await demux.write([], source_offset=3)
            armed.set()
            waiter = asyncio.create_task(table.wait_until(0x200))
            await asyncio.sleep(3)
            assert not armed.is_set()
            assert not waiter.done(), f"returned before the demux consumed commit 0x200: {table[1]}"
            waiter.cancel()
    finally:
        await demux.stop()


def _bad_records(rows: dict[int, dict[str, Any]]) -> list[tuple[bytes | None, bytes | None]]:
    """Records the demux never writes; the ids are of rows the table holds, so a wrong apply shows."""
    ids = list(rows)
    meta = {"__op": "u", "__lsn": 1, "__commit_lsn": 2, "__seq": 0, "__xid": 3, "__ts": "x"}
    return [
        (orjson.dumps({"id": ids[0]}), b"garbage"),
        (b"not json", orjson.dumps({"id": ids[1], "v": -1, **meta})),
        (orjson.dumps({"id": ids[2]}), b"[1, 2]"),
        (orjson.dumps({"id": ids[3]}), orjson.dumps({"id": ids[3], "v": -1})),  # no __op: not a delete
        # A row built from misaligned lists: its key column disagrees with the record key.
        (orjson.dumps({"id": ids[4]}), orjson.dumps({"id": -1, "v": ids[4], **meta})),
        (orjson.dumps({"id": {"a": 1}}), orjson.dumps({"id": 1, **meta})),
        (orjson.dumps({"id": ids[5]}), orjson.dumps({"id": ids[5], "v": -1, **meta, "__commit_lsn": "7"})),
    ]


async def test_bad_records_are_skipped_and_the_table_keeps_going(kafka_bootstrap: str, unique_name: str) -> None:
    changes = workload(random.Random(13), 120, ["public.t"])
    records = table_records(changes, "public.t")
    half = len(records) // 2
    topic = f"walbus.{unique_name}.public.t"
    first_state = final_state([c for c in changes if c.table == "public.t"][:half], "public.t")
    assert len(first_state) >= 6
    bad = _bad_records(first_state)
    await create_topic(kafka_bootstrap, topic, compact=True)
    await produce(kafka_bootstrap, topic, records[:half] + bad)
    expected = final_state(changes, "public.t")
    store: dict[Any, dict[str, Any]] = {}
    converged = asyncio.Event()

    def on_change(change: TableChange) -> None:
        if store == expected:
            converged.set()

    async with Table(topic, bootstrap_servers=kafka_bootstrap, store=store, on_change=on_change) as table:
        assert dict(table) == first_state  # loaded past the bad records, none of them applied
        await produce(kafka_bootstrap, topic, bad + records[half:])
        async with asyncio.timeout(30):
            await converged.wait()
        assert table.invalid_skipped == 2 * len(bad)
    invalid = REGISTRY.get_sample_value("walbus_client_invalid_records_total", {"reader": "table", "topic": topic})
    assert invalid == 2 * len(bad)


async def test_reads_raise_once_the_reader_failed(kafka_bootstrap: str, unique_name: str) -> None:
    changes = workload(random.Random(14), 20, ["public.t"])
    topic = f"walbus.{unique_name}.public.t"
    await create_topic(kafka_bootstrap, topic, compact=True)
    await produce(kafka_bootstrap, topic, table_records(changes, "public.t"))
    async with Table(topic, bootstrap_servers=kafka_bootstrap, follow_demux=False) as table:
        some = next(iter(table))
        assert table.get(some) is not None
        async with KafkaAdmin(client_kwargs={"bootstrap_servers": kafka_bootstrap}) as admin:
            await admin.delete_topics([topic])
        async with asyncio.timeout(60):
            while True:
                try:
                    len(table)
                except TableError:
                    break
                await asyncio.sleep(0.2)
        with pytest.raises(TableError, match="failed"):
            table.get(some)
        with pytest.raises(TableError):
            _ = some in table
        with pytest.raises(TableError):
            list(table)
        with pytest.raises(TableError):
            await table.wait_until(changes[-1].commit_lsn)


async def test_a_composite_key_in_dict_form_is_read_by_column_name(kafka_bootstrap: str, unique_name: str) -> None:
    # get({"b": 2, "a": 1}) read the dict's values in its own order: (2, 1), another row's key
    # (a client fuzz found it).
    topic = f"walbus.{unique_name}.public.pairs"
    await create_topic(kafka_bootstrap, topic, compact=True)
    meta = {"__op": "c", "__lsn": 1, "__commit_lsn": 1, "__seq": 0, "__xid": 1, "__ts": "2026-01-01T00:00:00+00:00"}
    await produce(kafka_bootstrap, topic, [
        (orjson.dumps({"a": a, "b": b}), orjson.dumps({"a": a, "b": b, "v": f"{a}{b}", **meta})) for a, b in [(1, 2), (2, 1)]
    ])
    async with Table(topic, bootstrap_servers=kafka_bootstrap, follow_demux=False) as table:
        assert table.get({"a": 1, "b": 2})["v"] == "12"  # type: ignore[index]
        assert table.get({"b": 2, "a": 1})["v"] == "12"  # type: ignore[index]
        assert table[orjson.dumps({"b": 1, "a": 2})]["v"] == "21"
        assert table.get((1, 2))["v"] == "12"  # type: ignore[index]
        assert table.get({"a": 1, "x": 2}) is None and {"a": 1, "x": 2} not in table and {"a": 1} not in table
        assert {"b": 2, "a": 1} in table


async def test_stop_ends_every_wait_and_concurrent_waits_share_one_consumer(
    kafka_bootstrap: str, unique_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # stop() during a wait: one waiting for the demux died in an AttributeError, one waiting for
    # the table's reader waited for good. And ten first waits at once started ten high-watermark
    # consumers, nine of them never stopped (a client fuzz).
    import walbus.client.table as table_module

    started: list[Any] = []

    class Counting(table_module.AIOKafkaConsumer):  # type: ignore[misc]
        async def start(self) -> None:
            if self._isolation_level == "read_uncommitted":
                started.append(self)
            await super().start()

    monkeypatch.setattr(table_module, "AIOKafkaConsumer", Counting)
    source = f"walbus.{unique_name}"
    topic = f"{source}.public.a"
    changes = workload(random.Random(14), 20, ["public.a"])
    await create_topic(kafka_bootstrap, source)
    await create_topic(kafka_bootstrap, topic, compact=True)
    await produce(kafka_bootstrap, source, [c.record() for c in changes])
    commits = sorted({c.commit_lsn for c in changes})
    demux = ScriptedDemux(kafka_bootstrap, source, demux_group(source), transactional_id=f"{unique_name}-tx")
    await demux.start()
    try:
        # The demux wrote every row and committed its offset, but the table is behind: the waits
        # reach step 4 (the table's own reader). A Table without a group skips step 3.
        await demux.write([(topic, r) for r in table_records(changes, "public.a")], source_offset=len(changes))
        table = Table(topic, bootstrap_servers=kafka_bootstrap)
        await table.start()
        async with asyncio.timeout(30):
            await asyncio.gather(*(table.wait_until(commits[-1]) for _ in range(10)))
        assert len(started) == 1
        # Step 3, waiting for a demux that never gets there: stop() ends it with TableError.
        waiting = asyncio.create_task(table.wait_until(commits[-1] + 1000))
        await asyncio.sleep(1.0)
        assert not waiting.done()
        await table.stop()
        with pytest.raises(TableError, match="Table stopped"):
            async with asyncio.timeout(10):
                await waiting
        assert all(c._closed for c in started)
    finally:
        await demux.stop()



async def test_wait_until_waits_for_the_rest_of_a_commit_written_over_several_batches(
    kafka_bootstrap: str, unique_name: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The producer writes a large transaction over several batches, and its first events told
    # wait_until (step 2) that the commit was in the database topic: it returned with part of
    # it (9,500-17,000 rows of 30,000 in a client fuzz). Now a commit's own events do not end
    # step 2: a later commit's event or a heartbeat confirmed past it does (and, with no
    # heartbeat for BEAT_WAIT_S, the first event again, with a warning).
    from tests.support.cdc_data import Change
    from walbus.client import beats as beats_module
    from walbus.client import progress
    from walbus.contract import Heartbeat, heartbeat_topic

    source = f"walbus.{unique_name}"
    beats = heartbeat_topic(source)
    await create_topic(kafka_bootstrap, source)
    await create_topic(kafka_bootstrap, beats, compact=True)
    part = [Change(0x100, i, 1, "public.a", "insert", {"id": i, "v": i}) for i in range(3)]
    await produce(kafka_bootstrap, source, [c.record() for c in part])
    await produce(kafka_bootstrap, beats, [(b"s", Heartbeat("s", 0x90, 0x100, 1).to_json())])

    async def step_2(lsn: int, wait_s: float) -> bool:
        watch = progress.SourceProgress({"bootstrap_servers": kafka_bootstrap}, source, None)
        await watch.start()
        try:
            async with asyncio.timeout(wait_s):
                await watch.commit_reached(lsn)
        except TimeoutError:
            return False
        finally:
            await watch.stop()
        return True

    assert not await step_2(0x100, 2.0), "returned on the commit's first events"
    await produce(kafka_bootstrap, beats, [(b"s", Heartbeat("s", 0x108, 0x108, 2).to_json())])
    assert await step_2(0x100, 10.0), "a heartbeat confirmed past the commit did not end the wait"
    assert not await step_2(0x200, 2.0)  # an LSN past every commit and heartbeat
    await produce(kafka_bootstrap, source, [Change(0x300, 0, 2, "public.b", "insert", {"id": 1}).record()])
    assert await step_2(0x200, 10.0), "a later commit's event did not end the wait"
    monkeypatch.setattr(beats_module, "BEAT_WAIT_S", 0.5)  # heartbeats stopped: the first event again
    await produce(kafka_bootstrap, source, [Change(0x400, 0, 3, "public.a", "insert", {"id": 9, "v": 9}).record()])
    assert await step_2(0x400, 10.0)


async def test_wait_until_fails_fast_when_the_source_topic_does_not_exist(kafka_bootstrap: str, unique_name: str) -> None:
    # The default source topic is the table topic without `.<schema>.<table>`. A producer
    # started with its own --topic (`orders`, read by a demux writing `walbus.orders.…`)
    # leaves no topic of that name, and wait_until waited for it to appear, for good, with
    # one info line ("waiting for topic to exist"); a configuration error must say so.
    changes = workload(random.Random(15), 10, ["public.t"])
    topic = f"walbus.{unique_name}.public.t"
    await create_topic(kafka_bootstrap, topic, compact=True)
    await produce(kafka_bootstrap, topic, table_records(changes, "public.t"))
    async with Table(topic, bootstrap_servers=kafka_bootstrap) as table:
        assert table.source_topic == f"walbus.{unique_name}"
        async with asyncio.timeout(20):
            with pytest.raises(LookupError, match=rf"walbus\.{unique_name}.*source_topic="):
                await table.wait_until(changes[-1].commit_lsn + 1)
            # Asked again (the topic may have been created meanwhile): the same clear error.
            with pytest.raises(LookupError, match="source_topic="):
                await table.wait_until(changes[-1].commit_lsn + 1)
        assert dict(table) == final_state(changes, "public.t")  # the table itself still serves its rows


async def test_wait_until_takes_an_lsn_as_postgresql_writes_it(kafka_bootstrap: str, unique_name: str) -> None:
    # psycopg returns pg_lsn values (SELECT pg_current_wal_lsn()) as text, "0/52F29150": given
    # to wait_until it was a TypeError from comparing it with the table's integer positions.
    from walbus.contract import Lsn

    changes = workload(random.Random(16), 10, ["public.t"])
    topic = f"walbus.{unique_name}.public.t"
    await create_topic(kafka_bootstrap, topic, compact=True)
    await produce(kafka_bootstrap, topic, table_records(changes, "public.t"))
    async with Table(topic, bootstrap_servers=kafka_bootstrap) as table, asyncio.timeout(20):
        applied = max(c.commit_lsn for c in changes)
        earlier = str(Lsn(applied - 1))  # "X/Y": reflected already, at once
        assert table.reflects(earlier)
        await table.wait_until(earlier)
        with pytest.raises(ValueError, match="not an LSN"):
            await table.wait_until("yesterday")
