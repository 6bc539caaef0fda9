"""A private 3-node Kafka cluster (each node broker and controller) and broker faults on it.

Reusable outside pytest (the soak): :func:`three_node_cluster` is a plain context manager
and :class:`Cluster` has the fault helpers; the ``kafka_cluster`` fixture wraps them for a
test module. The nodes are walbus's own local-stack nodes (``walbus.app.dev.kafka``) in a
temporary state directory; PostgreSQL stays whatever the tests already use.

Starting a node waits for it with ``asyncio.run`` (``KafkaInstance.wait_ready``): from a
coroutine, call the sync helpers through ``asyncio.to_thread``, or use the ``a*`` ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiokafka.errors import KafkaError

from walbus.app.dev.kafka import KafkaCluster, KafkaInstance
from walbus.app.dev.processes import free_port, stop_pid
from walbus.kafka import KafkaAdmin

NODES = 3

# Each fault and recovery, with its time: what a failing run's captured log shows.
log = logging.getLogger("tests.support.cluster")


@dataclass(frozen=True)
class PartitionState:
    leader: int  # node id; -1 while there is none
    replicas: tuple[int, ...]
    isr: tuple[int, ...]


@dataclass
class Cluster:
    kafka: KafkaCluster

    @property
    def bootstrap(self) -> str:
        return self.kafka.bootstrap

    def node(self, node_id: int) -> KafkaInstance:
        return self.kafka.nodes[node_id - 1]

    def running(self, node_id: int) -> bool:
        return self.node(node_id).running()

    def kill9(self, node_id: int) -> None:
        """SIGKILL the node's JVM and reap it: a crash, no controlled shutdown."""
        node = self.node(node_id)
        assert node.pid is not None and node.running(), f"kafka node {node_id} is not running"
        log.info("kill -9 of kafka node %d (pid %d)", node_id, node.pid)
        stop_pid(node.pid, node.marker, sig=signal.SIGKILL, timeout=30)
        node.pid = None

    def stop(self, node_id: int) -> None:
        """SIGTERM: a controlled shutdown (leadership handed over first), waited for."""
        node = self.node(node_id)
        assert node.running(), f"kafka node {node_id} is not running"
        log.info("stopping kafka node %d", node_id)
        node.stop()
        node.pid = None
        log.info("kafka node %d stopped", node_id)

    def start(self, node_id: int, timeout: float = 120.0) -> None:
        """Start a stopped node on its old data and ports; returns once it answers metadata requests."""
        log.info("starting kafka node %d", node_id)
        self.node(node_id).start(timeout)
        log.info("kafka node %d answers", node_id)

    async def akill9(self, node_id: int) -> None:
        await asyncio.to_thread(self.kill9, node_id)

    async def astop(self, node_id: int) -> None:
        await asyncio.to_thread(self.stop, node_id)

    async def astart(self, node_id: int, timeout: float = 120.0) -> None:
        await asyncio.to_thread(self.start, node_id, timeout)

    async def _describe(self, topics: list[str] | None) -> list[dict[str, Any]]:
        async with KafkaAdmin(client_kwargs={"bootstrap_servers": self.bootstrap}) as admin:
            names = sorted(await admin.list_topics()) if topics is None else topics
            desc: list[dict[str, Any]] = await admin._admin.describe_topics(names)
            return desc

    async def partitions(
        self, topics: list[str] | None = None, *, within: float = 60.0
    ) -> dict[tuple[str, int], PartitionState]:
        """Leader, replicas and ISR of every partition of ``topics`` (default: every topic, internal ones too).

        Retried for ``within`` seconds: while a node is down, a request sent to it fails.
        """
        deadline = time.monotonic() + within
        while True:
            try:
                desc = await self._describe(topics)
                break
            except (KafkaError, OSError):
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.5)
        out: dict[tuple[str, int], PartitionState] = {}
        for t in desc:
            for p in t["partitions"]:
                out[(t["topic"], p["partition"])] = PartitionState(p["leader"], tuple(p["replicas"]), tuple(p["isr"]))
        return out

    async def leader(self, topic: str, partition: int = 0, *, within: float = 60.0) -> int:
        """The node id leading a partition (waits while it has none)."""
        deadline = time.monotonic() + within
        while True:
            state = (await self.partitions([topic])).get((topic, partition))
            if state is not None and state.leader > 0:
                return state.leader
            assert time.monotonic() < deadline, f"{topic}-{partition} has no leader after {within} s: {state}"
            await asyncio.sleep(0.5)

    async def wait_leader_not(self, topic: str, partition: int, node_id: int, *, within: float = 120.0) -> int:
        """Until another node than ``node_id`` leads the partition (after a crash: the broker's session expired)."""
        deadline = time.monotonic() + within
        while True:
            leader = await self.leader(topic, partition, within=within)
            if leader != node_id:
                log.info("%s-%d: leader moved from node %d to %d", topic, partition, node_id, leader)
                return leader
            assert time.monotonic() < deadline, f"{topic}-{partition} still led by the dead node {node_id}"
            await asyncio.sleep(0.5)

    async def wait_in_sync(self, *, within: float = 180.0) -> None:
        """Until every partition of every topic has all its replicas in sync and a leader."""
        deadline = time.monotonic() + within
        lagging: dict[tuple[str, int], PartitionState] = {}
        error: Exception | None = None
        while time.monotonic() < deadline:
            try:
                states = await self.partitions(within=0)
            except Exception as e:  # a broker that is still starting may fail a request
                error = e
            else:
                error = None
                lagging = {tp: s for tp, s in states.items() if s.leader <= 0 or set(s.isr) != set(s.replicas)}
                if not lagging:  # a fresh cluster has no topics: in sync too
                    log.info("every partition in sync (%d)", len(states))
                    return
            await asyncio.sleep(1.0)
        raise AssertionError(
            f"partitions not back in sync after {within} s: {dict(list(lagging.items())[:5])}, last error {error!r}"
        )


@contextlib.contextmanager
def three_node_cluster(state_dir: Path | None = None) -> Iterator[Cluster]:
    """Three KRaft nodes on free ports in ``state_dir`` (default: a new temporary one, removed at the end)."""
    own = state_dir is None
    state = Path(tempfile.mkdtemp(prefix="walbus-cluster-")) if state_dir is None else state_dir
    kafka = KafkaCluster.create(state, [(free_port(), free_port()) for _ in range(NODES)])
    try:
        kafka.start()
        yield Cluster(kafka)
    finally:
        kafka.stop()
        if own:
            shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="module")
def kafka_cluster() -> Iterator[Cluster]:
    """A 3-node cluster of the test module's own, stopped and removed after its last test."""
    with three_node_cluster() as cluster:
        yield cluster
