"""Demux recovery after kill -9: dynamic vs static group membership; prints JSON lines.

    python -m bench.demux_restart [--rounds 7] [--chunk 2000] [--session-timeout-ms 10000]

For each membership (``dynamic``: no ``--group-instance-id``; ``static``: one), on a fresh
1-partition database topic of synthetic events:

1. a `walbus demux` process catches up with a prefilled topic;
2. each round appends ``--chunk`` events, kills the demux with SIGKILL a moment later
   (mid-stream, transactions open), starts it again at once and appends ``--probe``
   more events: work only a process that owns the partition again can commit;
3. the round's recovery time is from the kill to the group's committed offset reaching
   the topic's end (the restarted process owns the partition again and has caught up).

One line per round, then a summary per membership: recovery p50 and max. With dynamic
membership the restarted process waits for the dead member's session timeout; with static
membership it takes its partition over at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from aiokafka import AIOKafkaConsumer, TopicPartition

from bench.common import ROOT, emit, fill_topic, services
from bench.demux import events


def _start_demux(bootstrap: str, topic: str, group: str, state: Path, log: Path, instance: str | None,
                 session_timeout_ms: int) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "walbus.app.cli", "demux", "--kafka-bootstrap", bootstrap, "--source-topic", topic,
            "--topic-prefix", f"bench-{group}", "--database", "bench", "--group-id", group, "--state-dir", str(state),
            "--session-timeout-ms", str(session_timeout_ms)]
    if instance:
        args += ["--group-instance-id", instance]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("ab") as out:
        return subprocess.Popen(args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


async def _wait_committed(consumer: AIOKafkaConsumer, tp: TopicPartition, end: int, proc: subprocess.Popen[bytes],
                          log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while (await consumer.committed(tp) or 0) < end:
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = await asyncio.to_thread(lambda: "\n".join(log.read_text(errors="replace").splitlines()[-20:]))
            raise SystemExit(f"demux did not catch up (exit {proc.poll()}):\n{tail}")
        await asyncio.sleep(0.05)


async def measure(bootstrap: str, membership: str, rounds: int, chunk: int, probe: int, session_timeout_ms: int) -> list[float]:
    run = uuid.uuid4().hex[:8]
    topic, group = f"bench.restart.{membership}.{run}", f"bench-restart-{run}"
    instance = "demux-1" if membership == "static" else None
    evs = events(chunk + (chunk + probe) * rounds, seed=7)
    await fill_topic(bootstrap, topic, evs[:chunk])
    end = chunk
    tmp = Path(tempfile.mkdtemp(prefix="walbus-bench-restart-"))
    log = tmp / "demux.log"
    tp = TopicPartition(topic, 0)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await consumer.start()
    proc = _start_demux(bootstrap, topic, group, tmp / "state", log, instance, session_timeout_ms)
    times: list[float] = []
    try:
        await _wait_committed(consumer, tp, end, proc, log)
        for n in range(1, rounds + 1):
            await fill_topic(bootstrap, topic, evs[end:end + chunk])
            end += chunk
            await asyncio.sleep(0.3)  # the demux is mid-stream, a transaction open
            proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            proc.wait(30)
            proc = _start_demux(bootstrap, topic, group, tmp / "state", log, instance, session_timeout_ms)
            await fill_topic(bootstrap, topic, evs[end:end + probe])
            end += probe
            await _wait_committed(consumer, tp, end, proc, log)
            took = time.monotonic() - killed
            times.append(took)
            emit(membership=membership, round=n, recovery_s=round(took, 2))
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        await consumer.stop()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--chunk", type=int, default=2000, help="events appended before each kill")
    parser.add_argument("--probe", type=int, default=100, help="events appended right after each restart")
    parser.add_argument("--session-timeout-ms", type=int, default=10000, help="the demux's (its default: 10000)")
    parser.add_argument("--membership", choices=["dynamic", "static", "both"], default="both")
    args = parser.parse_args()
    kinds = ["dynamic", "static"] if args.membership == "both" else [args.membership]
    with services() as (_dsn, bootstrap):
        for kind in kinds:
            times = asyncio.run(measure(bootstrap, kind, args.rounds, args.chunk, args.probe, args.session_timeout_ms))
            emit(summary=kind, rounds=len(times), recovery_p50_s=round(statistics.median(times), 2),
                 recovery_max_s=round(max(times), 2), session_timeout_ms=args.session_timeout_ms)


if __name__ == "__main__":
    main()
