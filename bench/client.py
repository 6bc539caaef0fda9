"""Feed throughput against a raw aiokafka consumer, in the same run; prints JSON lines.

    python -m bench.client [--events 200000] [--rounds 3] [--profile]

Fills a topic with N synthetic contract-v1 events (pgkafka's ``transactions`` table, 1-5
events a transaction), then per round reads all of it with:

* ``raw``: an ``AIOKafkaConsumer`` (no group) with ``orjson.loads`` of each value: the floor;
* ``feed``: ``Feed`` with a group, ``async for`` and auto-ack (validation, dedup, commits);
* ``feed_run8``: ``Feed.run(handler, concurrency=8)`` with a group (per-key lanes).

Each line: events/s from the first event to the last (the group join, ~3 s of the broker's
group.initial.rebalance.delay.ms for a new group, is not throughput) and the bench process's CPU
µs per event; the summary gives medians, and each Feed mode's ratio to ``raw`` as the median of
the rounds' own ratios (each paired with the raw read of its round; target: at least 0.7). ``--profile`` prints the top of cProfile for the ``feed`` mode.
Services: WALBUS_KAFKA_BOOTSTRAP, else the local stack (bench.common.services).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import random
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable

import orjson
from aiokafka import AIOKafkaConsumer, TopicPartition

from bench.common import emit, fill_topic, services
from walbus.client import Feed, FeedEvent
from walbus.contract import encode_event, event_key

TS = "2024-05-01T12:00:00.000001+00:00"
COLS = ["transaction_id", "user_id", "amount"]
TYPES = ["int4", "int4", "int4"]


def synthetic(n: int, seed: int = 1) -> list[tuple[bytes, bytes]]:
    rng = random.Random(seed)
    out: list[tuple[bytes, bytes]] = []
    lsn = 0x1000_0000
    while len(out) < n:
        lsn += rng.randint(100, 5000)
        for seq in range(rng.randint(1, 5)):
            tid = rng.randint(1, 100_000)
            value = encode_event(
                lsn=lsn + seq, commit_lsn=lsn + 100, seq=seq, xid=1000 + len(out), operation="insert",
                table="public.transactions", timestamp=TS, pk=["transaction_id"],
                new={"columns": COLS, "types": TYPES, "values": [tid, rng.randint(1, 99_999), rng.randint(1, 10_000)]},
                identity=None,
            )
            out.append((event_key(lsn + 100, seq), value))
    return out[:n]


class Clock:
    """When the first event arrived: the rate is taken from there."""

    first: float | None = None

    def tick(self) -> None:
        if self.first is None:
            self.first = time.perf_counter()


async def read_raw(bootstrap: str, topic: str, n: int, clock: Clock) -> int:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest",
                                isolation_level="read_committed")
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        seen = 0
        while seen < n:
            batches = await consumer.getmany(timeout_ms=1000)
            for msgs in batches.values():
                clock.tick()
                for m in msgs:
                    orjson.loads(m.value)
                seen += len(msgs)
        return seen
    finally:
        await consumer.stop()


async def read_feed(bootstrap: str, topic: str, n: int, clock: Clock) -> int:
    seen = 0
    async with Feed(topic, group_id=f"bench-{uuid.uuid4().hex[:8]}", start="earliest", bootstrap_servers=bootstrap) as feed:
        async for _event in feed:
            clock.tick()
            seen += 1
            if seen >= n:
                break
    return seen


async def read_feed_run(bootstrap: str, topic: str, n: int, clock: Clock, concurrency: int = 8) -> int:
    seen = 0
    done = asyncio.Event()

    async def handler(_event: FeedEvent) -> None:
        nonlocal seen
        clock.tick()
        seen += 1
        if seen >= n:
            done.set()

    async with Feed(topic, group_id=f"bench-{uuid.uuid4().hex[:8]}", start="earliest", bootstrap_servers=bootstrap) as feed:
        runner = asyncio.create_task(feed.run(handler, concurrency=concurrency))
        waiter = asyncio.create_task(done.wait())
        await asyncio.wait([runner, waiter], return_when=asyncio.FIRST_COMPLETED)
        runner.cancel()
        waiter.cancel()
        await asyncio.gather(runner, waiter, return_exceptions=True)
    return seen


MODES: dict[str, Callable[[str, str, int, Clock], Awaitable[int]]] = {"raw": read_raw, "feed": read_feed, "feed_run8": read_feed_run}


async def timed(mode: str, bootstrap: str, topic: str, n: int) -> tuple[float, float]:
    """Events/s from the first event to the last, and this process's CPU µs an event (the
    consumer's own cost, whatever else the machine runs)."""
    clock = Clock()
    cpu = time.process_time()
    got = await MODES[mode](bootstrap, topic, n, clock)
    end = time.perf_counter()
    cpu = time.process_time() - cpu
    assert got >= n and clock.first is not None, f"{mode}: {got} of {n} events"
    return n / (end - clock.first), cpu / n * 1e6


async def main_async(args: argparse.Namespace, bootstrap: str) -> None:
    topic = f"bench-client-{uuid.uuid4().hex[:8]}"
    seconds = await fill_topic(bootstrap, topic, synthetic(args.events))
    emit(bench="client", step="fill", events=args.events, seconds=round(seconds, 2))
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    cpus: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES:
            rate, cpu_us = await timed(mode, bootstrap, topic, args.events)
            rates[mode].append(rate)
            cpus[mode].append(cpu_us)
            emit(bench="client", round=r + 1, mode=mode, events=args.events, events_per_s=round(rate), cpu_us_per_event=round(cpu_us, 2))
    medians = {m: statistics.median(v) for m, v in rates.items()}

    def paired(mode: str) -> float:
        # Each round's ratio to the raw consumer read just before it: a machine whose speed
        # drifts (a shared host) moves both alike; the median of those is the figure.
        return round(statistics.median(f / r for f, r in zip(rates[mode], rates["raw"], strict=True)), 3)

    emit(
        bench="client", step="summary", events=args.events, rounds=args.rounds,
        **{f"{m}_events_per_s": round(v) for m, v in medians.items()},
        **{f"{m}_cpu_us_per_event": round(statistics.median(v), 2) for m, v in cpus.items()},
        feed_vs_raw=paired("feed"),
        feed_run8_vs_raw=paired("feed_run8"),
        target=0.7,
    )
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        await read_feed(bootstrap, topic, args.events, Clock())
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(25)
        print(out.getvalue())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    with services() as (_dsn, bootstrap):
        asyncio.run(main_async(args, bootstrap))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
