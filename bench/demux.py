"""Demux throughput: re-key a pre-filled database topic; prints JSON lines.

    python bench/demux.py --kafka-bootstrap 127.0.0.1:9092 [--pg-dsn postgresql://…] [--events 1000000]

1. fills a fresh database topic with N events of pgkafka's ``transactions`` table:
   with ``--pg-dsn``, by the real producer (W1: N rows inserted in 100
   transactions before it starts, a backlog in its slot; the producer's rate is
   printed), otherwise synthetic contract-v1 events (80% inserts, 15% updates,
   5% deletes, 500-event transactions) written with record batches;
2. runs the demux in-process until the group's committed offset reaches the end
   of the topic: records/s re-keyed, exactly once, into the compacted topic, and
   the CPU seconds it used (cpu_share near 1: CPU-bound);
3. repeats 1-2 ``--rounds`` times, alternating, and prints a summary: medians and
   the demux/producer ratio of each round (the target: at least 1);
4. runs the demux under cProfile on a smaller topic and prints where the time goes.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import random
import resource
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import delete_topics_matching, fill_topic, rss_mb, settle
from demux.config import DemuxConfig
from demux.service import Demux
from walbus.allocator import tune_collector
from walbus.contract import encode_event, event_key
from walbus.metrics import new_registry

TS = "2024-05-01T12:00:00.000001+00:00"
COLS = ["transaction_id", "user_id", "amount"]
TYPES = ["int4", "int4", "int4"]


def emit(obj: dict[str, Any]) -> None:
    print(orjson.dumps(obj).decode(), flush=True)


def events(n: int, seed: int = 1) -> list[tuple[bytes, bytes]]:
    rnd = random.Random(seed)
    out: list[tuple[bytes, bytes]] = []
    live: list[int] = []
    next_id = 1
    commit = 0x1_0000_0000
    for i in range(n):
        if i % 500 == 0:
            commit += 0x10000
        seq = i % 500
        r = rnd.random()
        common: dict[str, Any] = {"lsn": commit - 0x8000 + seq, "commit_lsn": commit, "seq": seq, "xid": 1000 + i // 500,
                                  "table": "public.transactions", "timestamp": TS, "pk": ["transaction_id"]}
        if r < 0.8 or len(live) < 10:
            tid = next_id
            next_id += 1
            live.append(tid)
            v = encode_event(operation="insert", new={"columns": COLS, "types": TYPES,
                                                      "values": [tid, rnd.randint(1, 50000), rnd.randint(1, 10**6)]},
                             identity=None, **common)
        elif r < 0.95:
            tid = live[rnd.randrange(len(live))]
            v = encode_event(operation="update", new={"columns": COLS, "types": TYPES,
                                                      "values": [tid, rnd.randint(1, 50000), rnd.randint(1, 10**6)]},
                             identity=None, **common)
        else:
            tid = live.pop(rnd.randrange(len(live)))
            v = encode_event(operation="delete", new=None,
                             identity={"columns": ["transaction_id"], "types": ["int4"], "values": [tid]}, **common)
        out.append((event_key(commit, seq), v))
    return out


async def prefill(bootstrap: str, topic: str, evs: list[tuple[bytes, bytes]]) -> float:
    return await fill_topic(bootstrap, topic, evs)


# A run without a commit for this long is stuck: say where every task waits, rather than hang.
STALL_S = 180


def _dump_tasks() -> None:
    for t in asyncio.all_tasks():
        out = io.StringIO()
        t.print_stack(file=out)
        print(out.getvalue(), file=sys.stderr, flush=True)


async def run_demux(bootstrap: str, topic: str, n: int, prefix: str, txn_max_records: int) -> dict[str, Any]:
    state = tempfile.mkdtemp(prefix="walbus-bench-demux-")
    cfg = DemuxConfig(kafka_bootstrap=bootstrap, source_topic=topic, topic_prefix=prefix,
                      database="bench", group_id=f"bench-{uuid.uuid4().hex[:8]}", state_dir=state,
                      txn_max_records=txn_max_records)
    registry = new_registry()
    demux = Demux(cfg, registry=registry)
    task = asyncio.create_task(demux.run())
    started = None
    progress, progress_at = -1.0, time.monotonic()
    while True:
        await asyncio.sleep(0.05)
        if task.done():
            task.result()
        consumed = registry.get_sample_value("walbus_demux_records_consumed_total", {"partition": "0"}) or 0
        if consumed != progress:
            progress, progress_at = consumed, time.monotonic()
        elif time.monotonic() - progress_at > STALL_S:
            _dump_tasks()
            raise RuntimeError(f"the demux made no progress for {STALL_S} s at {consumed:.0f} of {n} records")
        if started is None and demux.workers and all(w.ready for w in demux.workers.values()):
            started = time.monotonic()
            cpu_started = time.process_time()
            faults_started = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        if consumed >= n:
            break
    assert started is not None
    elapsed = time.monotonic() - started
    cpu = time.process_time() - cpu_started
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_started
    demux.stop()
    await task
    commits = registry.get_sample_value("walbus_demux_txn_commit_seconds_count") or 0
    commit_sum = registry.get_sample_value("walbus_demux_txn_commit_seconds_sum") or 0
    return {"events": n, "seconds": round(elapsed, 3), "records_per_s": round(n / elapsed),
            "cpu_s": round(cpu, 3), "cpu_share": round(cpu / elapsed, 3),
            "page_faults": faults, "rss_mb": round(rss_mb(os.getpid()), 1), "transactions": int(commits), "commit_ms_avg": round(1000 * commit_sum / max(commits, 1), 2)}


def profile_summary(prof: cProfile.Profile, top: int) -> list[dict[str, Any]]:
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (filename, line, func), (_cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        short = "/".join(Path(filename).parts[-2:])
        rows.append({"function": f"{short}:{line}:{func}", "calls": nc, "self_s": round(tt, 3), "cum_s": round(ct, 3)})
    rows.sort(key=lambda r: r["self_s"], reverse=True)
    return rows[:top]


# Where the demux' time goes, by stage: (stage, path fragments of the functions in it).
# C functions (orjson, msgspec, aiokafka's Cython record code, socket calls) are
# counted in the stage of the Python function that called them.
STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("re-keying (demux.rekey: msgspec decode, key and row JSON)", ("demux/rekey.py",)),
    # walbus/aiokafka_shortcuts.py is mostly the demux' own fetch path (runs of records): fetch work.
    ("fetch (aiokafka consumer and walbus.aiokafka_shortcuts: batch unpacking, CRC, records or runs)",
     ("aiokafka/consumer/", "aiokafka/record/", "walbus/aiokafka_shortcuts.py")),
    ("batch append (aiokafka BatchBuilder)", ("producer/message_accumulator.py",)),
    ("produce requests and transactions (aiokafka sender, protocol encoding, CRC32C)",
     ("aiokafka/producer/", "aiokafka/protocol/", "aiokafka/client.py")),
    ("demux loop and bookkeeping (worker, service, store, metrics)", ("demux/", "prometheus_client/")),
    ("network and event loop (asyncio, sockets, aiokafka connections)",
     ("asyncio/", "selectors.py", "aiokafka/conn.py", "socket.py")),
]


WAITING = "waiting for the broker (epoll)"


def _stage_of(filename: str) -> str:
    path = filename.replace("\\", "/")
    for stage, parts in STAGES:
        if any(part in path for part in parts):
            return stage
    return "other"


def time_by_stage(prof: cProfile.Profile) -> list[dict[str, Any]]:
    """Self time per stage, in seconds and shares of the total (C callees go to their Python caller)."""
    stats = pstats.Stats(prof, stream=io.StringIO())
    totals: dict[str, float] = {}
    for (filename, _line, _func), (_cc, _nc, tt, _ct, callers) in stats.stats.items():  # type: ignore[attr-defined]
        if filename == "~" and callers:
            for (caller_file, _l, _f), caller_stats in callers.items():
                # Blocked in epoll: the process had nothing to do (waiting for the broker).
                stage = WAITING if "poll' of 'select.epoll" in _func else _stage_of(caller_file)
                totals[stage] = totals.get(stage, 0.0) + caller_stats[2]
        else:
            stage = _stage_of(filename)
            totals[stage] = totals.get(stage, 0.0) + tt
    whole = sum(totals.values()) or 1.0
    ordered = sorted(totals.items(), key=lambda kv: kv[1], reverse=True)
    return [{"stage": k, "self_s": round(v, 3), "share": round(v / whole, 3)} for k, v in ordered]


def w1_tables(partitions: int) -> list[str]:
    """pgkafka's ``transactions`` table, or one copy per partition of a multi-partition topic.

    The producer partitions the database topic by table (see producer.codec), so the
    copies' names are picked to land on distinct partitions.
    """
    if partitions == 1:
        return ["transactions"]
    from walbus.kafka import partition_for

    chosen: dict[int, str] = {}
    i = 0
    while len(chosen) < partitions:
        name = f"transactions_{i}"
        part = partition_for(f"public.{name}".encode(), partitions)
        chosen.setdefault(part, name)
        i += 1
    return [chosen[p] for p in range(partitions)]


async def wait_for_end_offsets(bootstrap: str, topic: str, total: int) -> None:
    """Until the topic's partitions hold ``total`` records together."""
    from aiokafka import AIOKafkaConsumer

    from walbus.kafka import topic_partitions

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        # The partition count once (an admin client per poll would cost the measured
        # producer, in this process, a good share of its CPU), then end offsets only.
        tps = await topic_partitions({"bootstrap_servers": bootstrap}, topic, poll_interval=0.05)
        while sum((await consumer.end_offsets(tps)).values()) < total:  # noqa: ASYNC110 -- polls the broker
            await asyncio.sleep(0.05)
    finally:
        await consumer.stop()


async def produce_w1(pg_dsn: str, bootstrap: str, topic: str, n: int, partitions: int = 1) -> dict[str, float]:
    """The real producer over a backlog of ``n`` rows in 100 transactions: seconds until all are in Kafka, CPU.

    With several partitions the rows are spread evenly over one table per partition.
    """
    import psycopg
    from psycopg import sql
    from psycopg.conninfo import make_conninfo

    from producer.config import ProducerConfig
    from producer.service import Producer

    dbname = f"bench_demux_{uuid.uuid4().hex[:8]}"
    tables = w1_tables(partitions)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    dsn = make_conninfo(pg_dsn, dbname=dbname)
    slot = f"walbus_{dbname}"
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for table in tables:
                conn.execute(sql.SQL("CREATE TABLE {} (transaction_id INT PRIMARY KEY, user_id INT, amount INT)")
                             .format(sql.Identifier(table)))

        async def run_producer(until: int | None) -> dict[str, float]:
            producer = Producer(ProducerConfig(pg_dsn=dsn, kafka_bootstrap=bootstrap, topic=topic,
                                               partitions=partitions))
            started, cpu_started = time.monotonic(), time.process_time()
            task = asyncio.create_task(producer.run())
            await producer.ready.wait()
            startup = time.monotonic() - started
            walsender = walsender_pid(dsn, slot)
            walsender_cpu = _cpu_seconds(walsender) if walsender else 0.0
            if until is not None:
                await wait_for_end_offsets(bootstrap, topic, until)
            elapsed, cpu = time.monotonic() - started, time.process_time() - cpu_started
            if walsender:
                walsender_cpu = _cpu_seconds(walsender) - walsender_cpu
            producer.stop()
            await task
            # The producer's own CPU, and PostgreSQL's (its walsender decodes the WAL
            # in a process of its own: the producer side runs on two cores).
            # Its clock includes its start (connections, the slot): startup_s of it.
            return {"seconds": elapsed, "startup_s": round(startup, 3), "cpu_s": round(cpu, 3),
                    "walsender_cpu_s": round(walsender_cpu, 3)}

        await run_producer(None)  # creates the slot and the publication
        per_txn = n // 100 // len(tables)
        with psycopg.connect(dsn, autocommit=True) as conn:
            for t in range(100):
                with conn.transaction():
                    for table in tables:
                        conn.execute(
                            sql.SQL("INSERT INTO {} SELECT g, g %% 50000, g %% 1000000 "
                                    "FROM generate_series(%s::int, %s::int) g").format(sql.Identifier(table)),
                            (t * per_txn + 1, (t + 1) * per_txn),
                        )
        settled = await settle(pg_dsn)  # the load's checkpoint and autovacuum are not the producer's work
        return {**await run_producer(per_txn * 100 * len(tables)), **settled}
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
                         (slot,))
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname)))


def walsender_pid(dsn: str, slot: str) -> int | None:
    """The walsender process serving ``slot``, when PostgreSQL runs on this machine."""
    import psycopg
    from psycopg.conninfo import conninfo_to_dict

    host = str(conninfo_to_dict(dsn).get("host") or "")
    if host not in ("", "localhost", "127.0.0.1", "::1") and not host.startswith("/"):
        return None
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
    return None if row is None or row[0] is None else int(row[0])


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_demux_processes(bootstrap: str, topic: str, partitions: int, prefix: str,
                              txn_max_records: int) -> dict[str, Any]:
    """``partitions`` `walbus demux` processes in one group, one source partition each.

    The clock starts once every process holds exactly one partition (the group is
    stable); the events committed before that are not counted. It stops when the
    group's committed offsets reach the end of every partition.
    """
    from aiokafka import AIOKafkaConsumer, TopicPartition

    group = f"bench-{uuid.uuid4().hex[:8]}"
    state = tempfile.mkdtemp(prefix="walbus-bench-demux-")
    tps = [TopicPartition(topic, p) for p in range(partitions)]
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-m", "walbus.app.cli", "demux", "--kafka-bootstrap", bootstrap, "--source-topic", topic,
            "--group-id", group, "--topic-prefix", prefix, "--database", "bench", "--state-dir", f"{state}/{i}",
            "--txn-max-records", str(txn_max_records),
            # The broker's minimum (group.min.session.timeout.ms); heartbeats every 2 s, so
            # the group settles on one partition per process sooner.
            "--session-timeout-ms", "6000",
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        for i in range(partitions)
    ]
    held: list[set[int]] = [set() for _ in procs]
    last_lines: list[list[bytes]] = [[] for _ in procs]  # shown when the group does not settle

    async def follow(i: int, proc: asyncio.subprocess.Process) -> None:
        assert proc.stderr is not None
        async for line in proc.stderr:
            last_lines[i] = [*last_lines[i][-4:], line[:300]]
            try:
                rec = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if rec.get("msg") == "partition opened":
                held[i].add(int(rec["partition"]))
            elif rec.get("msg") == "partition revoked":
                held[i].discard(int(rec["partition"]))

    readers = [asyncio.create_task(follow(i, proc)) for i, proc in enumerate(procs)]
    offsets = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await offsets.start()
    try:
        ends = await offsets.end_offsets(tps)
        total = sum(ends.values())

        async def committed() -> int:
            return sum([await offsets.committed(tp) or 0 for tp in tps])

        settle_by = time.monotonic() + 60
        while not all(len(h) == 1 for h in held) or len(set().union(*held)) != partitions:
            if any(proc.returncode is not None for proc in procs):
                raise RuntimeError("a demux process exited during the benchmark")
            if time.monotonic() > settle_by:
                raise RuntimeError(f"the demux group did not settle on one partition per process: {held}; "
                                   f"last log lines: {last_lines}")
            await asyncio.sleep(0.02)
        started = time.monotonic()
        done_before = await committed()
        cpu_before = [_cpu_seconds(proc.pid) for proc in procs]
        while True:
            done = await committed()
            if done >= total:
                break
            await asyncio.sleep(0.05)
        elapsed = time.monotonic() - started
        cpu = [_cpu_seconds(proc.pid) - c for proc, c in zip(procs, cpu_before, strict=True)]
    finally:
        await offsets.stop()
        for proc in procs:
            if proc.returncode is None:
                proc.terminate()
        for proc in procs:
            await proc.wait()
        for reader in readers:
            reader.cancel()
    counted = done - done_before
    return {"events": counted, "processes": partitions, "seconds": round(elapsed, 3),
            "records_per_s": round(counted / elapsed), "cpu_s_per_process": [round(c, 3) for c in cpu],
            "note": f"{partitions} `walbus demux` processes, one source partition each; events committed "
                    f"before the group was stable ({done_before}) not counted"}


async def main_async(args: argparse.Namespace) -> None:
    run = uuid.uuid4().hex[:8]
    try:
        await run_rounds(args, run)
    finally:
        if not args.keep_topics:  # a benchmark writes gigabytes
            await delete_topics_matching(args.kafka_bootstrap, lambda t: run in t)


async def run_rounds(args: argparse.Namespace, run: str) -> None:
    fill_rates: list[float] = []
    demux_rates: list[float] = []
    # CPU µs per event: the demux process; the producer process; producer + walsender.
    cpu_us: dict[str, list[float]] = {"demux": [], "producer": [], "producer_and_walsender": []}
    for r in range(args.rounds):
        # Producer and demux alternate, round after round: a machine whose speed drifts
        # (a shared host) then slows both alike, and the ratio stays meaningful.
        topic = f"bench_demux_{run}_{r}"
        if args.pg_dsn:
            produced = await produce_w1(args.pg_dsn, args.kafka_bootstrap, topic, args.events, args.partitions)
            seconds = produced.pop("seconds")
            cpu_us["producer"].append(1e6 * produced["cpu_s"] / args.events)
            cpu_us["producer_and_walsender"].append(1e6 * (produced["cpu_s"] + produced["walsender_cpu_s"]) / args.events)
            emit({"phase": "producer", "round": r, "events": args.events, "seconds": round(seconds, 3),
                  "records_per_s": round(args.events / seconds), **produced,
                  "note": "walbus produce (pgoutput) draining a W1 backlog into the database topic"})
        else:
            evs = events(args.events)
            seconds = await prefill(args.kafka_bootstrap, topic, evs)
            emit({"phase": "prefill", "round": r, "events": len(evs), "seconds": round(seconds, 3),
                  "records_per_s": round(len(evs) / seconds),
                  "note": "synthetic events, raw Kafka write with record batches (acks=all)"})
            del evs
        fill_rates.append(args.events / seconds)
        # The producer phase's leftovers (its database dropped, the topic's dirty pages)
        # are not the demux's work either.
        settled = await settle(args.pg_dsn)
        if args.partitions == 1:
            result = await run_demux(args.kafka_bootstrap, topic, args.events, f"bench{run}r{r}",
                                     args.txn_max_records)
        else:
            result = await run_demux_processes(args.kafka_bootstrap, topic, args.partitions, f"bench{run}r{r}",
                                               args.txn_max_records)
        demux_rates.append(result["records_per_s"])
        demux_cpu = result.get("cpu_s") or sum(result.get("cpu_s_per_process", []))
        if result["events"]:  # several processes: only the events after the group settled count
            cpu_us["demux"].append(1e6 * demux_cpu / result["events"])
        emit({"phase": "demux", "round": r, **result, **settled})
    ratios = [d / f for d, f in zip(demux_rates, fill_rates, strict=True)]
    summary: dict[str, Any] = {
        "phase": "summary", "rounds": args.rounds, "events": args.events,
        "demux_records_per_s_median": round(statistics.median(demux_rates)),
        "ratios": [round(x, 3) for x in ratios], "ratio_median": round(statistics.median(ratios), 3),
    }
    if args.pg_dsn:
        summary["producer_records_per_s_median"] = round(statistics.median(fill_rates))
        # Where the gap comes from: the demux runs on one core; the producer side runs
        # on two (PostgreSQL decodes the WAL in its walsender, beside the producer).
        summary["cpu_us_per_event_median"] = {k: round(statistics.median(v), 2) for k, v in cpu_us.items() if v}
        summary["target"] = "demux rate >= producer rate (ratio_median >= 1.0)"
        summary["target_met"] = statistics.median(ratios) >= 1.0
    emit(summary)
    if args.profile_events:
        ptopic = f"bench_demux_{run}_profile"
        pev = events(args.profile_events, seed=2)
        await prefill(args.kafka_bootstrap, ptopic, pev)
        del pev
        prof = cProfile.Profile()
        prof.enable()
        presult = await run_demux(args.kafka_bootstrap, ptopic, args.profile_events, f"benchp{run}",
                                  args.txn_max_records)
        prof.disable()
        emit({"phase": "profile", "note": "rates under cProfile are lower", **presult,
              "time_by_stage": time_by_stage(prof), "top_self_time": profile_summary(prof, args.top)})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kafka-bootstrap", required=True)
    p.add_argument("--pg-dsn", help="fill the topic with the real producer (W1 backlog) and report its rate")
    p.add_argument("--events", type=int, default=1_000_000)
    p.add_argument("--partitions", type=int, default=1,
                   help="with --pg-dsn: a database topic of this many partitions (one W1 table each) and as many "
                        "demux processes")
    p.add_argument("--rounds", type=int, default=3, help="producer/demux pairs, alternating; the summary takes medians")
    p.add_argument("--profile-events", type=int, default=200_000, help="0: no profile run")
    p.add_argument("--txn-max-records", type=int, default=20000)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--keep-topics", action="store_true", help="keep the topics written (deleted at the end otherwise)")
    p.add_argument("--default-gc", action="store_true", help="keep Python's default GC thresholds")
    args = p.parse_args()
    if not args.default_gc:
        tune_collector()  # as `walbus demux` does
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
