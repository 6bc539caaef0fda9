"""Fixtures and helpers to run walbus services in-process or as processes, and read topics."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import orjson
import psycopg
from aiokafka import AIOKafkaConsumer, TopicPartition

from demux.ktable import read_ktable_raw
from producer.config import ProducerConfig
from producer.service import Producer
from walbus import kafka

ROOT = Path(__file__).resolve().parent.parent


@contextlib.asynccontextmanager
async def running_producer(pg_dsn: str, kafka_bootstrap: str, **options: Any) -> AsyncIterator[Producer]:
    """A producer streaming in this event loop until the block ends (graceful stop)."""
    options.setdefault("heartbeat_interval", 1.0)
    cfg = ProducerConfig(pg_dsn=pg_dsn, kafka_bootstrap=kafka_bootstrap, **options)
    producer = Producer(cfg)
    task = asyncio.create_task(producer.run())
    ready = asyncio.create_task(producer.ready.wait())
    done, _ = await asyncio.wait({task, ready}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        ready.cancel()
        task.result()  # raises the start-up error
    assert ready in done, "producer did not start streaming within 60 s"
    try:
        yield producer
    finally:
        producer.stop()
        await asyncio.wait_for(task, 90)


async def topic_partitions(bootstrap: str, topic: str) -> int:
    """Partition count of ``topic`` (0 while it does not exist)."""
    try:
        return len(await kafka.topic_partitions({"bootstrap_servers": bootstrap}, topic, wait=False))
    except LookupError:
        return 0


async def read_ktable(*, client_kwargs: dict[str, Any], topic: str, timeout_s: float = 120.0) -> dict[bytes, dict[str, Any]]:
    """``{key: row}`` of a compacted per-table topic as of its end (committed records only)."""
    raw = await read_ktable_raw(client_kwargs=client_kwargs, topic=topic, timeout_s=timeout_s)
    return {k: orjson.loads(v) for k, v in raw.items()}


async def read_topic(
    bootstrap: str, topic: str, *, min_count: int = 0, timeout: float = 60.0, isolation_level: str = "read_uncommitted"
) -> list[tuple[bytes | None, bytes | None]]:
    """Every record of ``topic`` (all partitions, in partition then offset order), waiting until
    at least ``min_count`` exist."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest",
        isolation_level=isolation_level, max_partition_fetch_bytes=8 << 20, fetch_max_bytes=64 << 20,
    )
    await consumer.start()
    try:
        deadline = time.monotonic() + timeout
        while True:
            tps = [TopicPartition(topic, p) for p in range(await topic_partitions(bootstrap, topic))]
            records: list[tuple[bytes | None, bytes | None]] = []
            if tps:
                consumer.assign(tps)
                await consumer.seek_to_beginning(*tps)
                ends = await consumer.end_offsets(tps)
                for tp in tps:
                    while await consumer.position(tp) < ends[tp]:
                        batch = await consumer.getmany(tp, timeout_ms=1000, max_records=100000)
                        records += [(m.key, m.value) for m in batch.get(tp, [])]
            if len(records) >= min_count:
                return records
            if time.monotonic() > deadline:
                raise AssertionError(f"{topic}: {len(records)} records after {timeout} s, expected at least {min_count}")
            await asyncio.sleep(0.5)
    finally:
        await consumer.stop()


def walbus_process(args: Sequence[str], *, env: dict[str, str] | None = None, log: Path | None = None) -> subprocess.Popen[bytes]:
    """``walbus …`` as a child process (same interpreter, this checkout on the path)."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    for key in ("WALBUS_PG_DSN", "WALBUS_KAFKA_BOOTSTRAP"):
        if env is None or key not in env:
            full_env.pop(key, None)  # the test's own flags decide
    out = log.open("ab") if log else subprocess.DEVNULL
    try:
        return subprocess.Popen([sys.executable, "-m", "walbus.app.cli", *args], env=full_env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    finally:
        if log:
            out.close()  # type: ignore[union-attr]


def kill9(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGKILL)
    proc.wait(30)


def slot_confirmed_lsn(dsn: str, slot: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT (confirmed_flush_lsn - '0/0')::int8 FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
    return int(str(row[0])) if row and row[0] is not None else 0
