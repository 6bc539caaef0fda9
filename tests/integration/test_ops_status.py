"""`walbus status` against the real PostgreSQL and Kafka: slot lag from pg_replication_slots,
topic end offsets, a group's lag, the warehouse's last load; --json and the exporter."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import psycopg
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import OffsetAndMetadata
from prometheus_client.parser import text_string_to_metric_families

from tests.support.kafka import create_topic, produce
from tests.support.pipeline import ROOT, walbus_process
from walbus.app.dev.processes import free_port
from walbus.status import StatusSources, gather

pytestmark = pytest.mark.integration


def database_of(dsn: str) -> str:
    return str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])


async def commit(bootstrap: str, group: str, topic: str, offset: int) -> None:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign([TopicPartition(topic, 0)])
        await consumer.commit({TopicPartition(topic, 0): OffsetAndMetadata(offset, "")})
    finally:
        await consumer.stop()


def write_load(warehouse: Path, topic_segment: str, end: int) -> None:
    loads = warehouse / topic_segment / "_walbus_loads"
    loads.mkdir(parents=True)
    doc = {"batch_id": 0, "status": "committed", "start": {"0": 0}, "end": {"0": end}, "at": "2026-01-01T00:00:00+00:00"}
    (loads / f"{0:020d}.committed.json").write_text(json.dumps(doc))


@pytest.fixture()
async def scene(pg_dsn: str, kafka_bootstrap: str, unique_name: str, tmp_path: Path) -> dict[str, str]:
    """A slot nobody reads, the database topic with 5 records and a table topic, a group that
    committed 2 of them, a warehouse that loaded 4."""
    slot = f"{unique_name}_slot"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    topic = f"walbus.{database_of(pg_dsn)}"
    await create_topic(kafka_bootstrap, topic)
    await create_topic(kafka_bootstrap, f"{topic}.public.t")
    await create_topic(kafka_bootstrap, f"{topic}.dlq")
    await produce(kafka_bootstrap, topic, [(b"k%d" % i, b"v") for i in range(5)], partition=0)
    await commit(kafka_bootstrap, f"{unique_name}_feed", topic, 2)
    write_load(tmp_path / "wh", topic.replace(".", "~2E"), 4)
    return {"slot": slot, "topic": topic, "group": f"{unique_name}_feed", "warehouse": str(tmp_path / "wh")}


def slot_lag(status_slots: list[dict[str, object]], slot: str) -> int:
    (entry,) = [s for s in status_slots if s["slot"] == slot]
    lag = entry["lag_bytes"]
    assert isinstance(lag, int)
    return lag


def status_json(pg_dsn: str, bootstrap: str, scene: dict[str, str]) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-m", "walbus.app.cli", "status", "--pg-dsn", pg_dsn, "--kafka-bootstrap", bootstrap,
         "--slot", scene["slot"], "--warehouse", scene["warehouse"], "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert isinstance(doc, dict)
    return doc


async def test_status_shows_where_the_data_is(pg_dsn: str, kafka_bootstrap: str, scene: dict[str, str]) -> None:
    doc = status_json(pg_dsn, kafka_bootstrap, scene)
    slots = doc["slots"]
    assert isinstance(slots, list) and [s["slot"] for s in slots] == [scene["slot"]]
    assert slots[0]["active"] is False and slots[0]["wal_status"] == "reserved"
    before = slot_lag(slots, scene["slot"])
    topics = {t["topic"]: t for t in doc["topics"]}  # type: ignore[attr-defined]
    topic = scene["topic"]
    assert topics[topic]["kind"] == "database" and topics[topic]["records"] == 5
    assert topics[f"{topic}.public.t"]["kind"] == "table" and topics[f"{topic}.dlq"]["kind"] == "side"
    groups = [g for g in doc["groups"] if g["group"] == scene["group"]]  # type: ignore[attr-defined]
    assert [(g["topic"], g["lag_records"]) for g in groups] == [(topic, 3)]
    assert [(p["partition"], p["committed"], p["end"]) for p in groups[0]["partitions"]] == [(0, 2, 5)]
    assert groups[0]["lag_seconds"] >= 0
    assert doc["warehouse"]["batch_id"] == 0 and doc["warehouse_lag"] == 1  # type: ignore[index]
    assert doc["errors"] == {}

    # Measured on the server: the lag grows with every write while nobody reads the slot.
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO t SELECT g, repeat('x', 100) FROM generate_series(1, 2000) g")
    status = await gather(StatusSources(pg_dsn=pg_dsn, slot=scene["slot"]))
    assert status.slots[0].lag_bytes is not None and status.slots[0].lag_bytes > before + 200_000


async def test_an_unreachable_part_is_named_not_raised(kafka_bootstrap: str, scene: dict[str, str]) -> None:
    dead = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    status = await gather(StatusSources(pg_dsn=dead, kafka_client_kwargs={"bootstrap_servers": kafka_bootstrap},
                                        topic=scene["topic"]))
    assert "postgres" in status.errors and "kafka" not in status.errors
    assert [t.records for t in status.topics if t.kind == "database"] == [5]


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


async def test_the_exporter_serves_the_status(pg_dsn: str, kafka_bootstrap: str, scene: dict[str, str], tmp_path: Path) -> None:
    port = free_port()
    proc = walbus_process(
        ["status", "--pg-dsn", pg_dsn, "--kafka-bootstrap", kafka_bootstrap, "--slot", scene["slot"],
         "--warehouse", scene["warehouse"], "--metrics-port", str(port)], log=tmp_path / "status.log",
    )
    try:
        from tests.integration.test_ops_prometheus import wait_http

        wait_http(f"http://127.0.0.1:{port}/healthz", proc, tmp_path / "status.log")
        got = scrape(port)
        slot = scene["slot"]
        assert got[f"walbus_slot_active{{slot={slot}}}"] == 0
        assert got[f"walbus_slot_wal_status{{slot={slot},wal_status=reserved}}"] == 1
        assert got[f"walbus_topic_end_offset{{kind=database,topic={scene['topic']}}}"] == 5
        assert got[f"walbus_consumer_group_lag{{group={scene['group']},topic={scene['topic']}}}"] == 3
        assert got["walbus_warehouse_lag_records{}"] == 1
        assert got["walbus_status_read_errors{part=postgres}"] == 0
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def run_status(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "walbus.app.cli", "status", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_a_slot_or_topic_that_is_not_there_is_said_with_exit_3(pg_dsn: str, kafka_bootstrap: str, scene: dict[str, str],
                                                               unique_name: str) -> None:
    # A typo in --slot or a producer that never ran printed "(none)" and exited 0.
    done = run_status(["--pg-dsn", pg_dsn, "--slot", f"{unique_name}_nope", "--kafka-bootstrap", kafka_bootstrap,
                       "--topic", f"{scene['topic']}_nope"])
    assert done.returncode == 3, done.stdout + done.stderr
    assert f"not found: no logical replication slot named '{unique_name}_nope'" in done.stdout
    assert f"not found: no topic named '{scene['topic']}_nope'" in done.stdout
    done = run_status(["--pg-dsn", pg_dsn, "--slot", scene["slot"], "--kafka-bootstrap", kafka_bootstrap, "--json"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["missing"] == {}


def test_an_unreachable_kafka_is_one_message(scene: dict[str, str]) -> None:
    done = run_status(["--kafka-bootstrap", f"127.0.0.1:{free_port()}", "--topic", scene["topic"]])
    assert done.returncode == 1, done.stdout + done.stderr
    assert "could not read kafka: KafkaConnectionError" in done.stdout
    assert "KafkaConnectionError: KafkaConnectionError" not in done.stdout  # the type said once
    assert "Unclosed" not in done.stderr, done.stderr


def test_a_broker_that_refuses_status_is_said_why(kafka_bootstrap: str, scene: dict[str, str], tmp_path: Path) -> None:
    """A wrong --kafka-security-protocol: every other command exits 2 with the reason; status
    said "KafkaConnectionError: KafkaConnectionError: Unable to bootstrap" (exit 1), and its
    exporter only set walbus_status_read_errors."""
    wrong = ["--kafka-bootstrap", kafka_bootstrap, "--topic", scene["topic"], "--kafka-security-protocol", "SSL"]
    done = run_status(wrong)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "could not read kafka: Kafka at " in done.stdout and "speaks Kafka without TLS" in done.stdout, done.stdout
    port = free_port()
    log = tmp_path / "status.log"
    proc = walbus_process(["status", *wrong, "--metrics-port", str(port)], log=log)
    try:
        from tests.integration.test_ops_prometheus import wait_http

        wait_http(f"http://127.0.0.1:{port}/healthz", proc, log)
        for _ in range(2):
            assert scrape(port)["walbus_status_read_errors{part=kafka}"] == 1
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    said = [json.loads(line)["msg"] for line in log.read_text().splitlines() if "could not read" in line]
    assert len(said) == 1 and "speaks Kafka without TLS" in said[0], said  # once, not every scrape
