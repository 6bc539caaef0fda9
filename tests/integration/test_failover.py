"""Broker failover on a 3-node cluster under a sustained write load (issue 14, part 3).

The whole pipeline runs as it would in production: a ``walbus produce`` process on a
2-partition database topic, two ``walbus demux`` processes (static members, one partition
each), a writer thread committing small transactions into PostgreSQL the whole time. The
faults hit Kafka only: (a) kill -9 of the database topic's partition leader, restarted
later; (b) a rolling restart of the three brokers, each waited back in sync before the
next. Afterwards, with no service restarted by hand:

- every change the writer committed is on the database topic (duplicates allowed there:
  the producer is at-least-once, each event keeps its own (commit_lsn, seq) key);
- the per-table topics read with read_committed hold every event once (no two records with
  the same ``__commit_lsn``/``__seq``) and equal ``SELECT *``;
- the producer and both demuxes are the processes started at the beginning, caught up.
"""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest

from tests.support.cluster import Cluster
from tests.support.demux import (
    DemuxProc,
    _reap_demux_processes,  # noqa: F401
    demux_args,
    wait_for_log,
)
from tests.support.kafka import read_ktable, read_records, read_topic, wait_caught_up
from tests.support.pipeline import walbus_process
from walbus.contract import decode_event, parse_event_key

pytestmark = pytest.mark.integration

TABLES = ("items", "notes")
# Database topic partitions, one demux each.
PARTITIONS = 2
# Seconds of writes between two steps of a scenario (a few hundred transactions in all).
PHASE = 4.0

# One committed change as the writer knows it: (table, operation, id, value; None on delete).
Change = tuple[str, str, int, str | None]


class Writer(threading.Thread):
    """Commits small transactions (inserts, updates, deletes on two tables) until stopped.

    ``committed`` holds the changes of the transactions whose COMMIT returned; each update
    writes a value of its own, so that every change is told apart from the others.
    """

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True, name="failover-writer")
        self.dsn = dsn
        self.committed: list[Change] = []
        self.transactions = 0
        self.error: BaseException | None = None
        self._stopping = threading.Event()

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=False) as conn:
                while not self._stopping.is_set():
                    self.committed += self._transaction(conn, self.transactions)
                    self.transactions += 1
                    time.sleep(0.01)
        except BaseException as e:  # reported by finish(): the test fails with it
            self.error = e

    def _transaction(self, conn: psycopg.Connection[Any], n: int) -> list[Change]:
        changes: list[Change] = [("items", "insert", 2 * n, f"i{2 * n}"), ("items", "insert", 2 * n + 1, f"i{2 * n + 1}"),
                                 ("notes", "insert", n, f"n{n}")]
        if n >= 5:
            changes.append(("items", "update", 2 * (n - 5), f"u{n}"))
        if n >= 10 and n % 3 == 0:
            changes.append(("items", "delete", 2 * (n - 10) + 1, None))
        if n >= 7 and n % 4 == 0:
            changes.append(("notes", "update", n - 7, f"u{n}"))
        for table, op, id_, value in changes:
            if op == "insert":
                conn.execute(f"INSERT INTO {table} VALUES (%s, %s)", (id_, value))
            elif op == "update":
                conn.execute(f"UPDATE {table} SET v = %s WHERE id = %s", (value, id_))
            else:
                conn.execute(f"DELETE FROM {table} WHERE id = %s", (id_,))
        conn.commit()
        return changes

    def finish(self) -> list[Change]:
        self._stopping.set()
        self.join(60)
        assert not self.is_alive(), "the writer did not stop"
        if self.error is not None:
            raise AssertionError(f"the writer failed: {self.error!r}") from self.error
        return self.committed


@dataclass
class Pipeline:
    """The producer and demux processes of one scenario, on the cluster."""

    pg_dsn: str
    cluster: Cluster
    source: str
    tmp_path: Path
    producer: subprocess.Popen[bytes] | None = None
    demuxes: list[DemuxProc] = field(default_factory=list)

    @property
    def group(self) -> str:
        return f"walbus-demux.{self.source}"

    @property
    def producer_log(self) -> Path:
        return self.tmp_path / "producer.log"

    def producer_args(self) -> list[str]:
        return ["produce", "--pg-dsn", self.pg_dsn, "--kafka-bootstrap", self.cluster.bootstrap, "--topic", self.source,
                "--partitions", str(PARTITIONS), "--heartbeat-interval", "0.5", "--retry-max-delay", "2"]

    def services_alive(self) -> None:
        """The processes started at the beginning still run (none needed a restart)."""
        assert self.producer is not None
        assert self.producer.poll() is None, f"the producer exited with {self.producer.returncode}:\n{self.producer_log_tail()}"
        for d in self.demuxes:
            d.check_alive()

    def producer_log_tail(self, n: int = 40) -> str:
        return "\n".join(self.producer_log.read_text(errors="replace").splitlines()[-n:])


@asynccontextmanager
async def pipeline(pg_dsn: str, cluster: Cluster, source: str, tmp_path: Path) -> AsyncIterator[tuple[Pipeline, Writer]]:
    """Tables, producer, two demuxes and the writer, all running; stopped gracefully at the end."""
    await cluster.wait_in_sync()  # a scenario starts on a healthy cluster
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for table in TABLES:
            conn.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text NOT NULL)")
    p = Pipeline(pg_dsn, cluster, source, tmp_path)
    p.producer = walbus_process(p.producer_args(), log=p.producer_log)
    writer = Writer(pg_dsn)
    try:
        await wait_for_producer(p)
        for n in (1, 2):
            args = demux_args(cluster.bootstrap, source, tmp_path / f"state-{n}", "--group-instance-id", f"demux-{n}")
            p.demuxes.append(DemuxProc(args, tmp_path / f"demux-{n}.log").start())
        writer.start()
        for d in p.demuxes:
            await wait_for_log(d, "partition opened", within=120)
        yield p, writer
    finally:
        with suppress(AssertionError):
            writer.finish()
        p.producer.terminate()
        p.producer.wait(60)
        for d in p.demuxes:
            if d.proc is not None and d.proc.poll() is None:
                d.stop()


async def wait_for_producer(p: Pipeline, within: float = 120) -> None:
    """Until the producer streams (its slot is active): rows written before are not part of the stream."""
    deadline = time.monotonic() + within
    while True:
        p.services_alive()
        with psycopg.connect(p.pg_dsn, autocommit=True) as conn:
            if conn.execute("SELECT 1 FROM pg_replication_slots WHERE active AND database = current_database()").fetchone():
                return
        assert time.monotonic() < deadline, f"the producer did not start streaming:\n{p.producer_log_tail()}"
        await asyncio.sleep(0.3)


def topic_changes(records: list[tuple[bytes | None, bytes | None]]) -> tuple[set[Change], Counter[bytes]]:
    """The changes on the database topic, and how often each event key occurs."""
    changes: set[Change] = set()
    keys: Counter[bytes] = Counter()
    for key, value in records:
        assert key is not None and value is not None
        event = decode_event(value)
        keys[key] += 1
        ids = event.key_values()
        assert ids is not None, event
        row = event.row()
        changes.add((event.table_name, event.operation, int(ids["id"]), None if row is None else str(row["v"])))
    return changes, keys


async def wait_database_topic(p: Pipeline, committed: list[Change], within: float = 180) -> Counter[bytes]:
    """Until every committed change is on the database topic; the event keys' counts."""
    want = set(committed)
    deadline = time.monotonic() + within
    while True:
        p.services_alive()
        changes, keys = topic_changes(await read_topic(p.cluster.bootstrap, p.source))
        missing = want - changes
        if not missing:
            assert changes == want, f"changes nobody committed: {sorted(changes - want)[:5]}"
            return keys
        assert time.monotonic() < deadline, (
            f"{len(missing)} of {len(want)} committed changes missing from {p.source}, e.g. {sorted(missing)[:5]}\n"
            f"{p.producer_log_tail()}"
        )
        await asyncio.sleep(1.0)


def select_all(dsn: str, table: str) -> dict[int, str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {int(r[0]): str(r[1]) for r in conn.execute(f"SELECT id, v FROM {table}").fetchall()}


async def check_table_topic(p: Pipeline, table: str) -> int:
    """The per-table topic (read_committed) holds each event once and equals SELECT *; its event count."""
    topic = f"{p.source}.public.{table}"
    positions: Counter[tuple[int, int]] = Counter()
    for record in await read_records(p.cluster.bootstrap, topic):
        if record.value is not None:  # tombstones carry no event metadata
            row = orjson.loads(record.value)
            positions[(int(row["__commit_lsn"]), int(row["__seq"]))] += 1
    duplicated = {pos: n for pos, n in positions.items() if n > 1}
    assert not duplicated, f"{topic}: {len(duplicated)} events written more than once, e.g. {list(duplicated.items())[:5]}"
    got = await read_ktable(client_kwargs={"bootstrap_servers": p.cluster.bootstrap}, topic=topic)
    rows = {int(row["id"]): str(row["v"]) for row in got.values()}
    expected = select_all(p.pg_dsn, table)
    assert rows == expected, (
        f"{topic} != SELECT * FROM {table}: {len(rows)} vs {len(expected)} rows; "
        f"missing {sorted(set(expected) - set(rows))[:5]}, extra {sorted(set(rows) - set(expected))[:5]}, "
        f"different {[k for k in set(rows) & set(expected) if rows[k] != expected[k]][:5]}"
    )
    return sum(positions.values())


async def finish_and_check(p: Pipeline, writer: Writer) -> None:
    committed = writer.finish()
    assert writer.transactions >= 50, f"only {writer.transactions} transactions: the load was not sustained"
    keys = await wait_database_topic(p, committed)
    # Events keep their key: as many distinct keys as committed changes, whatever was re-sent.
    assert len(keys) == len(committed)
    assert all(parse_event_key(k) for k in keys)
    await wait_caught_up(p.cluster.bootstrap, p.group, p.source, procs=p.demuxes, within=180)
    p.services_alive()
    events = 0
    for table in TABLES:
        events += await check_table_topic(p, table)
    # Every insert and update reached a per-table topic (deletes are tombstones).
    assert events == sum(1 for c in committed if c[1] != "delete")


async def test_kill9_of_the_partition_leader_under_write_load(
    pg_dsn: str, kafka_cluster: Cluster, unique_name: str, tmp_path: Path
) -> None:
    cluster = kafka_cluster
    async with pipeline(pg_dsn, cluster, f"walbus.{unique_name}", tmp_path) as (p, writer):
        await asyncio.sleep(PHASE)
        leader = await cluster.leader(p.source, 0)
        await cluster.akill9(leader)
        # Writes go on while the crashed broker's partitions move to the other two.
        await cluster.wait_leader_not(p.source, 0, leader)
        await asyncio.sleep(PHASE)
        p.services_alive()
        await cluster.astart(leader)
        await cluster.wait_in_sync()
        await asyncio.sleep(PHASE)
        await finish_and_check(p, writer)


async def test_rolling_restart_of_all_brokers_under_write_load(
    pg_dsn: str, kafka_cluster: Cluster, unique_name: str, tmp_path: Path
) -> None:
    cluster = kafka_cluster
    async with pipeline(pg_dsn, cluster, f"walbus.{unique_name}", tmp_path) as (p, writer):
        for node in (1, 2, 3):
            await asyncio.sleep(PHASE / 2)
            await cluster.astop(node)
            await asyncio.sleep(PHASE / 2)
            p.services_alive()
            await cluster.astart(node)
            await cluster.wait_in_sync()
        await asyncio.sleep(PHASE / 2)
        await finish_and_check(p, writer)


async def test_warehouse_reads_topic_bounds_while_a_partition_leader_is_dead(
    kafka_cluster: Cluster, unique_name: str
) -> None:
    """A warehouse load fixes its slice from the topic's offsets: a dead partition leader is a
    transient fault it waits out (the soak's load died with NodeNotReadyError instead)."""
    from aiokafka import AIOKafkaProducer

    from walbus.kafka import KafkaAdmin, KafkaOptions, TopicSpec
    from warehouse.read import topic_bounds

    cluster = kafka_cluster
    topic = f"walbus.{unique_name}"
    kw = {"bootstrap_servers": cluster.bootstrap}
    async with KafkaAdmin(client_kwargs=kw) as admin:
        await admin.ensure_topic(TopicSpec(topic, partitions=PARTITIONS))
    producer = AIOKafkaProducer(**kw, acks="all")
    await producer.start()
    try:
        for i in range(10):
            await producer.send_and_wait(topic, b"v", key=b"k%d" % i, partition=i % PARTITIONS)
    finally:
        await producer.stop()
    leader = await cluster.leader(topic, 0)
    await cluster.akill9(leader)
    try:
        bounds = await asyncio.to_thread(topic_bounds, KafkaOptions(kafka_bootstrap=cluster.bootstrap), topic)
        assert bounds.latest == {0: 5, 1: 5}
        assert bounds.earliest == {0: 0, 1: 0}
    finally:
        await cluster.astart(leader)
        await cluster.wait_in_sync()
