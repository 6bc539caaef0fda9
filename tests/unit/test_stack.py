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


def _java_properties(text: str) -> dict[str, str]:
    """What java.util.Properties.load reads from a file: ISO-8859-1, then \\uXXXX escapes."""
    out = {}
    for line in text.encode("latin-1").decode("latin-1").splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            value = value.strip().encode("latin-1").decode("unicode_escape")
            out[key.strip()] = value.encode("utf-16", "surrogatepass").decode("utf-16")
    return out


def test_kafka_config_files_name_a_non_ascii_state_dir_as_java_reads_them(tmp_path: Path) -> None:
    """Written as UTF-8, Java read "ü" as "Ã¼": Kafka's data and log went to a sibling directory,
    and the next `up` failed ("Invalid cluster.id")."""
    from walbus.app.dev.kafka import KafkaInstance

    node = KafkaInstance(tmp_path / "stäte ü 😀 \\ x", 9092, 9093)
    node.write_config()
    server = _java_properties((node.home / "server.properties").read_bytes().decode("ascii"))
    assert server["log.dirs"] == str(node.datadir)
    log4j2 = _java_properties((node.home / "log4j2.properties").read_bytes().decode("ascii"))
    assert log4j2["appender.file.fileName"] == str(node.logfile)
    log4j = _java_properties((node.home / "log4j.properties").read_bytes().decode("ascii"))
    assert log4j["log4j.appender.file.File"] == str(node.logfile)


def test_kafka_versions_are_plain_dotted_numbers(tmp_path: Path) -> None:
    from walbus.app.dev.kafka import cache_dir

    for bad in ("../../etc", "4.4.0/../x", "4", "latest", "4.4.0-SNAPSHOT", ""):
        with pytest.raises(StackError, match="not a version number"):
            LocalStack.load(tmp_path, kafka_version=bad)
        with pytest.raises(StackError, match="not a version number"):
            cache_dir(bad)
    assert cache_dir("3.9.1").name == "kafka-3.9.1"


def test_a_version_maven_cannot_fetch_leaves_no_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A mistyped --kafka-version was checked only after PostgreSQL had been set up and started,
    and recorded in stack.json: every later `up` failed. Maven's answer came with colour codes."""
    import os
    import stat
    import subprocess

    from walbus.app.cli import main as walbus

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    mvn = bin_dir / "mvn"  # Maven Central's answer for a version it does not have, without the network
    mvn.write_text('#!/bin/sh\nprintf "\\033[0m\\033[1;31m[ERROR]\\033[m"; echo " Could not resolve org.apache.kafka:kafka_2.13:jar:9.9.9 ($*)"\nexit 1\n')
    mvn.chmod(mvn.stat().st_mode | stat.S_IXUSR)
    java = subprocess.run(["sh", "-c", "command -v java"], capture_output=True, text=True).stdout.strip()
    if java:
        (bin_dir / "java").symlink_to(java)
    else:
        pytest.skip("no java")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("WALBUS_CACHE_DIR", str(tmp_path / "cache"))
    state = tmp_path / "state"
    assert walbus(["dev", "up", "--state-dir", str(state), "--kafka-version", "9.9.9"]) == 2
    assert not state.exists()
    assert not (tmp_path / "cache" / "kafka-9.9.9").exists()
    err = capsys.readouterr().err
    assert "Maven could not fetch Apache Kafka 9.9.9" in err and "[ERROR] Could not resolve" in err and "\x1b" not in err


def test_kafka_exiting_at_start_shows_the_jvm_output(tmp_path: Path) -> None:
    """The JVM's own start errors (a bad heap option) go to stdout.log; only server.log was shown."""
    import subprocess

    from walbus.app.dev.kafka import KafkaInstance

    node = KafkaInstance(tmp_path, 9092, 9093)
    node.home.mkdir()
    node.stdout_log.write_text("Error occurred during initialization of VM\nToo small maximum heap\n")
    node._proc = subprocess.Popen(["false"])
    node._proc.wait()
    with pytest.raises(StackError, match=r"(?s)stdout\.log.*Too small maximum heap"):
        node.wait_ready(5)
