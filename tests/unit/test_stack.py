"""The local stack's pure logic: versions, records, cluster ids, replication defaults (no services)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from walbus.app.dev.kafka import KAFKA_3_VERSION, KAFKA_VERSION, major, new_cluster_id
from walbus.app.dev.processes import StackError
from walbus.app.dev.stack import LocalStack
from walbus.kafka import default_replication_factor, replication_configs


def test_the_default_kafka_is_4x() -> None:
    assert major(KAFKA_VERSION) >= 4
    assert major(KAFKA_3_VERSION) == 3


def test_a_new_stack_records_its_version_and_nodes(tmp_path: Path) -> None:
    stack = LocalStack.load(tmp_path, brokers=3, kafka_version=KAFKA_3_VERSION)
    stack.save()
    again = LocalStack.load(tmp_path)
    assert again.kafka.version == KAFKA_3_VERSION
    assert [n.node_id for n in again.kafka.nodes] == [1, 2, 3]
    assert again.kafka.bootstrap == stack.kafka.bootstrap and again.kafka.bootstrap.count(",") == 2
    # Every node is a voter of the same 3-node quorum.
    assert {n.voters for n in again.kafka.nodes} == {stack.kafka.nodes[0].voters}
    assert stack.kafka.nodes[0].voters.count("@") == 3
    assert len({n.home for n in again.kafka.nodes}) == 3


def test_a_recorded_stack_keeps_its_version_and_size(tmp_path: Path) -> None:
    LocalStack.load(tmp_path).save()
    with pytest.raises(StackError, match="down --purge"):
        LocalStack.load(tmp_path, kafka_version=KAFKA_3_VERSION)
    with pytest.raises(StackError, match="down --purge"):
        LocalStack.load(tmp_path, brokers=3)
    assert LocalStack.load(tmp_path, kafka_version=KAFKA_VERSION, brokers=1).kafka.version == KAFKA_VERSION


def test_a_record_from_before_4x_is_a_3_9_stack(tmp_path: Path) -> None:
    (tmp_path / "stack.json").write_text(json.dumps({
        "postgres": {"port": 5999, "pid": None},
        "kafka": {"port": 6001, "controller_port": 6002, "pid": None, "bootstrap": "127.0.0.1:6001"},
    }))
    stack = LocalStack.load(tmp_path)
    assert stack.kafka.version == KAFKA_3_VERSION
    assert stack.kafka.bootstrap == "127.0.0.1:6001"
    assert stack.kafka.nodes[0].home == tmp_path.resolve() / "kafka"


def test_other_broker_counts_are_refused(tmp_path: Path) -> None:
    with pytest.raises(StackError, match="--brokers"):
        LocalStack.load(tmp_path, brokers=2)


def test_cluster_ids_never_look_like_options() -> None:
    # A base64 id starts with '-' one time in 64; the storage tool then refused to format.
    assert not any(new_cluster_id().startswith("-") for _ in range(5000))


def test_replication_defaults_follow_the_cluster_size() -> None:
    assert [default_replication_factor(n) for n in (1, 2, 3, 5)] == [1, 1, 3, 3]
    assert replication_configs(1) == ()
    assert replication_configs(3) == (("min.insync.replicas", "2"),)


def test_free_ports_are_outside_the_ephemeral_range_and_handed_out_once() -> None:
    """A port from the ephemeral range can be taken by any outgoing connection before the
    service meant to listen binds it (a demux's metrics port: 'Address already in use')."""
    from walbus.app.dev.processes import _ephemeral_range, free_port

    low, high = _ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(not low <= p <= high for p in ports)
