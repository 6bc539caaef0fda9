"""Shared benchmark plumbing: services, JSON-lines output, timing helpers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def dsn_in_env(args: list[str], env: dict[str, str]) -> list[str]:
    """``args`` without its ``--pg-dsn DSN``, which goes into ``env`` as WALBUS_PG_DSN instead:
    a DSN's password in a child's argv is visible to every user of the machine (ps)."""
    if "--pg-dsn" not in args:
        return args
    at = args.index("--pg-dsn")
    env["WALBUS_PG_DSN"] = args[at + 1]
    return args[:at] + args[at + 2 :]


def emit(**fields: Any) -> None:
    """One machine-readable result line on stdout."""
    print(orjson.dumps(fields).decode(), flush=True)


async def list_topics(bootstrap: str) -> set[str]:
    from walbus.kafka import KafkaAdmin

    async with KafkaAdmin(client_kwargs={"bootstrap_servers": bootstrap}) as admin:
        return await admin.list_topics()


async def delete_topics_matching(bootstrap: str, match: Callable[[str], bool]) -> int:
    """Delete the topics whose name ``match`` accepts; how many."""
    from walbus.kafka import KafkaAdmin

    async with KafkaAdmin(client_kwargs={"bootstrap_servers": bootstrap}) as admin:
        ours = sorted(t for t in await admin.list_topics() if match(t))
        await admin.delete_topics(ours)
        return len(ours)


@contextlib.contextmanager
def services() -> Iterator[tuple[str, str]]:
    """(maintenance DSN, bootstrap): from WALBUS_PG_DSN/WALBUS_KAFKA_BOOTSTRAP, else a local stack.

    On services given by the environment, the topics the benchmark created (all
    named ``bench…``) are deleted at the end: a benchmark writes gigabytes.
    """
    dsn, bootstrap = os.environ.get("WALBUS_PG_DSN"), os.environ.get("WALBUS_KAFKA_BOOTSTRAP")
    if dsn and bootstrap:
        before = asyncio.run(list_topics(bootstrap))
        try:
            yield dsn, bootstrap
        finally:
            asyncio.run(delete_topics_matching(bootstrap, lambda t: t.startswith("bench") and t not in before))
        return
    from walbus.app.dev import LocalStack

    state = Path(tempfile.mkdtemp(prefix="walbus-bench-"))
    stack = LocalStack.load(state)
    try:
        stack.up()
        yield stack.postgres.dsn, stack.kafka.bootstrap
    finally:
        stack.down()
        shutil.rmtree(state, ignore_errors=True)


@contextlib.contextmanager
def scratch_database(dsn: str, name: str) -> Iterator[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield make_conninfo(dsn, dbname=name)
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for (slot,) in conn.execute("SELECT slot_name FROM pg_replication_slots WHERE database = %s", (name,)).fetchall():
                with contextlib.suppress(psycopg.Error):
                    conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


async def fill_topic(bootstrap: str, topic: str, records: list[tuple[bytes, bytes]]) -> float:
    """Create ``topic`` and write ``records`` to partition 0 in large record batches; seconds taken."""
    from aiokafka import AIOKafkaProducer

    from walbus.kafka import KafkaAdmin, TopicSpec

    async with KafkaAdmin(client_kwargs={"bootstrap_servers": bootstrap}) as admin:
        await admin.ensure_topic(TopicSpec(topic))
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, max_batch_size=1_000_000)
    await producer.start()
    started = time.monotonic()
    try:
        futures = []
        batch = producer.create_batch()
        for k, v in records:
            if batch.append(key=k, value=v, timestamp=None) is None:
                futures.append(await producer.send_batch(batch, topic, partition=0))
                batch = producer.create_batch()
                batch.append(key=k, value=v, timestamp=None)
        futures.append(await producer.send_batch(batch, topic, partition=0))
        await asyncio.gather(*futures)
    finally:
        await producer.stop()
    return time.monotonic() - started


def current_lsn(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT (pg_current_wal_lsn() - '0/0')::int8").fetchone()
    assert row is not None
    return int(str(row[0]))


def _status_mb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def peak_rss_mb(pid: int) -> float:
    return _status_mb(pid, "VmHWM")


def rss_mb(pid: int) -> float:
    return _status_mb(pid, "VmRSS")


class Stopwatch:
    def __enter__(self) -> Stopwatch:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine since boot."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    total = sum(fields[:8])  # guest time is already in user
    return total - idle, total


async def settle(pg_dsn: str | None = None, *, busy_below: float = 0.1, window_s: float = 0.5,
                 timeout_s: float = 60.0) -> dict[str, float]:
    """Wait until the machine is quiet before a measured phase.

    A phase leaves work behind that runs on the same cores as the next one: dirty
    pages of the topic just written, PostgreSQL's checkpoint and autovacuum after a
    big load or a dropped database. Measured phases start only once that is done
    (a checkpoint, a sync, then CPU use of the whole machine below ``busy_below``
    over ``window_s``), so that neither side of a ratio pays for the other.
    """
    started = time.monotonic()
    if pg_dsn:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("CHECKPOINT")
    await asyncio.to_thread(os.sync)
    busy_share = 1.0
    while time.monotonic() - started < timeout_s:
        b0, t0 = _cpu_times()
        await asyncio.sleep(window_s)
        b1, t1 = _cpu_times()
        busy_share = (b1 - b0) / max(t1 - t0, 1)
        if busy_share < busy_below:
            break
    # Printed with the phase: a busy share above busy_below means it timed out (a busy host).
    return {"settle_s": round(time.monotonic() - started, 2), "settle_busy_share": round(busy_share, 3)}


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of a live process (0.0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_times() -> tuple[int, int]:
    """(all CPU time, stolen time) of this machine so far, in clock ticks (/proc/stat's
    first line): a virtual machine's host takes 'steal' from it, and a run during which it
    took much measures the host's load, not the code (the spread of a ratio across rounds)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return sum(fields), fields[7]


def steal_percent(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of the CPU time between two :func:`cpu_times` the host took."""
    total = after[0] - before[0]
    return round(100 * (after[1] - before[1]) / total, 1) if total > 0 else 0.0


def listener_pid(port: int) -> int | None:
    """The process listening on TCP ``port`` on this machine (the broker), if it can be seen."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    inodes.add(cols[9])
    if not inodes:
        return None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd).removeprefix("socket:[").removesuffix("]") in inodes:
                    return int(proc.name)
    return None
