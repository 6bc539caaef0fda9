"""A Feed consumer process killed with SIGKILL and restarted: every event handled exactly once."""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys

import psycopg
import pytest

from tests.support.cdc_data import workload
from tests.support.feed_worker import TABLES
from tests.support.kafka import create_topic, produce
from tests.support.pipeline import ROOT

pytestmark = pytest.mark.integration


def _start_worker(topic: str, group: str, dsn: str, bootstrap: str, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.feed_worker", topic, group, dsn, bootstrap, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def _handled(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        try:
            row = conn.execute("SELECT count(*) FROM handled").fetchone()
        except psycopg.errors.UndefinedTable:
            return 0
        return int(row[0]) if row else 0


async def test_kill_9_and_restart_with_duplicates_in_topic(kafka_bootstrap: str, pg_dsn: str, unique_name: str) -> None:
    rng = random.Random(7)
    changes = workload(rng, 600, [*TABLES, "public.other"])
    batches = [changes[: len(changes) // 3], changes[len(changes) // 3 : 2 * len(changes) // 3], changes[2 * len(changes) // 3 :]]
    group = unique_name + "-g"
    await create_topic(kafka_bootstrap, unique_name)
    await produce(kafka_bootstrap, unique_name, [c.record() for c in batches[0]])
    written = list(batches[0])
    for batch in batches[1:]:
        worker = _start_worker(unique_name, group, pg_dsn, kafka_bootstrap)
        # Kill it mid-stream, once it has handled something.
        for _ in range(1200):  # up to 60 s
            if _handled(pg_dsn) >= len(written) // 4 or worker.poll() is not None:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(rng.uniform(0.0, 0.5))
        at_kill = _handled(pg_dsn)
        worker.send_signal(signal.SIGKILL)
        _out, err = worker.communicate(timeout=10)  # also closes the pipes
        assert worker.returncode == -signal.SIGKILL, err[-3000:]
        assert at_kill < sum(1 for c in written if c.table in TABLES), "the worker finished before the kill"
        # The producer's at-least-once: a re-sent stretch of old events, then new ones.
        start = rng.randrange(0, len(written) - 20)
        resent = [c.record() for c in written[start : start + rng.randint(5, 60)]]
        await produce(kafka_bootstrap, unique_name, resent + [c.record() for c in batch])
        written += batch
    await produce(kafka_bootstrap, unique_name, [c.record() for c in written[-10:]])

    final = _start_worker(unique_name, group, pg_dsn, kafka_bootstrap, "--until-end")
    out, err = await asyncio.to_thread(final.communicate, timeout=120)
    assert final.returncode == 0, err[-3000:]
    assert "done" in out

    expected = [(c.commit_lsn, c.seq, c.table, c.operation) for c in changes if c.table in TABLES]
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute("SELECT commit_lsn, seq, tbl, op FROM handled ORDER BY id").fetchall()
        pids = conn.execute("SELECT count(DISTINCT pid) FROM handled").fetchone()
    assert rows == expected  # each exactly once, in commit order
    assert pids is not None and pids[0] >= 2  # really handled by several processes
