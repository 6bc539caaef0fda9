"""Whole-pipeline fault soak (issue 14, part 5); prints JSON lines, exits 1 on any violation.

    python -m bench.soak [--minutes 15] [--faults 50] [--brokers 1|3] [--seed 1] [--no-warehouse]

Runs PostgreSQL + Kafka (its own `walbus dev` stack in a temp state dir, unless
WALBUS_PG_DSN and WALBUS_KAFKA_BOOTSTRAP are given), the producer on a 2-partition database
topic, two demux processes (static members of one group), a `Feed` consumer applying each
event exactly once into a PostgreSQL table (bench/soak_feed.py) and a `walbus warehouse
load` every ``--warehouse-every`` seconds, while a writer runs a mixed workload and records
what it committed (bench/soak_workload.py). A supervisor restarts what exits, as systemd
would. A fault injector (seeded) picks at random intervals: kill -9 of the producer, of a
demux, of the Feed consumer, of a running warehouse load; SIGSTOP of a service for 5-20 s;
kill -9 of the broker leading a database-topic partition, restarted 5-15 s later;
``pg_ctl restart -m immediate``; ``pg_terminate_backend`` of the walsender. The broker and
PostgreSQL faults need a stack the soak owns: on services given by the environment they are
left out (``kinds_unavailable`` in the summary).

After the run and a quiet period it checks: the database topic holds every committed change
(against the writer's record); every per-table topic, read with read_committed, equals
``SELECT *`` and holds no event twice; the warehouse's current tables equal the tables and
its history holds each event once; the Feed consumer applied each event exactly once.

One JSON line per fault (with its recovery time: from the end of the fault until the
pipeline stage it hit has moved past where the source was then; a fault that hits a stage
still recovering from an earlier one supersedes it), then one summary line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psycopg
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.client import AIOKafkaClient

from bench.common import (
    ROOT,
    delete_topics_matching,
    dsn_in_env,
    emit,
    list_topics,
    scratch_database,
)
from bench.soak_feed import EFFECTS_DSN_ENV
from bench.soak_workload import TABLES, Writer
from walbus.contract import ContractError, check_key, decode_event, split_table, table_topic
from walbus.kafka import partition_for

PARTITIONS = 2
TOPIC_PREFIX = "walbus"
RECOVERY_TIMEOUT_S = 300.0
QUIET_TIMEOUT_S = 300.0

PROCESS_KINDS = ("producer_kill", "demux_kill", "feed_kill", "sigstop", "walsender_terminate")
OWNED_STACK_KINDS = ("broker_kill", "pg_restart")


# ---------------------------------------------------------------------------- services


@dataclass
class Service:
    """A long-running process the supervisor keeps alive."""

    name: str
    args: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    unexpected_exits: int = 0
    killing: bool = False  # the injector killed it: an expected exit
    env: dict[str, str] = field(default_factory=dict)  # secrets (DSNs) go here, not in argv

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), **self.env}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(dsn_in_env(self.args, env), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


class Supervisor:
    """Restarts a service that exited, one second later (systemd's Restart=always, RestartSec=1)."""

    def __init__(self, services: list[Service]) -> None:
        self.services = {s.name: s for s in services}
        self.stopping = False

    async def run(self) -> None:
        while not self.stopping:
            for svc in self.services.values():
                if svc.proc is None or svc.proc.poll() is None:
                    continue
                if not svc.killing:
                    svc.unexpected_exits += 1
                    emit(event="unexpected_exit", service=svc.name, code=svc.proc.returncode, log=str(svc.log))
                svc.killing = False
                await asyncio.sleep(1.0)
                if self.stopping:
                    break
                svc.start()
                svc.restarts += 1
            await asyncio.sleep(0.2)

    def stop_all(self) -> None:
        self.stopping = True
        for svc in self.services.values():
            svc.stop()


class WarehouseLoader:
    """`walbus warehouse load` every ``every_s`` seconds, at once again after a failed or killed load."""

    def __init__(self, args: list[str], log: Path, every_s: float) -> None:
        self.args = args
        self.log = log
        self.every_s = every_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.successes = 0
        self.failures = 0
        self.killed = 0
        self.kill_next = False
        self.wake = asyncio.Event()
        self.stopping = False

    def _spawn(self) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with self.log.open("ab") as out:
            # Own session: kill -9 takes the load's JVM (the PySpark gateway) with it.
            return subprocess.Popen(self.args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)

    async def run_once(self) -> int:
        self.proc = self._spawn()
        code = await asyncio.to_thread(self.proc.wait)
        self.proc = None
        if code == 0:
            self.successes += 1
        elif code == -signal.SIGKILL:
            self.killed += 1
        else:
            self.failures += 1
            emit(event="warehouse_load_failed", code=code, log=str(self.log))
        return code

    async def run(self) -> None:
        while not self.stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), self.every_s)
            self.wake.clear()
            if self.stopping:
                break
            while not self.stopping:
                if await self.run_once() == 0:
                    break
                await asyncio.sleep(1.0)  # a failed or killed load runs again

    def kill(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        return True


# ---------------------------------------------------------------------------- pipeline state


class Probe:
    """Where each stage of the pipeline is: slot, topic ends, group offsets."""

    def __init__(self, bootstrap: str, pg_dsn: str, topic: str, slot: str) -> None:
        self.bootstrap, self.pg_dsn, self.topic, self.slot = bootstrap, pg_dsn, topic, slot
        self.tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        self.consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                                         request_timeout_ms=10000)
        self.admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10000)

    async def start(self) -> None:
        await self.consumer.start()
        await self.admin.start()

    async def close(self) -> None:
        await self.consumer.stop()
        await self.admin.close()

    async def end_offsets(self) -> dict[int, int]:
        ends = await asyncio.wait_for(self.consumer.end_offsets(self.tps), 15)
        return {tp.partition: int(o) for tp, o in ends.items()}

    async def committed(self, group: str) -> dict[int, int]:
        offsets = await asyncio.wait_for(self.admin.list_consumer_group_offsets(group, partitions=self.tps), 15)
        return {tp.partition: int(om.offset) for tp, om in offsets.items()}

    def _pg(self, query: str, params: tuple[Any, ...] = ()) -> int | None:
        try:
            with psycopg.connect(self.pg_dsn, autocommit=True, connect_timeout=3) as conn:
                row = conn.execute(query.encode(), params).fetchone()
        except psycopg.OperationalError:
            return None
        return None if row is None or row[0] is None else int(row[0])

    async def current_lsn(self) -> int | None:
        return await asyncio.to_thread(self._pg, "SELECT (pg_current_wal_lsn() - '0/0')::int8")

    async def confirmed_lsn(self) -> int | None:
        return await asyncio.to_thread(
            self._pg, "SELECT (confirmed_flush_lsn - '0/0')::int8 FROM pg_replication_slots WHERE slot_name = %s", (self.slot,)
        )

    async def walsender_pid(self) -> int | None:
        return await asyncio.to_thread(self._pg, "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (self.slot,))

    async def terminate_walsender(self) -> int | None:
        pid = await self.walsender_pid()
        if pid is not None:
            await asyncio.to_thread(self._pg, "SELECT pg_terminate_backend(%s)::int", (pid,))
        return pid

    async def leader(self, partition: int) -> int | None:
        client = AIOKafkaClient(bootstrap_servers=self.bootstrap, request_timeout_ms=10000)
        await client.bootstrap()
        try:
            metadata = await client.fetch_all_metadata()
            leader = metadata.leader_for_partition(TopicPartition(self.topic, partition))
            return None if leader is None or leader < 0 else int(leader)
        finally:
            await client.close()


async def _retrying(check: Callable[[], Awaitable[bool]]) -> bool:
    """``check()``, counting a broker or database error as not yet (the fault may still be on)."""
    try:
        return await check()
    except Exception:
        return False


async def wait_for(check: Callable[[], Awaitable[bool]], timeout_s: float, every_s: float = 0.5) -> float | None:
    """Seconds until ``check()`` held, or None after ``timeout_s``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if await _retrying(check):
            return time.monotonic() - started
        await asyncio.sleep(every_s)
    return None


# ---------------------------------------------------------------------------- the soak


@dataclass
class Stack:
    """The services: given by the environment, or a local stack this run owns (``owned``)."""

    maintenance_dsn: str
    bootstrap: str
    owned: Any | None = None  # walbus.app.dev.LocalStack


@contextlib.contextmanager
def stack_for(brokers: int, workdir: Path) -> Iterator[Stack]:
    dsn, bootstrap = os.environ.get("WALBUS_PG_DSN"), os.environ.get("WALBUS_KAFKA_BOOTSTRAP")
    if dsn and bootstrap:
        yield Stack(dsn, bootstrap)
        return
    from walbus.app.dev import LocalStack

    stack = LocalStack.load(workdir / "stack", brokers=brokers)
    try:
        stack.up()
        yield Stack(stack.postgres.dsn, stack.kafka.bootstrap, stack)
    finally:
        stack.down()


@dataclass
class Soak:
    args: argparse.Namespace
    stack: Stack
    workdir: Path
    run: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    fault_lines: list[dict[str, Any]] = field(default_factory=list)
    recoveries: dict[str, list[float]] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    watchers: list[asyncio.Task[None]] = field(default_factory=list)
    latest_fault: dict[str, int] = field(default_factory=dict)  # stage -> the fault whose recovery is timed
    superseded: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.args.seed)
        self.database = f"soak_{self.run}"
        self.topic = f"{TOPIC_PREFIX}.{self.database}"
        self.slot = f"walbus_{self.database}"
        self.demux_group = f"soak-demux-{self.run}"
        self.feed_group = f"soak-feed-{self.run}"
        self.started = time.monotonic()

    # -- setup

    def services(self, db_dsn: str, effects_dsn: str) -> list[Service]:
        py, logs, boot = sys.executable, self.workdir / "logs", self.stack.bootstrap
        logs.mkdir(parents=True, exist_ok=True)
        producer = Service("producer", [py, "-m", "walbus.app.cli", "produce", "--pg-dsn", db_dsn, "--kafka-bootstrap", boot,
                                        "--partitions", str(PARTITIONS), "--retry-max-delay", "5"], logs / "producer.log")
        demuxes = [
            Service(f"demux-{i}", [py, "-m", "walbus.app.cli", "demux", "--kafka-bootstrap", boot, "--source-topic", self.topic,
                                   "--group-id", self.demux_group, "--group-instance-id", f"demux-{i}",
                                   "--state-dir", str(self.workdir / f"demux-{i}")], logs / f"demux-{i}.log")
            for i in range(2)
        ]
        feed = Service("feed", [py, "-m", "bench.soak_feed", self.topic, self.feed_group, boot],
                       logs / "feed.log", env={EFFECTS_DSN_ENV: effects_dsn})
        return [producer, *demuxes, feed]

    def loader(self) -> WarehouseLoader:
        args = [sys.executable, "-m", "walbus.app.cli", "warehouse", "load", "--kafka-bootstrap", self.stack.bootstrap,
                "--topic", self.topic, "--warehouse", str(self.workdir / "warehouse"), "--master", "local[1]",
                "--shuffle-partitions", "2"]
        return WarehouseLoader(args, self.workdir / "logs" / "warehouse.log", self.args.warehouse_every)

    def kinds(self) -> list[str]:
        kinds = list(PROCESS_KINDS)
        if not self.args.no_warehouse:
            kinds.append("warehouse_kill")
        if self.stack.owned is not None:
            kinds += OWNED_STACK_KINDS
        return kinds

    # -- faults

    def record_fault(self, line: dict[str, Any]) -> None:
        line = {"fault": len(self.fault_lines) + 1, "at_s": round(time.monotonic() - self.started, 1), **line}
        self.fault_lines.append(line)

    def recovery_timeout(self, service: str) -> float:
        """How long a stage may take to recover. The warehouse is a batch stage: it recovers when
        a whole load (Spark start-up included) has finished, and a later fault may kill that
        rerun too, so it gets two load intervals."""
        if service == "warehouse":
            return max(RECOVERY_TIMEOUT_S, 2 * self.args.warehouse_every)
        return RECOVERY_TIMEOUT_S

    async def watch(self, line: dict[str, Any], service: str, check: Callable[[], Awaitable[bool]]) -> None:
        """Time ``service``'s recovery from the fault in ``line``.

        A later fault of the same stage before it recovered supersedes this one: recovery is
        then measured from that later fault (a warehouse load killed twice recovers when a
        load after the second kill finishes). The data checks after the run still prove
        nothing was lost whatever the faults' timing."""
        fault = line["fault"]
        self.latest_fault[service] = fault

        async def recovered_or_superseded() -> bool:
            return self.latest_fault[service] != fault or await check()

        timeout = self.recovery_timeout(service)
        took = await wait_for(recovered_or_superseded, timeout)
        if self.latest_fault[service] != fault:
            self.superseded += 1
            emit(**line, recovery_s=None, superseded_by=self.latest_fault[service])
            return
        if took is None:
            self.violations.append(f"{service} did not recover within {timeout:.0f} s after fault {fault}")
        else:
            self.recoveries.setdefault(service, []).append(took)
        emit(**line, recovery_s=None if took is None else round(took, 2))

    async def stage_check(self, service: str, *, strict: bool = True) -> Callable[[], Awaitable[bool]]:
        """What ``service`` having recovered means, from where the pipeline is now.

        ``strict``: it has to move past that point (a restarted consumer has committed work
        done after the fault), not merely be there; ``strict=False`` for the quiet period.
        """
        probe = self.probe
        if service == "warehouse":
            done = self.warehouse.successes if self.warehouse else 0

            async def warehouse_done() -> bool:
                return self.warehouse is not None and self.warehouse.successes > done

            return warehouse_done
        if service == "producer":
            lsn = await wait_value(probe.current_lsn)

            async def confirmed() -> bool:
                got = await probe.confirmed_lsn()
                return got is not None and got >= lsn

            return confirmed
        group = self.demux_group if service == "demux" else self.feed_group
        ends = await wait_value(probe.end_offsets)

        async def caught_up() -> bool:
            got = await probe.committed(group)
            return all(got.get(p, -1) >= end + strict for p, end in ends.items())

        return caught_up

    async def whole_pipeline(self) -> Callable[[], Awaitable[bool]]:
        producer, demux = await self.stage_check("producer"), await self.stage_check("demux")

        async def both() -> bool:
            return await producer() and await demux()

        return both

    async def after_fault(self, line: dict[str, Any], service: str) -> None:
        check = await (self.whole_pipeline() if service in ("broker", "postgres", "walsender") else self.stage_check(service))
        self.record_fault(line)
        self.watchers.append(asyncio.create_task(self.watch(self.fault_lines[-1], service, check)))

    async def kill(self, name: str) -> None:
        svc = self.supervisor.services[name]
        svc.killing = True
        svc.signal(signal.SIGKILL)
        await self.after_fault({"kind": f"{name.split('-')[0]}_kill", "target": name}, name.split("-")[0])

    async def inject(self, kind: str) -> None:
        rng = self.rng
        if kind in ("producer_kill", "feed_kill"):
            await self.kill(kind.removesuffix("_kill"))
        elif kind == "demux_kill":
            await self.kill(f"demux-{rng.randrange(2)}")
        elif kind == "sigstop":
            name = rng.choice(sorted(self.supervisor.services))
            pause = rng.uniform(5, 20)
            svc = self.supervisor.services[name]
            svc.signal(signal.SIGSTOP)
            await asyncio.sleep(pause)
            svc.signal(signal.SIGCONT)
            await self.after_fault({"kind": "sigstop", "target": name, "paused_s": round(pause, 1)}, name.split("-")[0])
        elif kind == "warehouse_kill":
            await self.kill_warehouse_load()
        elif kind == "walsender_terminate":
            pid = await self.probe.terminate_walsender()
            await self.after_fault({"kind": kind, "target": f"walsender pid {pid}"}, "walsender")
        elif kind == "broker_kill":
            await self.kill_broker()
        elif kind == "pg_restart":
            took = await asyncio.to_thread(self.restart_postgres)
            await self.after_fault({"kind": kind, "target": "postgres", "restart_s": round(took, 1)}, "postgres")

    async def kill_warehouse_load(self) -> None:
        assert self.warehouse is not None
        if self.warehouse.proc is None:
            self.warehouse.wake.set()  # start one now, to kill it while it runs
        await asyncio.sleep(self.rng.uniform(5, 30))
        if not self.warehouse.kill():
            self.record_fault({"kind": "warehouse_kill", "target": "none running (the load had ended)"})
            emit(**self.fault_lines[-1], recovery_s=None)
            return
        await self.after_fault({"kind": "warehouse_kill", "target": "warehouse load"}, "warehouse")

    async def kill_broker(self) -> None:
        owned = self.stack.owned
        assert owned is not None
        partition = self.rng.randrange(PARTITIONS)
        leader = await _leader_or_none(self.probe, partition)
        nodes = {n.node_id: n for n in owned.kafka.nodes}
        node = nodes.get(leader) if leader is not None else None
        node = node or self.rng.choice(owned.kafka.nodes)
        if node.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(node.pid, signal.SIGKILL)
        down = self.rng.uniform(5, 15)
        await asyncio.sleep(down)
        await asyncio.to_thread(_reap_and_restart, node)
        owned.save()
        await self.after_fault({"kind": "broker_kill", "target": f"broker {node.node_id}",
                                "leader_of": f"{self.topic}-{partition}" if leader == node.node_id else None,
                                "down_s": round(down, 1)}, "broker")

    def restart_postgres(self) -> float:
        from walbus.app.dev.postgres import _run_as, find_bindir

        pg = self.stack.owned.postgres  # type: ignore[union-attr]
        started = time.monotonic()
        subprocess.run([str(find_bindir() / "pg_ctl"), "restart", "-m", "immediate", "-w", "-D", str(pg.datadir),
                        "-l", str(pg.logfile)], check=True, capture_output=True, user=_run_as())
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pg.pid, os.WNOHANG)  # the first postmaster was our child
        pg.pid = int((pg.datadir / "postmaster.pid").read_text().split()[0])
        self.stack.owned.save()  # type: ignore[union-attr]
        return time.monotonic() - started

    async def injector(self) -> None:
        kinds = self.kinds()
        total_s = self.args.minutes * 60
        mean_gap = max(1.0, 0.6 * total_s / max(self.args.faults, 1))
        order: list[str] = []
        await asyncio.sleep(min(20.0, mean_gap))  # the pipeline gets going first
        while len(self.fault_lines) < self.args.faults or time.monotonic() - self.started < total_s:
            if len(self.fault_lines) >= self.args.faults:
                await asyncio.sleep(1.0)
                continue
            if not order:  # each kind once per round, in a seeded order: every kind happens
                order = self.rng.sample(kinds, len(kinds))
            await self.inject(order.pop())
            await asyncio.sleep(self.rng.uniform(0.5, 1.5) * mean_gap)

    # -- the run

    async def main(self, db_dsn: str, effects_dsn: str) -> int:
        writer = Writer(db_dsn, self.args.seed, duration_s=self.args.minutes * 60, large_rows=self.args.large_rows)
        writer.create_schema()
        services = self.services(db_dsn, effects_dsn)
        self.supervisor = Supervisor(services)
        self.warehouse = None if self.args.no_warehouse else self.loader()
        services[0].start()
        if await wait_for(self._topic_exists, 120) is None:
            raise SystemExit(f"the producer did not create {self.topic}; log {services[0].log}")
        for svc in services[1:]:
            svc.start()
        self.probe = Probe(self.stack.bootstrap, db_dsn, self.topic, self.slot)
        await self.probe.start()
        # Writes start once the slot exists: earlier ones would reach the topic as snapshot reads.
        if await wait_for(self._slot_exists, 120) is None:
            raise SystemExit(f"the producer did not create the slot {self.slot}; log {services[0].log}")
        tasks = [asyncio.create_task(self.supervisor.run())]
        if self.warehouse:
            tasks.append(asyncio.create_task(self.warehouse.run()))
        try:
            writer.start()
            await self.injector()
            writer.stop()
            if writer.error is not None:
                self.violations.append(f"writer failed: {writer.error!r}")
            await asyncio.gather(*self.watchers)
            quiet_s = await self.quiet()
            if self.warehouse:
                self.warehouse.stopping = True
                self.warehouse.wake.set()
                await asyncio.gather(tasks.pop())
                if await self.warehouse.run_once() != 0:
                    self.violations.append(f"the final warehouse load failed; log {self.warehouse.log}")
            counts = await self.check(writer, db_dsn, effects_dsn)
        finally:
            self.supervisor.stop_all()
            for t in tasks:
                t.cancel()
            await self.probe.close()
        self.summary(writer, counts, quiet_s)
        return 1 if self.violations else 0

    async def _slot_exists(self) -> bool:
        return await self.probe.confirmed_lsn() is not None

    async def _topic_exists(self) -> bool:
        return self.topic in await list_topics(self.stack.bootstrap)

    async def quiet(self) -> float:
        """Wait until the slot, the demux and the Feed consumer have caught up with the writer's end."""
        started = time.monotonic()
        for service in ("producer", "demux", "feed"):
            check = await self.stage_check(service, strict=False)
            if await wait_for(check, QUIET_TIMEOUT_S) is None:
                self.violations.append(f"stall: {service} did not catch up within {QUIET_TIMEOUT_S:.0f} s after the run")
        return time.monotonic() - started

    # -- checks

    async def check(self, writer: Writer, db_dsn: str, effects_dsn: str) -> dict[str, int]:
        counts: Counter[str] = Counter()
        events = await self.check_database_topic(writer, counts)
        for table in TABLES:
            await self.check_table_topic(table, db_dsn, counts)
        await asyncio.to_thread(self.check_effects, events, effects_dsn, counts)
        if self.warehouse:
            await asyncio.to_thread(self.check_warehouse, events, db_dsn, counts)
        counts["events"] = len(events)
        return dict(counts)

    def violation(self, counts: Counter[str], kind: str, n: int, detail: str) -> None:
        if n:
            counts[kind] += n
            self.violations.append(f"{detail}: {n}")

    async def check_database_topic(self, writer: Writer, counts: Counter[str]) -> dict[tuple[int, int], Any]:
        """Every committed change is in the database topic: per xid, per (table, operation)."""
        events: dict[tuple[int, int], Any] = {}
        invalid = misplaced = 0
        for partition, key, value in await read_topic(self.stack.bootstrap, self.topic):
            try:
                event = decode_event(value or b"")
                check_key(key, event)
            except ContractError:
                invalid += 1
                continue
            misplaced += partition_for(event.table.encode(), PARTITIONS) != partition
            events.setdefault(event.position, event)
        self.violation(counts, "invalid", invalid, "invalid records in the database topic")
        self.violation(counts, "misplaced", misplaced, "events outside their table's partition")
        got: dict[int, Counter[tuple[str, str]]] = {}
        for event in events.values():
            got.setdefault(event.xid, Counter())[(event.table, event.operation)] += 1
        lost: Counter[tuple[str, str]] = Counter()
        unexpected: Counter[tuple[str, str]] = Counter()
        for txn in writer.record.committed:
            have = got.pop(txn.xid, Counter())
            lost += txn.counts - have
            unexpected += have - txn.counts
        for have in got.values():
            unexpected += have
        self.violation(counts, "lost", lost.total(), f"committed changes missing from the database topic {dict(lost)}")
        self.violation(counts, "unexpected", unexpected.total(),
                       f"events in the database topic no committed transaction made {dict(unexpected)}")
        return events

    async def check_table_topic(self, table: str, db_dsn: str, counts: Counter[str]) -> None:
        """A per-table topic read with read_committed equals SELECT * and holds each event once."""
        schema, name = split_table(table)
        topic = table_topic(TOPIC_PREFIX, self.database, schema, name)
        latest: dict[tuple[Any, ...], dict[str, Any] | None] = {}
        positions: Counter[tuple[int, int]] = Counter()
        for _partition, key, value in await read_topic(self.stack.bootstrap, topic):
            if key is None:
                continue
            k = tuple(orjson.loads(key).values())
            if value is None:
                latest[k] = None
                continue
            row = orjson.loads(value)
            positions[(row["__commit_lsn"], row["__seq"])] += 1
            latest[k] = {c: v for c, v in row.items() if not c.startswith("__")}
        topic_rows = {k: r for k, r in latest.items() if r is not None}
        self.violation(counts, "duplicated", sum(n - 1 for n in positions.values()), f"events twice in {topic}")
        self.compare_rows(counts, topic, topic_rows, await asyncio.to_thread(pg_rows, db_dsn, table))

    def compare_rows(self, counts: Counter[str], where: str, got: dict[tuple[Any, ...], dict[str, Any]],
                     want: dict[tuple[Any, ...], dict[str, Any]]) -> None:
        missing = sum(1 for k in want if k not in got)
        extra = sum(1 for k in got if k not in want)
        # A row written before ADD COLUMN has no such field: the same as NULL.
        differ = sum(1 for k, row in want.items() if k in got and any(got[k].get(c) != v for c, v in row.items()))
        self.violation(counts, "rows_missing", missing, f"rows of SELECT * missing from {where}")
        self.violation(counts, "rows_extra", extra, f"rows in {where} that SELECT * does not have")
        self.violation(counts, "rows_differ", differ, f"rows of {where} that differ from SELECT *")

    def check_effects(self, events: dict[tuple[int, int], Any], effects_dsn: str, counts: Counter[str]) -> None:
        """The Feed consumer applied each event of the database topic exactly once."""
        with psycopg.connect(effects_dsn) as conn:
            rows = conn.execute("SELECT commit_lsn, seq FROM soak_effects").fetchall()
        applied = Counter((int(r[0]), int(r[1])) for r in rows)
        self.violation(counts, "duplicated", sum(n - 1 for n in applied.values()), "events the Feed consumer applied twice")
        self.violation(counts, "lost", sum(1 for p in events if p not in applied), "events the Feed consumer never applied")
        self.violation(counts, "unexpected", sum(1 for p in applied if p not in events), "effects of events not in the topic")

    def check_warehouse(self, events: dict[tuple[int, int], Any], db_dsn: str, counts: Counter[str]) -> None:
        """Current tables equal the tables; history holds each event of the topic once."""
        res = subprocess.run([sys.executable, "-m", "bench.soak_warehouse", str(self.workdir / "warehouse"), self.topic, *TABLES],
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, timeout=900)
        if res.returncode != 0:
            self.violations.append(f"the warehouse check failed: {res.stderr.decode(errors='replace')[-2000:]}")
            return
        per_table = Counter(e.table for e in events.values())
        for line in res.stdout.decode().splitlines():
            if not line.startswith("{"):
                continue
            out = orjson.loads(line)
            table = out["table"]
            self.violation(counts, "duplicated", out["history"] - out["history_positions"], f"events twice in {table}'s history")
            self.violation(counts, "lost", max(0, per_table[table] - out["history_positions"]), f"events missing from {table}'s history")
            want = pg_rows(db_dsn, table)
            pk = pg_primary_key(db_dsn, table)
            got = {tuple(r[c] for c in pk): r for r in out["rows"] or []}
            self.compare_rows(counts, f"the warehouse's {table} current table", got, want)

    # -- report

    def summary(self, writer: Writer, counts: dict[str, int], quiet_s: float) -> None:
        kinds = Counter(str(f["kind"]) for f in self.fault_lines)
        services = self.supervisor.services.values()
        emit(
            summary="soak", minutes=self.args.minutes, brokers=self.args.brokers if self.stack.owned else None,
            seed=self.args.seed, faults=len(self.fault_lines), faults_by_kind=dict(sorted(kinds.items())),
            kinds_unavailable=[k for k in OWNED_STACK_KINDS if k not in self.kinds()],
            transactions=len(writer.record.committed), in_doubt_commits=writer.record.in_doubt_committed,
            events=counts.get("events", 0), lost=counts.get("lost", 0), duplicated=counts.get("duplicated", 0),
            rows_missing=counts.get("rows_missing", 0), rows_extra=counts.get("rows_extra", 0),
            rows_differ=counts.get("rows_differ", 0), unexpected=counts.get("unexpected", 0),
            invalid=counts.get("invalid", 0), superseded_faults=self.superseded,
            recovery_s={s: {"n": len(t), "p50": round(statistics.median(t), 2), "max": round(max(t), 2)}
                        for s, t in sorted(self.recoveries.items())},
            restarts={s.name: s.restarts for s in services},
            unexpected_exits={s.name: s.unexpected_exits for s in services},
            warehouse_loads=None if self.warehouse is None else {
                "ok": self.warehouse.successes, "killed": self.warehouse.killed, "failed": self.warehouse.failures},
            quiet_s=round(quiet_s, 1), milestones=writer.record.milestones,
            violations=self.violations, logs=str(self.workdir / "logs"),
        )


async def wait_value(get: Callable[[], Awaitable[Any]], timeout_s: float = RECOVERY_TIMEOUT_S) -> Any:
    """The first non-None answer of ``get()`` (the service may be down right now)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            value = await get()
            if value is not None:
                return value
        await asyncio.sleep(0.5)
    raise TimeoutError(f"no answer from {get} in {timeout_s:.0f} s")


async def _leader_or_none(probe: Probe, partition: int) -> int | None:
    with contextlib.suppress(Exception):
        return await asyncio.wait_for(probe.leader(partition), 20)
    return None


def _reap_and_restart(node: Any) -> None:
    from walbus.app.dev.processes import _reap

    if node.pid is not None:
        _reap(node.pid)
    node.launch()
    node.wait_ready(120)


async def read_topic(bootstrap: str, topic: str, timeout_s: float = 300.0) -> list[tuple[int, bytes | None, bytes | None]]:
    """Every record of ``topic`` up to its end (read_committed): (partition, key, value)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                                isolation_level="read_committed", auto_offset_reset="earliest",
                                max_partition_fetch_bytes=8 * 1024 * 1024, fetch_max_bytes=32 * 1024 * 1024)
    await consumer.start()
    try:
        parts = consumer.partitions_for_topic(topic) or set()
        if not parts:
            await consumer._client.force_metadata_update()
            parts = consumer.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        if not tps:
            return []
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        end = await consumer.end_offsets(tps)
        out: list[tuple[int, bytes | None, bytes | None]] = []
        todo = {tp for tp in tps if end[tp] > 0}
        deadline = time.monotonic() + timeout_s
        while todo and time.monotonic() < deadline:
            batch = await consumer.getmany(*todo, timeout_ms=500, max_records=20000)
            for tp, messages in batch.items():
                out += [(tp.partition, m.key, m.value) for m in messages if m.offset < end[tp]]
            for tp in list(todo):
                if await consumer.position(tp) >= end[tp]:
                    todo.discard(tp)
        if todo:
            raise TimeoutError(f"reading {topic}: the end offsets {end} were not reached in {timeout_s:.0f} s")
        return out
    finally:
        await consumer.stop()


def pg_primary_key(dsn: str, table: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)"
            " WHERE i.indrelid = %s::regclass AND i.indisprimary ORDER BY array_position(i.indkey, a.attnum)",
            (table,),
        ).fetchall()
    return [str(r[0]) for r in rows]


def pg_rows(dsn: str, table: str) -> dict[tuple[Any, ...], dict[str, Any]]:
    """SELECT * of ``table``, by primary key."""
    pk = pg_primary_key(dsn, table)
    with psycopg.connect(dsn) as conn, conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        rows = cur.execute(f"SELECT * FROM {table}".encode()).fetchall()
    return {tuple(r[c] for c in pk): dict(r) for r in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=15.0, help="how long the writer and the faults run")
    parser.add_argument("--faults", type=int, default=50, help="at least this many faults")
    parser.add_argument("--brokers", type=int, choices=[1, 3], default=3, help="Kafka nodes of the soak's own stack")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-warehouse", action="store_true", help="leave out the warehouse loads and their check")
    parser.add_argument("--warehouse-every", type=float, default=240.0, help="seconds between warehouse loads")
    parser.add_argument("--large-rows", type=int, default=20000, help="rows of the one large transaction")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="walbus-soak-"))
    os.chmod(workdir, 0o755)  # PostgreSQL runs as 'postgres' when we are root
    code = 1
    with stack_for(args.brokers, workdir) as stack:
        soak = Soak(args, stack, workdir)
        emit(soak=soak.run, topic=soak.topic, brokers=args.brokers if stack.owned else None,
             own_stack=stack.owned is not None, workdir=str(workdir))
        with scratch_database(stack.maintenance_dsn, soak.database) as db_dsn, \
                scratch_database(stack.maintenance_dsn, soak.database + "_effects") as effects_dsn:
            try:
                code = asyncio.run(soak.main(db_dsn, effects_dsn))
            finally:
                if stack.owned is None:
                    asyncio.run(delete_topics_matching(stack.bootstrap, lambda t: soak.database in t))
    if code == 0:
        shutil.rmtree(workdir, ignore_errors=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
