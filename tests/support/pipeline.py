"""Fixtures and helpers to run walbus services in-process or as processes, and read topics."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg

from producer.config import ProducerConfig
from producer.service import Producer

ROOT = Path(__file__).resolve().parents[2]


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


async def confirmed_past(bootstrap: str, topic: str, lsn: int, timeout: float = 60.0) -> None:
    """Wait until a heartbeat of ``topic``'s producers confirms a position past ``lsn``: a
    warehouse load ends after the last commit one confirmed (the producer beats once a
    transaction is acknowledged and its stream is quiet)."""
    from tests.support.kafka import read_topic
    from walbus.contract import decode_heartbeat, heartbeat_topic

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        beats = await read_topic(bootstrap, heartbeat_topic(topic))
        if any(decode_heartbeat(v).confirmed_lsn > lsn for _, v in beats if v is not None):
            return
        assert loop.time() < deadline, f"no heartbeat of {topic} past {lsn:X} within {timeout} s"
        await asyncio.sleep(0.2)


def walbus_process(args: Sequence[str], *, env: dict[str, str] | None = None, log: Path | None = None) -> subprocess.Popen[bytes]:
    """``walbus …`` as a child process (same interpreter, this checkout on the path). A
    ``--pg-dsn`` goes to the child as WALBUS_PG_DSN: a DSN's password in argv is visible to
    every user of the machine (ps)."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    for key in ("WALBUS_PG_DSN", "WALBUS_KAFKA_BOOTSTRAP"):
        if env is None or key not in env:
            full_env.pop(key, None)  # the test's own flags decide
    argv = list(args)
    if "--pg-dsn" in argv:
        at = argv.index("--pg-dsn")
        full_env["WALBUS_PG_DSN"] = argv[at + 1]
        del argv[at : at + 2]
    out = log.open("ab") if log else subprocess.DEVNULL
    try:
        return subprocess.Popen([sys.executable, "-m", "walbus.app.cli", *argv], env=full_env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    finally:
        if log:
            out.close()  # type: ignore[union-attr]


@contextlib.contextmanager
def running_demux(bootstrap: str, source: str, workdir: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A ``walbus demux`` of ``source`` for the body; its log's tail is printed when the body
    fails, and it gets SIGTERM (then, if it hangs, SIGKILL) whatever happens."""
    log = workdir / "demux.log"
    demux = walbus_process(
        ["demux", "--kafka-bootstrap", bootstrap, "--source-topic", source, "--state-dir", str(workdir / "state")], log=log,
    )
    try:
        yield demux
    except BaseException:
        print(log.read_text(errors="replace")[-5000:])
        raise
    finally:
        stop_process(demux)


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, and SIGKILL if it has not ended within a minute."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        kill9(proc)


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
