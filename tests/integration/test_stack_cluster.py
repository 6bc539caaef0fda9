"""`walbus dev up --brokers 3`: a replicated cluster, and walbus's topics replicated on it.

The module brings up its own 3-node stack (each node broker and controller) with the CLI,
in a temporary state directory, and takes it down at the end.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cluster import three_node_cluster
from tests.support.stack import producer_demux_roundtrip
from walbus.kafka import KafkaAdmin, TopicSpec

pytestmark = pytest.mark.integration


def test_stopping_the_cluster_shuts_every_node_down_cleanly() -> None:
    """`walbus dev down` on 3 nodes: none is killed. Stopped one after the other, the last node's
    controlled shutdown waited for a controller quorum the first two had taken away, until
    SIGKILL 60 s later. (First in the module: its cluster is not up next to the module's.)"""
    with three_node_cluster() as cluster:
        nodes = cluster.kafka.nodes
    codes = [n._proc.returncode if n._proc is not None else None for n in nodes]
    assert None not in codes, codes
    assert -signal.SIGKILL not in codes, f"exit codes {codes}: a node was killed instead of shut down"


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """The 3-node stack's bootstrap list."""
    state = Path(tempfile.mkdtemp(prefix="walbus-cluster-"))
    walbus = [sys.executable, "-m", "walbus.app.cli", "dev", "--state-dir", str(state)]
    try:
        up = subprocess.run([*walbus, "up", "--brokers", "3"], capture_output=True, text=True, timeout=300)
        assert up.returncode == 0, up.stdout + up.stderr
        status = json.loads(subprocess.run([*walbus, "status"], capture_output=True, text=True, timeout=60).stdout)
        nodes = status["kafka"]["nodes"]
        assert [n["running"] for n in nodes] == [True, True, True]
        assert status["kafka"]["bootstrap"] == ",".join(n["bootstrap"] for n in nodes)
        yield status["kafka"]["bootstrap"]
    finally:
        subprocess.run([*walbus, "down", "--purge"], capture_output=True, text=True, timeout=300)
        shutil.rmtree(state, ignore_errors=True)


async def _replicas(bootstrap: str, topic: str) -> tuple[set[int], str | None]:
    """(replica count of each partition, min.insync.replicas) of a topic."""
    async with KafkaAdmin(client_kwargs={"bootstrap_servers": bootstrap}) as admin:
        desc = await admin._admin.describe_topics([topic])
        counts = {len(p["replicas"]) for t in desc if t["topic"] == topic for p in t["partitions"]}
        return counts, (await admin.topic_config(topic, ["min.insync.replicas"])).get("min.insync.replicas")


async def test_every_node_is_a_broker(cluster: str) -> None:
    async with KafkaAdmin(client_kwargs={"bootstrap_servers": cluster}) as admin:
        assert await admin.broker_count() == 3
    # Each address alone is a working bootstrap too.
    for address in cluster.split(","):
        async with KafkaAdmin(client_kwargs={"bootstrap_servers": address}) as admin:
            assert await admin.broker_count() == 3


async def test_services_on_the_cluster_replicate_their_topics(
    pg_dsn: str, cluster: str, unique_name: str, tmp_path: Path
) -> None:
    source = f"walbus.{unique_name}"
    table_topic = await producer_demux_roundtrip(
        pg_dsn, cluster, source, tmp_path, junk=True, transaction_metadata=True
    )
    for topic in (source, f"{source}.progress", f"{source}.transaction", table_topic, f"{source}.dlq"):
        assert await _replicas(cluster, topic) == ({3}, "2"), topic
    # The demux's offsets and transactions: Kafka's internal topics, replicated by the stack.
    for internal in ("__consumer_offsets", "__transaction_state"):
        assert (await _replicas(cluster, internal))[0] == {3}, internal


async def test_an_explicit_replication_factor_wins(cluster: str, unique_name: str) -> None:
    async with KafkaAdmin(client_kwargs={"bootstrap_servers": cluster}) as admin:
        await admin.ensure_topic(TopicSpec(unique_name, replication_factor=2))
        await admin.ensure_topic(TopicSpec(f"{unique_name}.own", configs=(("min.insync.replicas", "3"),)))
    assert (await _replicas(cluster, unique_name))[0] == {2}
    assert await _replicas(cluster, f"{unique_name}.own") == ({3}, "3")
