"""The benchmarks still run and still print what their readers parse (tiny sizes, no timing).

Speed targets live in bench/, never in a test; this only keeps the benchmarks from
rotting between the sessions that run them in full: each one runs on the test
session's services and must print its machine-readable lines with their fields.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import orjson
import pytest

from tests.support.pipeline import ROOT
from tests.support.services import Services

pytestmark = [pytest.mark.integration]


def run_bench(services: Services, module: str, *args: str) -> list[dict[str, Any]]:
    env = {**os.environ, "WALBUS_PG_DSN": services.pg_dsn, "WALBUS_KAFKA_BOOTSTRAP": services.kafka_bootstrap}
    res = subprocess.run([sys.executable, "-m", f"bench.{module}", *args], capture_output=True, timeout=900,
                         cwd=ROOT, env=env)
    assert res.returncode == 0, (res.stdout[-3000:] + res.stderr[-3000:]).decode(errors="replace")
    lines = [orjson.loads(line) for line in res.stdout.splitlines() if line.startswith(b"{")]
    # Results only: the services' structured logs (they carry "ts") are not results.
    return [line for line in lines if "ts" not in line]


def _kafka_topics(services: Services) -> set[str]:
    import asyncio

    from bench.common import list_topics

    return asyncio.run(list_topics(services.kafka_bootstrap))


@pytest.mark.parametrize("partitions", [1, 2])
def test_demux_benchmark(services: Services, partitions: int) -> None:
    before = _kafka_topics(services)
    events = 3000 * partitions
    out = run_bench(services, "demux", "--kafka-bootstrap", services.kafka_bootstrap, "--pg-dsn", services.pg_dsn,
                    "--events", str(events), "--rounds", "1", "--partitions", str(partitions),
                    "--profile-events", "1000" if partitions == 1 else "0")
    phases = {line["phase"]: line for line in out}
    assert set(phases) == ({"producer", "demux", "summary", "profile"} if partitions == 1
                           else {"producer", "demux", "summary"})
    producer, demux, summary = phases["producer"], phases["demux"], phases["summary"]
    assert producer["events"] == events and producer["records_per_s"] > 0
    assert {"cpu_s", "walsender_cpu_s", "startup_s", "settle_s", "settle_busy_share"} <= set(producer)
    assert {"settle_s", "settle_busy_share"} <= set(demux)
    if partitions == 1:
        assert demux["events"] == events and demux["cpu_s"] > 0 and demux["transactions"] >= 1
        stages = {s["stage"] for s in phases["profile"]["time_by_stage"]}
        assert any(s.startswith("re-keying") for s in stages)
    else:
        # Events committed before the group settled on one partition each are not counted
        # (on a topic this small, possibly all of them).
        assert demux["processes"] == 2 and 0 <= demux["events"] <= events
    assert summary["ratios"] == [pytest.approx(summary["ratio_median"], abs=1e-3)]
    assert isinstance(summary["target_met"], bool)
    assert {"producer", "producer_and_walsender"} <= set(summary["cpu_us_per_event_median"])
    # A benchmark deletes the topics it wrote (gigabytes at full size).
    assert not {t for t in _kafka_topics(services) - before if t.startswith("bench")}


def test_producer_benchmark(services: Services) -> None:
    out = run_bench(services, "producer", "--rows", "2000", "--txns", "10", "--plugins", "pgoutput",
                    "--latency-rate", "200", "--latency-seconds", "2", "--big-rows", "2000", "--warmup-rows", "500")
    kinds = [line["kind"] for line in out]
    assert {"warmup", "load", "throughput", "latency", "rss"} <= set(kinds) and kinds[0] == "warmup"
    for line in out:
        if line["kind"] == "throughput":
            assert line["producer_rows_per_s"] > 0 and line["ratio_to_recvlogical"] > 0
            assert 0 <= line["producer_steal_pct"] <= 100 and 0 <= line["recvlogical_steal_pct"] <= 100
        if line["kind"] == "latency":
            assert line["events"] > 0 and line["p50_ms"] <= line["p99_ms"] <= line["max_ms"]


def test_snapshot_benchmark(services: Services) -> None:
    out = run_bench(services, "snapshot", "--rows", "2000")
    snaps = [line for line in out if line["kind"] == "snapshot"]
    assert {line["workers"] for line in snaps} == {1, 2}
    assert all(line["rows"] == 2000 and line["rows_per_s"] > 0 for line in snaps)
    assert any(line["kind"] == "copy_ceiling" for line in out)


@pytest.mark.spark
def test_warehouse_benchmark(services: Services) -> None:
    out = run_bench(
        services, "warehouse", "--events", "2000", "--incremental", "200", "--skip-wide", "--tables", "1,2",
        "--tables-events", "40", "--rounds", "3", "--cold", "1",
    )
    lines = [line for line in out if "workload" in line]
    assert [line["workload"] for line in lines] == [
        "warmup", "transactions", "cold-transactions", *["tables"] * 7, "incremental", "incremental"]
    # each job as a nightly job of its own: a new process and JVM, the whole topic loaded
    cold = lines.pop(2)
    assert cold["order"] == ["walbus", "naive"] and cold["events"] == 2000
    assert len(cold["walbus_s"]) == len(cold["naive_s"]) == 1
    assert cold["speedup"] == round(cold["naive_s"][0] / cold["walbus_s"][0], 2)
    assert lines[0]["walbus"]["history_rows_added"] == lines[0]["baseline"]["events"] > 0
    loads = lines[1:]
    assert loads[0]["walbus"]["history_rows_added"] == 2000
    assert loads[0]["baseline"]["events"] == 2000
    # each job once a round, in mirrored order, each run loading the whole topic into its own
    # warehouse; the steady ratio leaves each job's first run out
    assert loads[0]["order"] == ["walbus", "naive", "naive", "walbus", "walbus", "naive"]
    assert loads[0]["walbus"]["events_each"] == loads[0]["baseline"]["events_each"] == [2000, 2000, 2000]
    walbus_s, naive_s = loads[0]["walbus"]["seconds_each"], loads[0]["baseline"]["seconds_each"]
    assert loads[0]["speedup_steady"] == round((sum(naive_s[1:]) / 2) / (sum(walbus_s[1:]) / 2), 2)
    assert lines[0]["order"] == ["walbus", "naive"] and "speedup_steady" not in lines[0]
    # each table count: a first load, then a second one into the same tables, then inserts only
    sweep = loads[1:7]
    assert [(line.get("tables"), line.get("load")) for line in sweep] == [
        (t, load) for t in (1, 2) for load in ("first", "second", "inserts")]
    assert all(line["events"] == 40 for line in sweep)
    # the later loads' events are new ones; the inserts-only load's are all new rows
    assert all(line["history_rows_added"] == 40 for line in sweep)
    assert [line["current_inserted"] for line in sweep if line["load"] == "inserts"] == [40, 40]
    # the naive many-tables job and Delta's floor ran on each load's slice, and only on it
    assert all(line["naive_rows"] == 40 and line["delta_floor_s"] > 0 for line in sweep)
    summary = loads[7]
    assert {"seconds_per_extra_table", "seconds_per_extra_table_second_load", "seconds_per_extra_table_inserts"} <= set(summary)
    assert len(summary["naive"]) == len(summary["delta_floor"]) == 3
    assert all(line["history_rows_added"] == 200 for line in loads[8:])


def test_the_producer_benchmark_stops_when_its_client_dies(services: Services, unique_name: str) -> None:
    """bench.producer.measure of a producer (until the slot confirms the end) gives up with an
    error once the client has died: it used to wait for the slot forever (a producer that
    crashed stalled the whole benchmark)."""
    import threading

    import psycopg

    from bench.producer import measure

    slot = unique_name[-63:].lower()
    with psycopg.connect(services.pg_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'wal2json')", (slot,))
    client = subprocess.Popen(["pg_recvlogical", "-d", services.pg_dsn, "--slot", slot, "--start", "-f", "/dev/null", "--no-loop"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            measure(client, services.pg_dsn, slot, 1 << 62, None, until_exit=False)  # an end it never reaches
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    waiting = threading.Thread(target=run, daemon=True)
    waiting.start()
    try:
        waiting.join(3)  # streaming by now: measure is in its sampling loop
        client.kill()
        client.wait(30)
        waiting.join(60)
        assert outcome, "measure still waits for the slot of a client that died"
        assert isinstance(outcome[0], RuntimeError) and "before the slot confirmed" in str(outcome[0]), outcome
    finally:
        client.kill()
        with psycopg.connect(services.pg_dsn, autocommit=True) as conn:
            for _ in range(50):  # the walsender lets go of the slot a moment after its client died
                if conn.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone() == (False,):
                    break
                time.sleep(0.1)
            conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
