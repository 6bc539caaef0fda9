"""The demux against the real broker: re-keying, topics, DLQ, store rebuild, SIGTERM, config errors."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from aiokafka import TopicPartition

from demux.rekey import Rekeyer
from tests.support.demux import (
    ROOT,
    DemuxProc,
    _reap_demux_processes,  # noqa: F401
    demux_args,
    ev,
)
from tests.support.kafka import (
    commit_offset,
    create_topic,
    produce,
    read_ktable,
    read_records,
    topic_config,
    wait_caught_up,
)
from walbus.contract import event_key
from walbus.kafka import KafkaAdmin

pytestmark = pytest.mark.integration

TX = "public.transactions"
INTS = {"id": "int4", "n": "int4"}


def _kw(bootstrap: str) -> dict[str, str]:
    return {"bootstrap_servers": bootstrap}


async def test_pgkafka_transactions_example(kafka_bootstrap: str, unique_name: str, tmp_path: Path) -> None:
    source = f"walbus.{unique_name}"
    await create_topic(kafka_bootstrap, source)
    types = {"transaction_id": "int4", "user_id": "int4", "amount": "int4"}
    events = [
        ev(0x16B374D848, 0, "insert", TX, ["transaction_id"],
           new={"transaction_id": 54441, "user_id": 36036, "amount": 2000}, types=types),
        ev(0x16B374D900, 0, "update", TX, ["transaction_id"],
           new={"transaction_id": 54441, "user_id": 36036, "amount": 2500}, types=types),
        ev(0x16B374DA00, 0, "delete", TX, ["transaction_id"], identity={"transaction_id": 54441}, types=types),
    ]
    await produce(kafka_bootstrap, source, events, partition=0)
    proc = DemuxProc(demux_args(kafka_bootstrap, source, tmp_path / "state"), tmp_path / "demux.log").start()
    try:
        await wait_caught_up(kafka_bootstrap, f"walbus-demux.{source}", source, procs=[proc])
    finally:
        assert proc.stop() == 0, proc.log_tail()
    topic = f"{source}.{TX}"
    recs = await read_records(kafka_bootstrap, topic)
    assert [r.key for r in recs] == [b'{"transaction_id":54441}'] * 3
    first, second = (orjson.loads(r.value) for r in recs[:2])
    assert {k: v for k, v in first.items() if not k.startswith("__")} == {
        "transaction_id": 54441, "user_id": 36036, "amount": 2000}
    assert first["__op"] == "c" and first["__commit_lsn"] == 0x16B374D848 and first["__seq"] == 0
    assert first["__ts"] == "2024-05-01T12:00:00.000001+00:00" and "__lsn" in first and "__xid" in first
    assert second["amount"] == 2500 and second["__op"] == "u"
    assert recs[2].value is None
    assert await read_ktable(client_kwargs=_kw(kafka_bootstrap), topic=topic) == {}
    assert (await topic_config(kafka_bootstrap, topic))["cleanup.policy"] == "compact"


async def test_key_change_toast_no_pk_delete_records_and_topic_settings(
    kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    source = f"walbus.{unique_name}"
    await create_topic(kafka_bootstrap, source)
    # An existing per-table topic with the wrong policy: warned about, still written.
    wrong = f"{source}.public.wrong"
    await create_topic(kafka_bootstrap, wrong, configs={"cleanup.policy": "delete"})
    big = "t" * 20000
    events = [
        ev(0x100, 0, "insert", "public.docs", ["id"], new={"id": 1, "body": big, "n": 0}, types={"id": "int4"}),
        ev(0x100, 1, "insert", "public.log", [], new={"msg": "a"}),
        ev(0x200, 0, "update", "public.docs", ["id"], new={"id": 1, "n": 1}, unchanged=["body"]),
        ev(0x200, 1, "update", "public.docs", ["id"], new={"id": 2, "n": 2}, identity={"id": 1}, unchanged=["body"]),
        ev(0x300, 0, "insert", "public.log", [], new={"msg": "b"}),
        ev(0x300, 1, "insert", "public.wrong", ["id"], new={"id": 1}),
        ev(0x400, 0, "delete", "public.docs", ["id"], identity={"id": 2}),
        # Fixed-width columns only: no store; a truncate reads the keys from the topic.
        *[ev(0x500, i, "insert", "public.nums", ["id"], new={"id": i, "n": i}, types=INTS) for i in range(4)],
        ev(0x600, 0, "delete", "public.nums", ["id"], identity={"id": 2}, types=INTS),
        ev(0x600, 1, "truncate", "public.nums", ["id"]),
        ev(0x700, 0, "insert", "public.nums", ["id"], new={"id": 9, "n": 9}, types=INTS),
    ]
    await produce(kafka_bootstrap, source, events, partition=0)
    args = demux_args(kafka_bootstrap, source, tmp_path / "state", "--emit-delete-records",
                      "--min-compaction-lag-ms", "1000", "--delete-retention-ms", "3600000", "--segment-ms", "600000")
    proc = DemuxProc(args, tmp_path / "demux.log").start()
    try:
        await wait_caught_up(kafka_bootstrap, f"walbus-demux.{source}", source, procs=[proc])
        metrics = proc.settled_metrics(len(events))
    finally:
        assert proc.stop() == 0, proc.log_tail()
    docs = await read_records(kafka_bootstrap, f"{source}.public.docs")
    got = [(r.key, None if r.value is None else orjson.loads(r.value)) for r in docs]
    k1, k2 = b'{"id":1}', b'{"id":2}'
    assert [(k, v and v["__op"]) for k, v in got] == [(k1, "c"), (k1, "u"), (k1, None), (k2, "u"), (k2, "d"), (k2, None)]
    for _, v in got:
        if v is not None:
            assert v["body"] == big  # unchanged TOAST filled, through the key change too
    assert got[4][1] is not None and got[4][1]["n"] == 2  # the delete record carries the last row

    log_topic = f"{source}.public.log"
    log_recs = await read_records(kafka_bootstrap, log_topic)
    assert [(r.key, orjson.loads(r.value)["msg"]) for r in log_recs] == [(None, "a"), (None, "b")]
    assert (await topic_config(kafka_bootstrap, log_topic))["cleanup.policy"] == "delete"
    assert metrics["walbus_demux_no_pk_events_total{table=public.log}"] == 2

    conf = await topic_config(kafka_bootstrap, f"{source}.public.docs")
    assert conf["cleanup.policy"] == "compact"
    assert conf["min.compaction.lag.ms"] == "1000"
    assert conf["delete.retention.ms"] == "3600000"
    assert conf["segment.ms"] == "600000"
    assert len(await read_records(kafka_bootstrap, wrong)) == 1
    warnings = [line for line in proc.log_lines() if line.get("level") == "warning"]
    assert any(w.get("topic") == wrong and w.get("setting") == "cleanup.policy" for w in warnings)
    assert sum(1 for w in warnings if w.get("table") == "public.log") == 1  # once per table
    assert metrics["walbus_demux_tombstones_total{table=public.docs}"] == 2
    nums = await read_records(kafka_bootstrap, f"{source}.public.nums")
    assert [(r.key, r.value is None) for r in nums[4:]] == [
        (b'{"id":2}', False), (b'{"id":2}', True), (b'{"id":0}', True), (b'{"id":1}', True), (b'{"id":3}', True), (b'{"id":9}', False)]
    assert "walbus_demux_state_table_loads_total{table=public.nums}" not in metrics
    assert metrics["walbus_demux_records_produced_total{table=public.docs}"] == 4


async def test_dead_letters_and_store_rebuild(kafka_bootstrap: str, unique_name: str, tmp_path: Path) -> None:
    source = f"walbus.{unique_name}"
    await create_topic(kafka_bootstrap, source)
    good = [ev(0x100, 0, "insert", "public.docs", ["id"], new={"id": 1, "body": "long", "n": 0})]
    missing_table = orjson.dumps({"v": 1, "lsn": 1, "commit_lsn": 2, "seq": 0, "xid": 3, "operation": "insert",
                                  "timestamp": "t", "pk": [], "columns": [], "types": [], "values": []})
    version_9 = orjson.dumps({"v": 9, "operation": "insert"})
    bad = [(b"k-not-json", b"\x00not json{"), (b"k-missing", missing_table), (b"k-v9", version_9)]
    await produce(kafka_bootstrap, source, good + bad, partition=0)
    after = [ev(0x200, 0, "update", "public.docs", ["id"], new={"id": 1, "n": 1}, unchanged=["body"])]
    await produce(kafka_bootstrap, source, after, partition=0)
    state = tmp_path / "state"
    group = f"walbus-demux.{source}"
    proc = DemuxProc(demux_args(kafka_bootstrap, source, state), tmp_path / "demux.log").start()
    try:
        await wait_caught_up(kafka_bootstrap, group, source, procs=[proc])
        metrics = proc.settled_metrics(5)
    finally:
        assert proc.stop() == 0, proc.log_tail()
    dlq = await read_records(kafka_bootstrap, f"{source}.dlq")
    assert [(r.key, r.value) for r in dlq] == bad
    for r, offset in zip(dlq, (1, 2, 3), strict=True):
        headers = dict(r.headers)
        assert headers["walbus.source.partition"] == b"0"
        assert headers["walbus.source.offset"] == str(offset).encode()
        assert headers["walbus.source.topic"] == source.encode()
    assert b"not JSON" in dict(dlq[0].headers)["walbus.error"]
    assert b"table" in dict(dlq[1].headers)["walbus.error"]
    assert b"version" in dict(dlq[2].headers)["walbus.error"]
    assert metrics["walbus_demux_dead_letters_total{reason=contract}"] == 3
    assert metrics["walbus_demux_records_consumed_total{partition=0}"] == 5
    # `walbus dead-letters list --demux` shows them with their reasons (before, only a group's
    # could be listed; the demux's printed "0 dead letter(s)", and tail showed no reason).
    from walbus.client.deadletters import list_demux_dead_letters

    listed = await list_demux_dead_letters(_kw(kafka_bootstrap), f"{source}.dlq")
    assert [(d.key, d.value, d.origin.offset if d.origin else None) for d in listed] == [(k, v, o) for (k, v), o in zip(bad, (1, 2, 3), strict=True)]
    assert "not JSON" in listed[0].error and "version" in listed[2].error
    done = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "walbus.app.cli", "dead-letters", "list", "--topic", source, "--demux",
                         "--kafka-bootstrap", kafka_bootstrap], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0 and "3 dead letter(s) listed" in done.stderr, done.stderr
    assert [orjson.loads(line)["origin"]["offset"] for line in done.stdout.splitlines()] == [1, 2, 3]
    topic = f"{source}.public.docs"
    table = await read_ktable(client_kwargs=_kw(kafka_bootstrap), topic=topic)
    assert table[b'{"id":1}']["body"] == "long" and table[b'{"id":1}']["n"] == 1  # went on after the bad ones

    # Lose the store: the next unchanged-TOAST update is still filled, from the rebuilt store.
    shutil.rmtree(state)
    await produce(kafka_bootstrap, source, [ev(0x300, 0, "update", "public.docs", ["id"], new={"id": 1, "n": 2}, unchanged=["body"])],
                  partition=0)
    proc = DemuxProc(demux_args(kafka_bootstrap, source, state), tmp_path / "demux2.log").start()
    try:
        await wait_caught_up(kafka_bootstrap, group, source, procs=[proc])
        metrics = proc.settled_metrics(1)
    finally:
        assert proc.stop() == 0, proc.log_tail()
    assert metrics["walbus_demux_state_resets_total"] == 1
    assert metrics["walbus_demux_state_table_loads_total{table=public.docs}"] == 1
    table = await read_ktable(client_kwargs=_kw(kafka_bootstrap), topic=topic)
    assert table[b'{"id":1}']["body"] == "long" and table[b'{"id":1}']["n"] == 2
    loads = [line for line in proc.log_lines() if line.get("msg", "").startswith("table loaded into the last-row store")]
    assert [(line["table"], line["rows"]) for line in loads] == [("public.docs", 1)]


def test_config_errors_exit_2(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    for k in list(env):
        if k.startswith("WALBUS_"):
            del env[k]
    cases = [
        ([], "--kafka-bootstrap"),
        (["--kafka-bootstrap", "127.0.0.1:1", "--source-topic", "s", "--txn-max-ms", "-5"], "--txn-max-ms"),
        (["--kafka-bootstrap", "127.0.0.1:1", "--source-topic", "s", "--kafka-security-protocol", "SASL_SSL"],
         "SASL"),
    ]
    for argv, needle in cases:
        res = subprocess.run([sys.executable, "-m", "walbus.app.cli", "demux", *argv], cwd=ROOT, env=env,
                             capture_output=True, timeout=60)
        assert res.returncode == 2, res.stderr
        assert needle in res.stderr.decode()


@pytest.mark.parametrize("old_group", [False, True])
async def test_producer_replays_are_skipped(kafka_bootstrap: str, unique_name: str, tmp_path: Path, old_group: bool) -> None:
    """The producer is at-least-once: a restart sends the unconfirmed transactions again."""
    source = f"walbus.{unique_name}"
    await create_topic(kafka_bootstrap, source)
    evs = [ev(0x100 * (i + 1), 0, "insert", "public.nums", ["id"], new={"id": i, "n": i}, types=INTS)
           for i in range(4)]
    await produce(kafka_bootstrap, source, evs[:3] + evs[1:3], partition=0)
    group = f"walbus-demux.{source}"
    proc = DemuxProc(demux_args(kafka_bootstrap, source, tmp_path / "state"), tmp_path / "demux.log").start()
    try:
        await wait_caught_up(kafka_bootstrap, group, source, procs=[proc])
    finally:
        assert proc.stop() == 0, proc.log_tail()
    tp = TopicPartition(source, 0)
    async with KafkaAdmin(client_kwargs=_kw(kafka_bootstrap)) as admin:
        committed = await admin.committed(group, tp)
    assert committed == (5, "walbus-demux/1:" + event_key(0x300, 0).decode())
    if old_group:
        # Committed by a demux that did not store the last position: the look-back before the
        # committed offset learns it.
        await commit_offset(kafka_bootstrap, group, tp, 5, "")
    await produce(kafka_bootstrap, source, evs[2:4], partition=0)
    proc = DemuxProc(demux_args(kafka_bootstrap, source, tmp_path / "state"), tmp_path / "demux2.log").start()
    try:
        await wait_caught_up(kafka_bootstrap, group, source, procs=[proc])
        metrics = proc.settled_metrics(2)
    finally:
        assert proc.stop() == 0, proc.log_tail()
    recs = await read_records(kafka_bootstrap, f"{source}.public.nums")
    assert [r.key for r in recs] == [b'{"id":%d}' % i for i in range(4)]
    assert metrics["walbus_demux_replayed_skipped_total"] == 1


async def test_a_resend_longer_than_the_look_back_across_a_restart(
    kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    # The producer's re-send can be long (all it sent after its last confirmed commit). A demux
    # stopped more than LOOK_BACK (1000) records into it learned the last position only from
    # the records before its committed offset: all re-sent, lower positions. The rest of the
    # re-send was output again (a fault-injection fuzz: 59,106 duplicates in a 90k re-send,
    # keys going back in time). Now the position is committed with the offset. Two source
    # partitions, one table each: each partition's transaction carries its own position.
    source = f"walbus.{unique_name}"
    await create_topic(kafka_bootstrap, source, partitions=2)
    n, cut = 1500, 1200
    evs = {p: [ev(0x1000 * (p + 1) + i // 100 * 0x10, i % 100, "insert", f"public.t{p}", ["id"],
                  new={"id": i, "n": i}, types=INTS) for i in range(n)] for p in (0, 1)}
    group = f"walbus-demux.{source}"
    args = demux_args(kafka_bootstrap, source, tmp_path / "state", "--txn-max-records", "500")

    async def run(label: str) -> dict[str, float]:
        proc = DemuxProc(args, tmp_path / f"demux-{label}.log").start()
        try:
            await wait_caught_up(kafka_bootstrap, group, source, procs=[proc])
            return proc.metrics()
        finally:
            assert proc.stop() == 0, proc.log_tail()

    for p in (0, 1):
        await produce(kafka_bootstrap, source, evs[p], partition=p)
    await run("originals")
    for p in (0, 1):  # the re-send's first part; the demux stops in it, offsets committed
        await produce(kafka_bootstrap, source, evs[p][:cut], partition=p)
    await run("resend-1")
    new = {p: ev(0x9000 * (p + 1), 0, "insert", f"public.t{p}", ["id"], new={"id": n, "n": n}, types=INTS) for p in (0, 1)}
    for p in (0, 1):  # the rest of the re-send, then a new transaction
        await produce(kafka_bootstrap, source, [*evs[p][cut:], new[p]], partition=p)
    metrics = await run("resend-2")
    for p in (0, 1):
        recs = await read_records(kafka_bootstrap, f"{source}.public.t{p}")
        assert [r.key for r in recs] == [b'{"id":%d}' % i for i in range(n + 1)], f"partition {p}: {len(recs)} outputs"
    assert sum(v for k, v in metrics.items() if k.startswith("walbus_demux_replayed_skipped_total")) == 2 * (n - cut)


@pytest.mark.parametrize("hashed", [False, True])
async def test_a_truncate_first_after_a_restart(kafka_bootstrap: str, unique_name: str, tmp_path: Path, hashed: bool) -> None:
    # A table of fixed-width columns has no store: a truncate reads its keys from its topic.
    # When that truncate was the first event a restarted demux saw for the table, its topic
    # was not yet known to the process, and the partition worker failed on it forever (an
    # assertion, the worker reopened and failed again: a crash loop). And a table whose topic
    # name collides with another's (`a_b.nums` and `a.b_nums`, the same for Kafka) has the
    # hashed name, which a restarted demux did not know yet: the truncate read the plain
    # name's nothing and tombstoned no row. Found by fuzzes.
    source = f"walbus.{unique_name}"
    await create_topic(kafka_bootstrap, source)
    table = "a.b_nums" if hashed else "public.nums"
    first = [ev(0x400, 0, "insert", "a_b.nums", ["id"], new={"id": 0, "n": 0}, types=INTS)] if hashed else []
    first += [ev(0x500, i, "insert", table, ["id"], new={"id": i, "n": i}, types=INTS) for i in range(3)]
    await produce(kafka_bootstrap, source, first, partition=0)
    args = demux_args(kafka_bootstrap, source, tmp_path / "state")
    group = f"walbus-demux.{source}"
    proc = DemuxProc(args, tmp_path / "demux.log").start()
    try:
        await wait_caught_up(kafka_bootstrap, group, source, procs=[proc])
    finally:
        assert proc.stop() == 0, proc.log_tail()
    after = [ev(0x600, 0, "truncate", table, ["id"]),
             ev(0x700, 0, "insert", table, ["id"], new={"id": 9, "n": 9}, types=INTS)]
    await produce(kafka_bootstrap, source, after, partition=0)
    proc = DemuxProc(args, tmp_path / "demux-2.log").start()
    try:
        await wait_caught_up(kafka_bootstrap, group, source, procs=[proc])
    finally:
        assert proc.stop() == 0, proc.log_tail()
    assert not [line for line in proc.log_lines() if "failed" in str(line.get("msg"))], proc.log_tail()
    topic = Rekeyer(prefix="walbus", database=unique_name).topic_for(table)
    if hashed:
        topic = Rekeyer(prefix="walbus", database=unique_name).use_hashed_topic(table)
    nums = await read_records(kafka_bootstrap, topic)
    assert [(r.key, r.value is None) for r in nums[3:]] == [
        (b'{"id":0}', True), (b'{"id":1}', True), (b'{"id":2}', True), (b'{"id":9}', False)]
    rows = await read_ktable(client_kwargs=_kw(kafka_bootstrap), topic=topic)
    assert list(rows) == [b'{"id":9}'] and rows[b'{"id":9}']["n"] == 9


async def test_a_demux_started_before_its_source_topic(kafka_bootstrap: str, unique_name: str, tmp_path: Path) -> None:
    # Subscribed to a missing topic, the consumer noticed it only at its next metadata
    # refresh (aiokafka: 5 minutes); now the demux asks for the topic every few seconds.
    source = f"walbus.{unique_name}"
    proc = DemuxProc(demux_args(kafka_bootstrap, source, tmp_path / "state"), tmp_path / "demux.log").start()
    try:
        await asyncio.sleep(4)  # it starts, finds no topic and waits
        await create_topic(kafka_bootstrap, source)
        await produce(kafka_bootstrap, source, [ev(0x100, 0, "insert", TX, ["id"], new={"id": 1, "n": 1}, types=INTS)], partition=0)
        await wait_caught_up(kafka_bootstrap, f"walbus-demux.{source}", source, within=60, procs=[proc])
    finally:
        assert proc.stop() == 0, proc.log_tail()
    assert [r.key for r in await read_records(kafka_bootstrap, f"{source}.{TX}")] == [b'{"id":1}']
