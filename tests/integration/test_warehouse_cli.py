"""The `walbus warehouse` command: a load killed with SIGKILL mid-way, rerun -> exact; SQL views."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.warehouse import Txn, produce_events, table_paths
from warehouse import layout

pytestmark = [pytest.mark.spark, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]

TABLES = ["shop.a", "shop.b", "shop.c"]
PER_TABLE = 200


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "walbus.app.cli", "warehouse", *args]


def _stream(tmp_path: Path, kafka_bootstrap: str, topic: str, trigger: str) -> tuple[subprocess.Popen[bytes], int, Path]:
    """``walbus warehouse stream`` of ``topic`` into tmp_path/wh, started in a session of its own
    with its metrics on a free port and in tmp_path/walbus.prom: (process, port, metrics file)."""
    import socket

    with socket.socket() as probe:  # a port nobody listens on now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    metrics = tmp_path / "walbus.prom"
    proc = subprocess.Popen(
        _cli("stream", "--kafka-bootstrap", kafka_bootstrap, "--topic", topic, "--warehouse", str(tmp_path / "wh"),
             "--master", "local[1]", "--spark-conf", "spark.ui.enabled=false", "--trigger", trigger,
             "--metrics-port", str(port), "--metrics-file", str(metrics)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )
    return proc, port, metrics


def _events() -> list[bytes]:
    events: list[bytes] = []
    for n, table in enumerate(TABLES):
        for i in range(0, PER_TABLE, 100):
            txn = Txn(0x10000 * (n + 1) + i * 0x10, xid=n * 1000 + i)
            for k in range(i, i + 100):
                txn.insert(table, ["id"], {"id": ("int4", k), "v": ("text", f"{table}-{k}")})
            events += txn.events
        # every other row updated, every tenth deleted
        upd = Txn(0x10000 * (n + 1) + 0x8000)
        for k in range(0, PER_TABLE, 2):
            upd.update(table, ["id"], {"id": ("int4", k), "v": ("text", f"new-{k}")})
        for k in range(0, PER_TABLE, 10):
            upd.delete(table, ["id"], {"id": ("int4", k)})
        events += upd.events
    return events


def _committed_tables(warehouse: Path, topic: str) -> int:
    """Tables whose history has committed data (Delta version 0: a table's first write creates it)."""
    return sum(
        Path(table_paths(warehouse, topic, t).history, "_delta_log", f"{0:020d}.json").exists()
        for t in TABLES
    )


def test_load_killed_mid_way_then_rerun_is_exact(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    from warehouse.cli import run_sql

    produce_events(kafka_bootstrap, unique_name, _events())
    args = _cli(
        "load", "--kafka-bootstrap", kafka_bootstrap, "--topic", unique_name,
        "--warehouse", str(tmp_path), "--master", "local[2]", "--shuffle-partitions", "2",
        "--spark-conf", "spark.ui.enabled=false",
    )
    # its own session (process group): SIGKILL takes the Python driver and its JVM at once
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while _committed_tables(tmp_path, unique_name) < 1:
            assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
            assert time.monotonic() < deadline, "the load wrote nothing in 240 s"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    loads_dir = Path(layout.loads_path(str(tmp_path), unique_name))
    names = sorted(p.name for p in loads_dir.iterdir() if not p.name.startswith("."))
    assert names == [f"{0:020d}.planned.json"], names  # killed: planned, never committed

    rerun = subprocess.run(args, capture_output=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr.decode()[-3000:]
    lines = rerun.stdout.decode().splitlines()
    assert len(lines) == len(TABLES) and all(line.startswith("shop.") for line in lines), lines

    for table in TABLES:
        base = table.replace(".", "_")
        _, rows = run_sql(
            spark, str(tmp_path), None,
            f"SELECT count(*) AS n, count(DISTINCT pg_commit_lsn, pg_seq) AS d FROM {base}_history", 10,
        )
        assert (rows[0]["n"], rows[0]["d"]) == (PER_TABLE + PER_TABLE // 2 + PER_TABLE // 10,) * 2
        _, live = run_sql(spark, str(tmp_path), None, f"SELECT id, v FROM {base} ORDER BY id", 10000)
        expected = [
            (k, f"new-{k}" if k % 2 == 0 else f"{table}-{k}") for k in range(PER_TABLE) if k % 10 != 0
        ]
        assert [(r["id"], r["v"]) for r in live] == expected
    assert f"{0:020d}.committed.json" in {p.name for p in loads_dir.iterdir()}


def _metrics_file(path: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(path.read_text()) for s in family.samples
    }


def test_load_leaves_the_terminal_and_the_working_directory_clean_and_its_metrics_in_a_file(
    kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    cwd, log, metrics = tmp_path / "cwd", tmp_path / "spark.log", tmp_path / "walbus.prom"
    cwd.mkdir()
    produce_events(kafka_bootstrap, unique_name, Txn(0x1000).insert(TABLES[0], ["id"], {"id": ("int4", 1)}).events)
    # without `walbus warehouse prepare`'s jar list, so that Ivy resolves the jars and prints
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WALBUS_SPARK_LOG": str(log), "WALBUS_SPARK_DRIVER_CACHE": "off"}
    done = subprocess.run(
        _cli("load", "--kafka-bootstrap", kafka_bootstrap, "--topic", unique_name,
             "--warehouse", str(tmp_path / "wh"), "--master", "local[1]", "--spark-conf", "spark.ui.enabled=false",
             "--metrics-file", str(metrics)),
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{TABLES[0]}: 1 events, history +1,"), done.stdout
    assert [line for line in done.stderr.splitlines() if not line.startswith("loaded 1 events in ")] == [], done.stderr
    # Ivy's jar resolution (printed on every start, the cache warm or not) and log4j's lines
    # went to the log file
    spark_log = log.read_text(errors="replace")
    assert ":: resolving dependencies ::" in spark_log and "log4j" in spark_log
    # nothing of Spark's in the working directory (an empty artifacts/ or spark-warehouse/)
    assert os.listdir(cwd) == []
    # the load's metrics, for node_exporter's textfile collector
    samples = _metrics_file(metrics)
    topic = (("topic", unique_name),)
    assert samples[("walbus_warehouse_events_total", (("table", TABLES[0]), *topic))] == 1
    assert samples[("walbus_warehouse_current_rows_total", (("action", "inserted"), ("table", TABLES[0]), *topic))] == 1
    assert samples[("walbus_warehouse_loads_total", topic)] == 1
    assert samples[("walbus_warehouse_load_failures_total", topic)] == 0
    assert samples[("walbus_warehouse_last_success_timestamp_seconds", topic)] > time.time() - 600


def test_cli_reports_failures_clearly(tmp_path: Path, kafka_bootstrap: str, unique_name: str) -> None:
    metrics = tmp_path / "walbus.prom"
    done = subprocess.run(
        _cli("load", "--kafka-bootstrap", kafka_bootstrap, "--topic", unique_name, "--warehouse", str(tmp_path),
             "--master", "local[1]", "--metrics-file", str(metrics)),
        capture_output=True, timeout=300,
    )
    assert done.returncode == 1
    assert f"topic {unique_name!r} does not exist" in done.stderr.decode()
    samples = _metrics_file(metrics)  # the failure is in the metrics file too
    assert samples[("walbus_warehouse_load_failures_total", (("topic", unique_name),))] == 1
    assert samples[("walbus_warehouse_last_success_timestamp_seconds", (("topic", unique_name),))] == 0
    usage = subprocess.run(_cli("load"), capture_output=True, timeout=60)
    assert usage.returncode == 2 and b"--topic" in usage.stderr
    helped = subprocess.run(_cli("load", "--help"), capture_output=True, timeout=60)
    assert helped.returncode == 0 and b"--skip-invalid" in helped.stdout and b"--slice-reader" in helped.stdout
    # stream's offsets are Spark's checkpoint: its slices come from Spark's Kafka source only
    workers = subprocess.run(
        _cli("stream", "--kafka-bootstrap", kafka_bootstrap, "--topic", unique_name, "--warehouse", str(tmp_path),
             "--slice-reader", "workers"),
        capture_output=True, timeout=60,
    )
    assert workers.returncode == 2 and b"--slice-reader workers: stream reads with Spark's Kafka source" in workers.stderr


def test_sql_prints_timestamps_in_utc_in_any_local_zone_and_takes_the_query_anywhere(
    spark: Any, kafka_bootstrap: str, unique_name: str, tmp_path: Path
) -> None:
    # The values were collected as PySpark's naive datetimes of the process's zone: 12:00 UTC
    # printed 08:00 under America/New_York, year 1 failed the command ("year 0 is out of
    # range"); and a query after the options was counted word by word as arguments the
    # command does not take (fuzzes).
    import orjson

    from tests.support.warehouse import kafka_options
    from warehouse.job import LoadSpec, run_load

    table = "public.t"
    rows = Txn(0x1000)
    for key, ts in ((1, "2024-06-01 12:00:00.5+00"), (2, "0001-01-01 00:00:00+00")):
        rows.insert(table, ["id"], {"id": ("int4", key), "ts": ("timestamptz", ts), "tsa": ("_timestamptz", f'{{"{ts}"}}'),
                                    "amount": ("numeric", "12345678901234567890.123")})
    produce_events(kafka_bootstrap, unique_name, rows.events)
    run_load(spark, LoadSpec(kafka_options(kafka_bootstrap), unique_name, str(tmp_path)))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TZ": "America/New_York"}
    done = subprocess.run(
        _cli("sql", "--warehouse", str(tmp_path), "--format", "json", "SELECT id, ts, tsa, amount FROM public_t ORDER BY id"),
        capture_output=True, timeout=300, env=env,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert [orjson.loads(line) for line in done.stdout.decode().splitlines()] == [
        {"id": 1, "ts": "2024-06-01T12:00:00.5Z", "tsa": ["2024-06-01T12:00:00.5Z"], "amount": "12345678901234567890.1230000000"},
        {"id": 2, "ts": "0001-01-01T00:00:00Z", "tsa": ["0001-01-01T00:00:00Z"], "amount": "12345678901234567890.1230000000"},
    ]
    two = subprocess.run(_cli("sql", "--warehouse", str(tmp_path), "SELECT", "1"), capture_output=True, timeout=60, env=env)
    assert two.returncode == 2 and b"the query is one argument, in quotes" in two.stderr, two.stderr


def test_stream_command_serves_health_and_writes_its_metrics(
    tmp_path: Path, kafka_bootstrap: str, unique_name: str
) -> None:
    import urllib.error
    import urllib.request

    txn = Txn(0x2000)
    for k in range(3):
        txn.insert(TABLES[0], ["id"], {"id": ("int4", k)})
    produce_events(kafka_bootstrap, unique_name, txn.events)
    proc, port, metrics = _stream(tmp_path, kafka_bootstrap, unique_name, "available-now")

    def status(path: str) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
                return int(response.status)
        except urllib.error.HTTPError as e:
            return e.code

    seen: set[tuple[str, int]] = set()
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError):  # not listening yet, or closed already
                seen |= {("/healthz", status("/healthz")), ("/readyz", status("/readyz"))}
            time.sleep(0.05)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, err.decode()[-3000:]
    # live from the start; not ready while Spark starts (no query yet)
    assert {("/healthz", 200), ("/readyz", 503)} <= seen, seen
    samples = _metrics_file(metrics)
    topic = (("topic", unique_name),)
    assert samples[("walbus_warehouse_events_total", (("table", TABLES[0]), *topic))] == 3
    assert samples[("walbus_warehouse_loads_total", topic)] >= 1
    assert samples[("walbus_warehouse_load_failures_total", topic)] == 0


def test_stream_says_why_a_micro_batch_failed(tmp_path: Path, kafka_bootstrap: str, unique_name: str) -> None:
    # Spark's error names only the Python traceback that carried a micro-batch's failure: the
    # stream printed "StreamingQueryException: … Traceback (most recent call last):" and no
    # cause, where load says the column and the change (a fuzz).
    def run() -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            _cli("stream", "--kafka-bootstrap", kafka_bootstrap, "--topic", unique_name, "--warehouse", str(tmp_path / "wh"),
                 "--master", "local[1]", "--spark-conf", "spark.ui.enabled=false", "--trigger", "available-now"),
            capture_output=True, timeout=600,
        )

    produce_events(kafka_bootstrap, unique_name, Txn(0x1000).insert(TABLES[0], ["id"], {"id": ("int4", 1), "n": ("int4", 7)}).events)
    first = run()
    assert first.returncode == 0, first.stderr.decode()[-3000:]
    produce_events(kafka_bootstrap, unique_name, Txn(0x2000).insert(TABLES[0], ["id"], {"id": ("int4", 2), "n": ("text", "x")}).events)
    failed = run()
    assert failed.returncode == 1
    last = failed.stderr.decode().strip().splitlines()[-1]
    assert last.startswith("walbus warehouse stream: error: ") and "column 'n' changed type from int4" in last, last


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 0), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_stopped_stream_stops_its_driver_jvm_and_writes_its_metrics(
    tmp_path: Path, kafka_bootstrap: str, unique_name: str, sig: signal.Signals, code: int,
) -> None:
    # Ctrl-C left the driver JVM running, orphaned, for good (seen 68 s and more after the
    # exit); SIGTERM killed `warehouse stream` at once (-15): no metrics file, the JVM on its own.
    import urllib.error
    import urllib.request

    txn = Txn(0x2000)
    txn.insert(TABLES[0], ["id"], {"id": ("int4", 1)})
    produce_events(kafka_bootstrap, unique_name, txn.events)
    proc, port, metrics = _stream(tmp_path, kafka_bootstrap, unique_name, "2 seconds")
    jvms: list[int] = []
    try:
        deadline = time.monotonic() + 300
        ready = False
        while not ready:  # the query runs
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-3000:]  # type: ignore[union-attr]
            with contextlib.suppress(OSError), urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as response:
                ready = response.status == 200
            time.sleep(0.1)
        jvms = [p for p in _children(proc.pid) if b"pyspark-shell" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(jvms) == 1
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == code, err.decode()[-3000:]
        assert not Path(f"/proc/{jvms[0]}").exists() or b"zombie" in Path(f"/proc/{jvms[0]}/status").read_bytes(), \
            "the driver JVM outlived walbus warehouse stream"
        assert metrics.exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        for jvm in jvms:
            with contextlib.suppress(ProcessLookupError):
                os.kill(jvm, signal.SIGKILL)
